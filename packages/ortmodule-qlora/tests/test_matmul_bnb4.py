"""MatMul4Bit exported as MatMulBnb4: forward and input gradient equal bitsandbytes in eager."""

from __future__ import annotations

import pytest
import torch
from bnb4_harness import FourBitBlock, eager, run_engine

# The engine multiplies with its own GEMM, bitsandbytes with PyTorch's: float32 sums in another
# order. Measured max difference on these sizes: 3e-7 (outputs), 1e-6 (gradients).
RTOL, ATOL = 1e-4, 1e-5


def _ops(model) -> list[str]:  # type: ignore[no-untyped-def]
    return [n.op_type for n in model.graph.node]


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "double-quant"])
def test_forward_and_input_gradient_match_eager(quant_type: str, nested: bool) -> None:
    torch.manual_seed(0)
    module = FourBitBlock(64, 48, quant_type, nested=nested)
    x = torch.randn(2, 5, 64)
    grad_out = torch.randn(2, 5, 48)
    run = run_engine(module, x, grad_out)
    assert "MatMulBnb4" in _ops(run.model) and "PythonOp" not in _ops(run.model)
    node = next(n for n in run.model.graph.node if n.op_type == "MatMulBnb4")
    attrs = {a.name: a.i for a in node.attribute}
    assert attrs["training_mode"] == 1 and attrs["transB"] == 1
    assert attrs["quant_type"] == {"fp4": 0, "nf4": 1}[quant_type]
    want_out, want_grads = eager(module, x, grad_out)
    torch.testing.assert_close(run.out, want_out, rtol=RTOL, atol=ATOL)
    assert set(run.grads) == {"input.x", "pre.weight", "pre.bias"}  # the 4-bit weight gets none
    for name, grad in run.grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=RTOL, atol=ATOL, msg=name)


def test_backward_rewrite_replaces_the_engines_cpu_gradient_node() -> None:
    torch.manual_seed(1)
    run = run_engine(
        FourBitBlock(64, 16, "nf4", bias=False), torch.randn(3, 64), torch.randn(3, 16)
    )
    bnb4 = [n for n in run.built.graph.node if n.op_type == "MatMulBnb4"]
    transb = [next(a.i for a in n.attribute if a.name == "transB") for n in bnb4]
    assert transb == [1]  # the forward node only; the backward one became dequantize + MatMul
    assert any(n.name.endswith("/dequantize/table") for n in run.built.graph.node)


def test_without_the_rewrite_the_engine_gradient_is_wrong() -> None:
    """Why the rewrite exists: the engine's own CPU backward gives a different input gradient."""
    from ortmodule_exporter.passes.built_graph import unregister_built_graph_pass
    from ortmodule_qlora.component import BACKWARD_PASS, register

    torch.manual_seed(2)
    module = FourBitBlock(64, 64, "nf4", bias=False)  # square, so the wrong node still runs
    x, grad_out = torch.randn(4, 64), torch.randn(4, 64)
    unregister_built_graph_pass(BACKWARD_PASS)
    try:
        run = run_engine(module, x, grad_out)
    finally:
        register()
    _, want = eager(module, x, grad_out)
    assert (run.grads["input.x"] - want["input.x"]).abs().max() > 1e-2


def test_generic_route_when_disabled_runs_bitsandbytes_inside_the_engine() -> None:
    from ortmodule_qlora import use_matmul_bnb4

    use_matmul_bnb4(False)
    torch.manual_seed(3)
    module = FourBitBlock(64, 16, "nf4")
    x, grad_out = torch.randn(3, 64), torch.randn(3, 16)
    run = run_engine(module, x, grad_out)
    assert "PythonOp" in _ops(run.model) and "MatMulBnb4" not in _ops(run.model)
    want_out, want = eager(module, x, grad_out)
    torch.testing.assert_close(run.out, want_out, rtol=RTOL, atol=ATOL)
    for name, grad in run.grads.items():
        torch.testing.assert_close(grad, want[name], rtol=RTOL, atol=ATOL, msg=name)
