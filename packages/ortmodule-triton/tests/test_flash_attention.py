"""Flash attention kernels (forward and backward) against torch's scaled_dot_product_attention,
with causal, padding (bool) and additive masks; under Triton's interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from ortmodule_triton.flash_attention import flash_attention


def inputs(b, h, sq, sk, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(shape, generator=gen, requires_grad=True)
        for shape in ((b, h, sq, d), (b, h, sk, d), (b, h, sk, d))
    ]


def check(q, k, v, mask, sdpa_mask, scale=None):
    ours = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    ref = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = flash_attention(*ours, scale=scale, mask=mask)
    want = torch.nn.functional.scaled_dot_product_attention(*ref, attn_mask=sdpa_mask, scale=scale)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    dy = torch.randn(want.shape, generator=torch.Generator().manual_seed(9))
    out.backward(dy)
    want.backward(dy)
    for name, a, b in zip("qkv", ours, ref, strict=True):
        torch.testing.assert_close(
            a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"d{n}: {m}"
        )


def test_no_mask_uneven_lengths_and_head_dim():
    # 20 queries, 37 keys, head dim 8: every block edge is partial
    q, k, v = inputs(2, 2, 20, 37, 8)
    check(q, k, v, None, None, scale=0.3)


def test_causal_mask():
    q, k, v = inputs(1, 3, 24, 24, 16, seed=1)
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    check(q, k, v, causal, causal)


def test_padding_mask_per_batch_as_bool_and_additive():
    q, k, v = inputs(2, 2, 12, 12, 8, seed=2)
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[1, 9:] = False  # the second sequence is padded after 9 tokens
    bool_mask = keep[:, None, None, :]
    check(q, k, v, bool_mask, bool_mask)
    additive = torch.zeros(2, 1, 1, 12).masked_fill(~bool_mask, torch.finfo(torch.float32).min)
    check(q, k, v, additive, additive)


def test_rejects_wrong_rank():
    q, k, v = inputs(1, 1, 4, 4, 8)
    with pytest.raises(ValueError, match=r"q must be \[batch, heads, seq, head_dim\]"):
        flash_attention(q[0], k, v)
