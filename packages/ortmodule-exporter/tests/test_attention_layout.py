"""Fused CPU attention on token-major tensors (``aten/attention_layout.py``) and the pass that
reads the heads' Transposes into it (``passes/attention_layout.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from ortmodule_exporter.aten import executor, parallel
from ortmodule_exporter.aten.attention_layout import FLASH, FLASH_BSHD, FLASH_BSHD_BACKWARD
from ortmodule_exporter.aten.executor import ATEN_DOMAIN
from ortmodule_exporter.onnx_graph import attribute
from ortmodule_exporter.passes.attention_layout import read_transposes_into_attention

B, S, H, D = 3, 10, 2, 8


def _bshd(seed: int) -> torch.Tensor:
    return torch.randn(B, S, H, D, generator=torch.Generator().manual_seed(seed))


def _reference(flags: str, mask: torch.Tensor | None) -> list[torch.Tensor]:
    """The kernel on the views eager hands it (token-major tensors transposed as views)."""
    q, k, v = (_bshd(i).transpose(1, 2) for i in range(3))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, mask is None, attn_mask=mask
    )
    grad = _bshd(3).transpose(1, 2)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, mask is None, attn_mask=mask
    )
    return [out, lse, dq, dk, dv]


def _ours(flags: str, mask: torch.Tensor | None) -> list[torch.Tensor]:
    def given(t: torch.Tensor, flag: str) -> torch.Tensor:
        # the layout the graph holds: token-major where flagged, else a contiguous copy
        return t if flag in flags else t.transpose(1, 2).contiguous()

    q, k, v = (given(_bshd(i), f) for i, f in enumerate("qkv"))
    settings = [torch.tensor(0.0, dtype=torch.float64), torch.tensor(mask is None), mask, None]
    out, lse = executor.execute(FLASH_BSHD, flags, [q, k, v, *settings])
    assert out is not None and lse is not None
    grad = given(_bshd(3), "o")
    grads = executor.execute(FLASH_BSHD_BACKWARD, flags, [grad, q, k, v, out, lse, *settings])

    def back(t: torch.Tensor | None, flag: str) -> torch.Tensor:
        assert t is not None
        return t.transpose(1, 2) if flag in flags else t

    return [back(out, "o"), lse, *(back(g, f) for g, f in zip(grads, "qkv", strict=True))]


@pytest.fixture(params=[1, 2], ids=["whole", "two_pieces"])
def pieces(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(parallel, "MIN_ATTENTION_WORK", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        with parallel.TorchThreadsInEngine(1):
            yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures("pieces")
@pytest.mark.parametrize("flags", ["qkvo", "kvo", "q", "o"])
@pytest.mark.parametrize("masked", [False, True])
def test_token_major_attention_is_bitwise_eagers_kernel_on_views(flags: str, masked: bool) -> None:
    mask = torch.randn(B, 1, S, S, generator=torch.Generator().manual_seed(9)) if masked else None
    for ours, ref in zip(_ours(flags, mask), _reference(flags, mask), strict=True):
        assert ours.shape == ref.shape
        assert torch.equal(ours, ref)


# -- the pass -------------------------------------------------------------------------------------


def _graph(q_transposed: bool, out_readers: int) -> onnx.ModelProto:
    nodes = []
    names = {}
    for t in "qkv":
        if t != "q" or q_transposed:
            nodes.append(
                helper.make_node("Transpose", [f"{t}_bshd"], [f"{t}_bhsd"], perm=[0, 2, 1, 3])
            )
            names[t] = f"{t}_bhsd"
        else:
            nodes.append(helper.make_node("Relu", ["q_bshd"], ["q_in"]))
            names[t] = "q_in"
    nodes.append(
        helper.make_node(
            "Constant", [], ["dropout"], value=onnx.numpy_helper.from_array(np.array(0.0))
        )
    )
    nodes.append(
        helper.make_node(
            "Constant", [], ["causal"], value=onnx.numpy_helper.from_array(np.array(True))
        )
    )
    nodes.append(
        helper.make_node(
            "ATen",
            [names["q"], names["k"], names["v"], "dropout", "causal", "", ""],
            ["att", "lse"],
            domain=ATEN_DOMAIN,
            operator=FLASH,
            overload_name="",
        )
    )
    outputs = []
    for i in range(out_readers):
        nodes.append(helper.make_node("Transpose", ["att"], [f"y{i}"], perm=[0, 2, 1, 3]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    inputs = [
        helper.make_tensor_value_info(f"{t}_bshd", TensorProto.FLOAT, [B, S, H, D]) for t in "qkv"
    ]
    return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs))


def _attention(model: onnx.ModelProto) -> onnx.NodeProto:
    (node,) = [n for n in model.graph.node if n.op_type == "ATen"]
    return node


def test_the_pass_reads_every_transpose_away() -> None:
    model = _graph(q_transposed=True, out_readers=1)
    assert read_transposes_into_attention(model) == 1
    node = _attention(model)
    assert attribute(node, "operator") == FLASH_BSHD and attribute(node, "overload_name") == "qkvo"
    assert list(node.input[:3]) == ["q_bshd", "k_bshd", "v_bshd"] and node.output[0] == "y0"
    assert not [n for n in model.graph.node if n.op_type == "Transpose"]


def test_the_pass_keeps_what_is_not_a_transpose_or_read_twice() -> None:
    model = _graph(q_transposed=False, out_readers=2)
    assert read_transposes_into_attention(model) == 1
    node = _attention(model)
    assert attribute(node, "overload_name") == "kv"
    assert node.input[0] == "q_in" and node.output[0] == "att"
    assert len([n for n in model.graph.node if n.op_type == "Transpose"]) == 2  # the readers
