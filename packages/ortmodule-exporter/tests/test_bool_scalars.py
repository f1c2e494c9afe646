"""A Python bool given to an operator's Scalar argument exports (torch 2.13's tracer records it
as a bool constant no schema accepts, and the trace died in the alias analysis): the indexer
mask of DeepSeek-sparse-attention models, ``new_ones(..., dtype=bool).scatter(-1, idx, False)``,
and calls whose result dtype depends on the bool being a bool."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import assert_engine_matches_eager


class _TopKMask(torch.nn.Module):
    """DeepSeek V3.2's sparse attention: keys outside each query's top-k are masked out."""

    def __init__(self) -> None:
        super().__init__()
        self.indexer = torch.nn.Linear(6, 5)
        self.scores = torch.nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index_scores = self.indexer(x)
        topk = index_scores.topk(2, dim=-1).indices
        masked = topk.new_ones((*x.shape[:-1], 5), dtype=torch.bool).scatter(-1, topk, False)
        scores = (self.scores(x) + index_scores).masked_fill(masked, torch.finfo(x.dtype).min)
        return scores.softmax(-1), masked


def test_scatter_of_a_bool_into_a_topk_mask_matches_eager() -> None:
    torch.manual_seed(0)
    run = assert_engine_matches_eager(_TopKMask(), (torch.randn(2, 4, 6, requires_grad=True),))
    assert run.outputs[1].dtype == torch.bool


class _Op(torch.nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.fn = fn

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.linear(x)
        return y.sum(), self.fn(y, y > 0)


def _in_place(y: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return y.clone().masked_fill_(b, True)


CALLS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "and": lambda y, b: b & True,  # bool & int would be int64
    "where": lambda y, b: torch.where(b, y, False),
    "full": lambda y, b: torch.full((2, 3), False) | b[0, :3].unsqueeze(0),
    "eq": lambda y, b: b == True,  # noqa: E712
    "masked_fill_float": lambda y, b: y.masked_fill(b, True),
    "masked_fill_in_place": _in_place,
}


@pytest.mark.parametrize("name", list(CALLS))
def test_bool_for_a_scalar_keeps_eager_dtype_and_values(name: str) -> None:
    torch.manual_seed(0)
    module = _Op(CALLS[name])
    x = torch.randn(3, 4)
    expected = module(x)[1]
    run = assert_engine_matches_eager(module, (x,))
    assert run.outputs[1].dtype == expected.dtype
