"""``torch.topk`` picks the indices eager picks, ties included.

ONNX ``TopK`` puts the lower index first among equal values, PyTorch's CPU kernel does not: a
router with a zero-initialized gate (all experts scored the same, as in AFMoE) sent tokens to
other experts under the engine than in eager, and the first loss differed.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_engine_matches_eager
from torch import nn

from ortmodule_exporter.aten import executor as aten_executor
from ortmodule_exporter.aten import gradients as custom_gradients


@pytest.fixture(autouse=True)
def _aten() -> None:
    aten_executor.install()
    custom_gradients.install_gradients()


class Router(nn.Module):
    """Scores every expert the same at initialization; mixes the picked experts' outputs."""

    def __init__(self, experts: int = 8, k: int = 3, largest: bool = True) -> None:
        super().__init__()
        self.gate = nn.Linear(4, experts, bias=False)
        nn.init.zeros_(self.gate.weight)
        self.experts = nn.Parameter(torch.randn(experts, 4))
        self.k, self.largest = k, largest

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.sigmoid(self.gate(x))
        top, picked = torch.topk(scores, self.k, dim=-1, largest=self.largest)
        return (top.unsqueeze(-1) * self.experts[picked]).sum(1) * x


@pytest.mark.parametrize("largest", [True, False])
def test_topk_ties_pick_eagers_indices(largest: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 4, requires_grad=True)
    assert_engine_matches_eager(Router(largest=largest), (x,))


def test_topk_values_and_gradient() -> None:
    class TopK(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.topk(x, 2, dim=1, sorted=True)

    x = torch.randn(3, 5, 4, requires_grad=True)
    assert_engine_matches_eager(TopK(), (x,))


def test_topk_with_k_from_a_size() -> None:
    class HalfTopK(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.topk(x, x.shape[-1] // 2, dim=-1).values * 2

    x = torch.randn(3, 6, requires_grad=True)
    assert_engine_matches_eager(HalfTopK(), (x,))
