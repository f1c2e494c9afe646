"""A 4-bit layer whose input needs no gradient: bitsandbytes calls ``gemm_4bit`` (or
``gemv_4bit``) instead of ``MatMul4Bit``; both export as MatMulBnb4 and match eager."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch
from bnb4_harness import FourBitBlock, eager, run_engine

from ortmodule_exporter import ExportError, export

# As for MatMul4Bit: the engine's GEMM and PyTorch's sum float32 in another order. Measured max
# difference (2026-11-26): 2e-7 (outputs), 5e-7 (gradients of the head).
RTOL, ATOL = 1e-4, 1e-5


class FrozenFirst(torch.nn.Module):
    """A frozen 4-bit layer fed by the plain input, then a trainable head: an unchanged model."""

    def __init__(self, quant_type: str, nested: bool, bias: bool = True) -> None:
        super().__init__()
        self.q = FourBitBlock(64, 32, quant_type, bias=bias, nested=nested).q
        self.head = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.q(x)))


def _ops(model) -> list[str]:  # type: ignore[no-untyped-def]
    return [n.op_type for n in model.graph.node]


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "double-quant"])
def test_gemm_4bit_exports_as_matmul_bnb4_and_matches_eager(quant_type: str, nested: bool) -> None:
    torch.manual_seed(0)
    module = FrozenFirst(quant_type, nested)
    x, grad_out = torch.randn(2, 5, 64), torch.randn(2, 5, 8)
    run = run_engine(module, x, grad_out, input_grad=False)
    ops = _ops(run.model)
    assert ops.count("MatMulBnb4") == 1 and "PythonOp" not in ops and "ATen" not in ops
    # the scales became a constant: no graph input stands for a state-dict entry of the weight
    inputs = [i.name for i in run.model.graph.input]
    assert not [name for name in inputs if "absmax" in name or "quant" in name], inputs
    want_out, want = eager(module, x, grad_out, input_grad=False)
    torch.testing.assert_close(run.out, want_out, rtol=RTOL, atol=ATOL)
    assert set(run.grads) == {"head.weight", "head.bias"} == set(want)
    for name, grad in run.grads.items():
        torch.testing.assert_close(grad, want[name], rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize(
    ("k", "dtype", "message"),
    [
        # MatMulBnb4 needs whole blocks per row
        (32, torch.float32, "not a multiple of its block size"),
        (64, torch.bfloat16, "its input is BFloat16"),
    ],
    ids=["rows-not-whole-blocks", "bfloat16"],
)
def test_gemm_4bit_the_node_cannot_express_is_refused_with_what_to_do(
    k: int, dtype: torch.dtype, message: str
) -> None:
    """The operator has no autograd Function to run as a PythonOp: no route but a message."""
    torch.manual_seed(0)
    layer = FourBitBlock(k, 16, "nf4", bias=False).q.to(dtype)
    with pytest.raises(ExportError, match=f"{message}.*enable_input_require_grads"):
        export(layer, (torch.randn(2, k, dtype=dtype),), training=True)


class DirectGemv(torch.nn.Module):
    """Calls ``bnb.functional.gemv_4bit`` itself, as inference code written for bitsandbytes
    does; then a trainable head."""

    def __init__(self, quant_type: str) -> None:
        super().__init__()
        self.q = FourBitBlock(64, 32, quant_type, bias=False).q
        self.head = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.q.weight
        return self.head(bnb.functional.gemv_4bit(x, w.t(), state=w.quant_state))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_gemv_4bit_exports_as_matmul_bnb4_and_matches_eager(quant_type: str) -> None:
    if bnb.functional.has_avx512bf16():
        pytest.skip("on AVX512-BF16 CPUs gemv_4bit reads a repacked layout (refused, test_limits)")
    torch.manual_seed(0)
    module = DirectGemv(quant_type)
    x, grad_out = torch.randn(1, 64), torch.randn(1, 8)
    run = run_engine(module, x, grad_out, input_grad=False)
    ops = _ops(run.model)
    assert ops.count("MatMulBnb4") == 1 and "PythonOp" not in ops and "ATen" not in ops
    want_out, want = eager(module, x, grad_out, input_grad=False)
    torch.testing.assert_close(run.out, want_out, rtol=RTOL, atol=ATOL)
    for name, grad in run.grads.items():
        torch.testing.assert_close(grad, want[name], rtol=RTOL, atol=ATOL, msg=name)
