"""ORTMODULE_USE_FLASH_ATTENTION=1 in the verification route: the attention patterns of
scaled_dot_product_attention (causal) and of hand-written Hugging Face attention (Div scale,
additive padding mask) become one flash-attention PythonOp; training matches eager through the
real CPU engine."""

from __future__ import annotations

import math

import pytest
import torch
from test_graph_pass import engine_step

from ortmodule_exporter import export
from ortmodule_triton import (
    last_report,
    register_triton_pass,
    unregister_triton_pass,
    verification_mode,
)
from ortmodule_triton.attention_fusion import find_attention

ON = {"ORTMODULE_USE_TRITON": True, "ORTMODULE_USE_FLASH_ATTENTION": True}


class SdpaCausal(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, -1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, s, 16)


class SdpaMasked(torch.nn.Module):
    """Hugging Face's SDPA path: a 4-D padding mask passed as attn_mask (bool or additive)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, -1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return y.transpose(1, 2).reshape(b, s, 16)


class HandWrittenPadded(torch.nn.Module):
    """BERT-style: scores / sqrt(d) + (1 - mask) * min, softmax, @ v."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, -1))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(8)
        bias = (1.0 - keep[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        probs = torch.softmax(scores + bias, dim=-1)
        return torch.matmul(probs, v).transpose(1, 2).reshape(b, s, 16)


@pytest.fixture(autouse=True)
def registered():
    register_triton_pass()
    yield
    unregister_triton_pass()


def test_patterns_are_found():
    x = torch.randn(2, 5, 16)
    keep = torch.ones(2, 5)
    assert len(find_attention(export(SdpaCausal(), (x,), training=True).model)) == 1
    (match,) = find_attention(export(HandWrittenPadded(), (x, keep), training=True).model)
    assert match.divide and match.mask is not None


@pytest.mark.parametrize(
    "which", ["sdpa_causal", "hand_written_padded", "sdpa_bool_mask", "sdpa_additive_mask"]
)
def test_flash_attention_trains_like_eager(which):
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    keep = torch.ones(2, 6)
    keep[1, 4:] = 0  # the second sequence is padded after 4 tokens
    if which == "sdpa_causal":
        module, eager, extra = SdpaCausal(), SdpaCausal(), ()
    elif which == "hand_written_padded":
        module, eager, extra = HandWrittenPadded(), HandWrittenPadded(), (keep,)
    else:
        mask = keep.bool()[:, None, None, :].expand(2, 1, 6, 6)
        if which == "sdpa_additive_mask":
            mask = torch.zeros(2, 1, 6, 6).masked_fill(~mask, torch.finfo(torch.float32).min)
        module, eager, extra = SdpaMasked(), SdpaMasked(), (mask.contiguous(),)
    eager.load_state_dict(module.state_dict())
    with verification_mode():
        out, grads, dy, model = engine_step(module, x, {**ON}, extra=extra)
    assert last_report().attention == 1
    ops = [n.op_type for n in model.graph.node]
    assert "Softmax" not in ops and ops.count("PythonOp") >= 1
    want = eager(x, *extra)
    torch.testing.assert_close(out, want.detach(), rtol=1e-4, atol=1e-5)
    want.backward(dy)
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)
