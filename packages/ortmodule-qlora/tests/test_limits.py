"""What MatMulBnb4 cannot take goes another way or stops with a message; never wrong numbers."""

from __future__ import annotations

import types

import pytest
import torch
from bnb4_harness import FourBitBlock, eager, run_engine

from ortmodule_exporter import ExportError, export
from ortmodule_qlora import UnsupportedQuantState, engine_layout


@pytest.mark.parametrize("block", [32, 128])
def test_other_power_of_two_block_sizes_run_natively(block: int) -> None:
    torch.manual_seed(0)
    module = FourBitBlock(128, 32, "nf4", block=block)
    x, grad_out = torch.randn(3, 128), torch.randn(3, 32)
    run = run_engine(module, x, grad_out)
    node = next(n for n in run.model.graph.node if n.op_type == "MatMulBnb4")
    assert {a.name: a.i for a in node.attribute}["block_size"] == block
    want_out, want = eager(module, x, grad_out)
    torch.testing.assert_close(run.out, want_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(run.grads["input.x"], want["input.x"], rtol=1e-4, atol=1e-5)


def _state(**overrides: object) -> types.SimpleNamespace:
    base = {
        "shape": torch.Size([16, 64]),
        "quant_type": "nf4",
        "blocksize": 64,
        "nested": False,
        "absmax": torch.ones(16),
        "state2": None,
    }
    base.update(overrides)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"blocksize": 24, "absmax": torch.ones(22)}, "block size 24 is not a power of two >= 16"),
        ({"blocksize": 8, "absmax": torch.ones(64)}, "block size 8 is not a power of two >= 16"),
        ({"quant_type": "int4"}, "quant_type 'int4' is not one of"),
        ({"shape": torch.Size([2, 16, 32])}, "MatMulBnb4 takes a 2-D weight"),
        ({"packing_format_for_cpu": True}, "packing_format_for_cpu"),
        ({"absmax": torch.ones(5)}, "absmax has 5 scales"),
        ({"blocksize": 128, "absmax": torch.ones(4)}, "not a multiple of its block size 128"),
    ],
)
def test_layouts_the_engine_cannot_read_are_named(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(UnsupportedQuantState, match=message):
        engine_layout(_state(**overrides))


def test_rows_not_a_multiple_of_the_block_keep_the_generic_route() -> None:
    """K=32 with blocks of 64: the engine would scale the wrong elements, bitsandbytes runs it."""
    torch.manual_seed(0)
    ops = [
        n.op_type
        for n in export(
            FourBitBlock(32, 16, "nf4"), (torch.randn(2, 32),), training=True
        ).model.graph.node
    ]
    assert "PythonOp" in ops and "MatMulBnb4" not in ops


def test_bfloat16_input_keeps_the_generic_pythonop_route() -> None:
    torch.manual_seed(0)
    module = FourBitBlock(64, 16, "nf4").to(torch.bfloat16)
    ops = [
        n.op_type
        for n in export(
            module, (torch.randn(2, 64, dtype=torch.bfloat16),), training=True
        ).model.graph.node
    ]
    assert "PythonOp" in ops and "MatMulBnb4" not in ops


def test_eval_mode_repacking_for_the_cpu_kernel_is_refused_with_what_to_do() -> None:
    from bitsandbytes.nn.modules import has_avx512bf16

    if not has_avx512bf16():
        pytest.skip("bitsandbytes repacks 4-bit weights for inference only on AVX512-BF16 CPUs")
    torch.manual_seed(0)
    layer = FourBitBlock(64, 64, "nf4").q.eval()
    with pytest.raises(ExportError, match="gemv_4bit.*repacks its weight"):
        export(layer, (torch.randn(2, 64),), training=False)
