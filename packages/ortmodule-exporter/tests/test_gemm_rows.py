"""bfloat16 GEMMs of PyTorch-run nodes in row pieces (``aten/gemm_rows.py``).

Every comparison is bitwise (``torch.equal``) against the same call made whole, for each layout
PyTorch's reference kernel takes a different path for; the module is only active where that
kernel is PyTorch's bfloat16 GEMM (x86 without AVX-512), so elsewhere the tests are skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from ortmodule_exporter.aten import aten_op, gemm_rows, parallel

pytestmark = pytest.mark.skipif(
    not gemm_rows.reference_kernel(),
    reason="PyTorch's bfloat16 GEMM is oneDNN's here, not the reference kernel cut in rows",
)


@pytest.fixture
def two_pieces(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """PyTorch at two threads (an engine run cuts in two), every GEMM large enough to cut;
    yields the number of pieces of each cut call."""
    monkeypatch.setattr(gemm_rows, "MIN_GEMM_WORK", 0)
    counts: list[int] = []
    real = parallel.run_pieces

    def counting(pieces):  # type: ignore[no-untyped-def]
        counts.append(len(pieces))
        return real(pieces)

    monkeypatch.setattr(parallel, "run_pieces", counting)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield counts
    finally:
        torch.set_num_threads(before)


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _t(x: torch.Tensor) -> torch.Tensor:
    """The same values in the transposed memory layout."""
    return x.t().contiguous().t()


X, W, B = _bf16(37, 48, seed=0), _bf16(48, 24, seed=1), _bf16(24, seed=2)
CALLS: dict[str, Callable[[], torch.Tensor]] = {
    "mm": lambda: torch.mm(X, W),
    "mm_a_transposed": lambda: torch.mm(_t(X), W),
    "mm_b_transposed": lambda: torch.mm(X, _t(W)),
    "mm_both_transposed": lambda: torch.mm(_t(X), _t(W)),
    "addmm_row_bias": lambda: torch.addmm(B, X, W),
    "addmm_full_bias": lambda: torch.addmm(_bf16(37, 24, seed=3), X, _t(W)),
    "addmm_beta_alpha": lambda: torch.addmm(B, X, W, beta=0.5, alpha=2.0),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_row_pieces_are_bitwise_the_whole(name: str, two_pieces: list[int]) -> None:
    whole = CALLS[name]()
    with parallel.TorchThreadsInEngine(1), gemm_rows.row_pieces([X]):
        cut = CALLS[name]()
    assert two_pieces == [2]
    assert cut.dtype == whole.dtype and cut.shape == whole.shape
    assert torch.equal(cut, whole)


def test_float32_and_one_thread_run_whole(two_pieces: list[int]) -> None:
    with parallel.TorchThreadsInEngine(1), gemm_rows.row_pieces([X.float()]):
        torch.mm(X.float(), W.float())
    with gemm_rows.row_pieces([X]):  # outside an engine run: width 1
        torch.mm(X, W)
    assert two_pieces == []


def test_aten_op_forward_and_autograd_backward_in_pieces(two_pieces: list[int]) -> None:
    """A linear layer's forward and its autograd backward (input and weight gradients) through
    AtenOp, as the engine runs a bfloat16 node: bitwise eager's."""
    x = _bf16(40, 32, seed=4).requires_grad_(True)
    linear = nn.Linear(32, 16).bfloat16()
    grad = _bf16(40, 16, seed=5)
    want = linear(x)
    want_grads = torch.autograd.grad(want, [x, linear.weight, linear.bias], grad)
    with parallel.TorchThreadsInEngine(1):
        out = aten_op.AtenOp.apply("linear|", x, linear.weight, linear.bias)[0]
        got_grads = torch.autograd.grad(out, [x, linear.weight, linear.bias], grad)
    assert len(two_pieces) >= 3  # forward, input gradient, weight gradient
    assert torch.equal(out, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert torch.equal(g, w)
