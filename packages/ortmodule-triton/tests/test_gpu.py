"""The same checks on CUDA (skipped without a GPU; never run so far): generated kernels compiled by
Triton against the reference evaluator, flash attention against torch's SDPA."""

from __future__ import annotations

import pytest
import torch
from helpers import model
from onnx import TensorProto as T
from onnx import helper as h
from onnx.reference import ReferenceEvaluator

from ortmodule_triton import compile_subgraph

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layer_norm_softmax_chain_on_cuda(dtype):
    onnx_type = T.FLOAT if dtype == torch.float32 else T.FLOAT16
    m = model(
        [
            h.make_node("LayerNormalization", ["x", "w", "b"], ["n"], axis=-1),
            h.make_node("Softmax", ["n"], ["y"], axis=-1),
        ],
        [("x", onnx_type, ["a", 300]), ("w", onnx_type, [300]), ("b", onnx_type, [300])],
        [("y", onnx_type, ["a", 300])],
    )
    feeds = [torch.randn(64, 300).to(dtype), torch.randn(300).to(dtype), torch.randn(300).to(dtype)]
    (got,) = compile_subgraph(m)(*[f.cuda() for f in feeds])
    (want,) = ReferenceEvaluator(m).run(
        None, dict(zip("xwb", [f.numpy() for f in feeds], strict=True))
    )
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 4e-3, "atol": 2e-3}
    torch.testing.assert_close(got.cpu().float(), torch.from_numpy(want).float(), **tol)


def test_flash_attention_on_cuda():
    from ortmodule_triton.flash_attention import flash_attention

    q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", requires_grad=True) for _ in range(3))
    causal = torch.ones(128, 128, dtype=torch.bool, device="cuda").tril()
    out = flash_attention(q, k, v, mask=causal)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    # tl.dot on fp32 uses TF32 on Ampere and later
    torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)
