"""Bugs the differential fuzzer (ortmodule_testing.fuzz) found, each as its shrunk program.

Each test trains its program for the steps the fuzzer ran, in eager and under ORTModule
(fallback disabled), and compares loss, outputs and every gradient. The ones still open are
``xfail(strict=True)``: when a fix lands the test passes, strict xfail fails it, and the marker
goes (and the fuzzer's switch for that feature, where it has one, is turned on).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ortmodule import ORTModule
from ortmodule_testing.parity import assert_tree_close

torch.set_num_threads(1)


def _train(model: nn.Module, batches: list[torch.Tensor]) -> list[object]:
    """Loss, output and parameter gradients of each step (SGD between steps)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    records: list[object] = []
    for x in batches:
        optimizer.zero_grad(set_to_none=True)
        out = model(x)
        weights = torch.linspace(-1.0, 1.0, out.numel()).reshape(out.shape) + 0.5
        loss = (out * weights).sum()
        loss.backward()  # type: ignore[no-untyped-call]
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        records.append((loss.detach(), out.detach().clone(), grads))
        optimizer.step()
    return records


def _parity(make: type[nn.Module], batches: list[torch.Tensor]) -> None:
    torch.manual_seed(0)
    eager = _train(make(), batches)
    torch.manual_seed(0)
    got = _train(ORTModule(make()), batches)
    assert_tree_close(got, eager)


class VectorTimesBatched(nn.Module):
    """torch.matmul(v, x) with v of shape (k,) and x of shape (..., k, m)."""

    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.tensor([0.3, -0.5, 0.8]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self.v, x)


@pytest.mark.xfail(
    strict=True,
    reason="open (found 2026-11-26): the engine's MatMul gradient for a 1-D left operand and a "
    "batched right one multiplies the (batch, m) output gradient by x^T as a matrix "
    "(FusedMatMul(dY, x, transB=1)) instead of as one row per batch, then sums: v.grad is wrong "
    "(or the kernel fails on the shapes). Fix: export matmul(v, x) as "
    "Squeeze(MatMul(Unsqueeze(v, 0), x), -2) so the engine sees a 2-D operand.",
)
def test_vector_times_batched_matrix() -> None:
    g = torch.Generator().manual_seed(0)
    _parity(VectorTimesBatched, [torch.randn(2, 3, 4, generator=g) for _ in range(2)])


def test_vector_times_matrix_is_right() -> None:
    """The 2-D case of the same op is right (so the bug is the batched gradient only)."""
    g = torch.Generator().manual_seed(0)
    _parity(VectorTimesBatched, [torch.randn(3, 4, generator=g) for _ in range(2)])


class ExpandAfterStepSlice(nn.Module):
    """x[:, 1::2] of a (3, 3) input has one column; expand(-1, 2) repeats it."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 1::2].expand(-1, 2) * self.p


@pytest.mark.xfail(
    strict=True,
    reason="open (found 2026-11-26): every input dim is exported dynamic, and the engine's "
    "pre-gradient graph gives the stepped Slice's output the Expand's width (2, from ONNX "
    "broadcast inference) and drops the Expand: the output is (3, 1) instead of (3, 2).",
)
def test_expand_after_a_stepped_slice() -> None:
    g = torch.Generator().manual_seed(0)
    _parity(ExpandAfterStepSlice, [torch.randn(3, 3, generator=g) for _ in range(2)])


class LoopOverDim(nn.Module):
    """A Python loop over a dim whose size changes between steps (a scan)."""

    def __init__(self) -> None:
        super().__init__()
        self.decay = nn.Parameter(torch.tensor([0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros_like(x.select(1, 0))
        steps = []
        for i in range(x.shape[1]):
            h = torch.tanh(h * self.decay + x.select(1, i))
            steps.append(h)
        return torch.stack(steps, dim=1)


@pytest.mark.xfail(
    strict=True,
    reason="open (found 2026-11-26): the trace unrolls range(x.shape[1]) into as many steps as "
    "the first call had, while every input dim is exported dynamic and no guard checks the "
    "size: a longer input gives the first call's number of steps (a wrong output shape and "
    "gradients), a shorter one fails in a Gather.",
)
def test_loop_over_a_dim_that_grows() -> None:
    g = torch.Generator().manual_seed(0)
    _parity(LoopOverDim, [torch.randn(2, 3, 4, generator=g), torch.randn(2, 5, 4, generator=g)])


class ReturnedAndUsed(nn.Module):
    """An intermediate both returned and read by the next op of forward."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(0.7))
        self.kind = kind

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "unsqueeze":
            kept = (x * 2.0).unsqueeze(0)
        else:
            kept = torch.tril(x * 2.0, diagonal=1)
        return kept * 1.5 * self.p, kept


@pytest.mark.xfail(
    strict=True,
    reason="open (found 2026-11-26): a returned intermediate that the next forward op also "
    "reads is overwritten while the engine runs backward: right when forward returns, after "
    "backward it holds kept * 1.5. In the execution graph the returned 'output.1' is an "
    "Unsqueeze, which aliases the buffer of the Mul before it; that buffer's last reader is the "
    "Unsqueeze, so the engine's planner reuses it in backward for Mul_2_Grad's PreReduceGrad1 "
    "(output.0_grad * kept * 1.5), although PyTorch still holds output.1. Also seen for tril of "
    "a (1, 6, 3, 1) input; independent of ORTMODULE_KERNEL_CHOICE and the compute optimizer.",
)
@pytest.mark.parametrize(("kind", "shape"), [("unsqueeze", (4, 3)), ("tril", (1, 6, 3, 1))])
def test_a_returned_intermediate_survives_backward(kind: str, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = ORTModule(ReturnedAndUsed(kind))
    x = torch.randn(*shape)
    out, kept = model(x)
    before = kept.detach().clone()
    weights = torch.linspace(-1.0, 1.0, kept.numel()).reshape(kept.shape)
    (out.sum() + (kept * weights).sum()).backward()  # type: ignore[no-untyped-call]
    assert_tree_close(kept.detach(), before)
