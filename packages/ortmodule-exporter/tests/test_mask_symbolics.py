"""The mask and position arithmetic of Hugging Face models exports validly and differentiates:
cumsum on bool/int tensors, torch.where with a broadcast differentiable branch, and outputs
that depend on no input (a cache's constant tensors)."""

from __future__ import annotations

from typing import Any

import torch
from conftest import assert_engine_matches_eager, run_engine

from ortmodule_exporter import export


class _BoolCumsum(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> Any:
        packed = (ids != 1).cumsum(-1)  # bool -> int64, as transformers' masking_utils does
        positions = torch.cumsum(ids, 1, dtype=torch.int32)
        small = (ids.to(torch.int16)).cumsum(0)
        return self.linear(x) * (packed > 1).unsqueeze(-1), packed, positions, small


def test_cumsum_of_bool_and_small_ints_matches_eager_types_and_values() -> None:
    torch.manual_seed(0)
    x, ids = torch.randn(2, 5, 6), torch.randint(0, 3, (2, 5))
    run = assert_engine_matches_eager(_BoolCumsum(), (x, ids))
    assert [o.dtype for o in run.outputs[1:4]] == [torch.int64, torch.int32, torch.int64]


class _BroadcastBias(torch.nn.Module):
    """T5's relative position bias: (heads, q, k) unsqueezed to (1, heads, q, k), then masked
    against a (batch, 1, q, k) padding mask."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(4, 5, 5))

    def forward(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        biased = torch.where(mask, self.bias.unsqueeze(0), torch.finfo(scores.dtype).min)
        return torch.softmax(scores + biased, dim=-1)


def test_where_with_a_broadcast_differentiable_branch_reduces_its_gradient() -> None:
    torch.manual_seed(0)
    mask = torch.rand(2, 1, 5, 5) > 0.3
    mask[..., 0] = True
    assert_engine_matches_eager(_BroadcastBias(), (torch.randn(2, 4, 5, 5), mask))


class _ConstantOutput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), torch.tensor(4096, dtype=torch.long)


def test_outputs_computed_from_no_input_come_back_from_the_trace() -> None:
    exported = export(_ConstantOutput(), (torch.randn(2, 3),), training=True)
    assert exported.user_output_names == ("output.0",)
    assert list(exported.constant_outputs) == [1]
    run = run_engine(_ConstantOutput(), (torch.randn(2, 3),))  # the gradient graph builds
    restored = exported.restore_outputs(run.outputs[:1])
    assert restored[0] is run.outputs[0] and int(restored[1]) == 4096


class _Diffs(torch.nn.Module):
    """``torch.diff`` as transformers' ``find_packed_sequence_indices`` runs it on position
    ids, and on float, bool and higher orders."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> Any:
        first = positions[:, :1] - 1
        steps = torch.diff(positions, prepend=first, dim=-1)
        packed = (steps != 1).cumsum(-1)
        y = self.linear(x)
        along_rows = torch.diff(y, dim=1)
        second = torch.diff(y, n=2, dim=-1, append=y[..., :2])
        flips = torch.diff(positions > 2, dim=0)
        return y * (packed > 0).unsqueeze(-1), along_rows, second, steps, flips


def test_diff_exports_as_onnx_slices_and_trains_like_eager() -> None:
    """No ATen node is left (its output shape was unknown to symbolic shape inference, which
    then named no dim of the whole graph: ``engine.model_with_named_dims``)."""
    from ortmodule_exporter.engine import _unshaped_nodes

    torch.manual_seed(0)
    x = torch.randn(3, 5, 6)
    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4], [5, 6, 0, 1, 2]])
    exported = export(_Diffs(), (x, positions), training=True)
    assert _unshaped_nodes(exported.model) == set()
    assert not [n for n in exported.model.graph.node if n.op_type == "ATen"]
    run = assert_engine_matches_eager(_Diffs(), (x, positions))
    assert [o.dtype for o in run.outputs[3:5]] == [torch.int64, torch.bool]
