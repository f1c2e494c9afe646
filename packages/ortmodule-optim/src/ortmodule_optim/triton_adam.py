"""The CUDA path of FusedAdam: one Triton launch updates every tensor of a bucket.

Imported only from FusedAdam's CUDA branch, so ``import ortmodule_optim`` never imports triton.
Tensors of a bucket live in separate allocations; the kernel addresses each one as an int64
element offset from the bucket's first tensor, and a chunk table maps every program to
(tensor, first element). The math is ``torch.optim.AdamW``'s, op for op, in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ortmodule_optim.adam_bucket import Bucket, Hyper

__all__ = ["triton_adam_step"]

BLOCK = 1024
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit  # type: ignore[untyped-decorator,unused-ignore]
def _adam_kernel(  # type: ignore[no-untyped-def,unused-ignore]
    p_base,
    g_base,
    m_base,
    v_base,
    p_offsets,
    g_offsets,
    m_offsets,
    v_offsets,
    chunk_tensor,
    chunk_start,
    numels,
    decay,
    weight_decay,
    lerp_weight,
    beta2,
    one_minus_beta2,
    eps,
    neg_step_size,
    bias_correction2_sqrt,
    DECAY_MODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor + pid)
    start = tl.load(chunk_start + pid)
    n = tl.load(numels + t)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    p_ptr = p_base + tl.load(p_offsets + t) + offs
    g_ptr = g_base + tl.load(g_offsets + t) + offs
    m_ptr = m_base + tl.load(m_offsets + t) + offs
    v_ptr = v_base + tl.load(v_offsets + t) + offs
    p = tl.load(p_ptr, mask=mask).to(tl.float32)
    g = tl.load(g_ptr, mask=mask).to(tl.float32)
    m = tl.load(m_ptr, mask=mask).to(tl.float32)
    v = tl.load(v_ptr, mask=mask).to(tl.float32)
    if DECAY_MODE == 1:  # AdamW: decoupled
        p = p * decay
    elif DECAY_MODE == 2:  # Adam: L2 added to the gradient
        g = g + weight_decay * p
    # torch.lerp picks its formula by the weight, keep the same rounding
    m = tl.where(lerp_weight < 0.5, m + lerp_weight * (g - m), g - (g - m) * (1.0 - lerp_weight))
    v = v * beta2
    v = v + one_minus_beta2 * (g * g)
    denom = tl.sqrt(v) / bias_correction2_sqrt + eps
    p = p + (neg_step_size * m) / denom
    # Half-precision tensors are rounded once, at the store (to nearest even, Triton's default
    # downcast, as torch's), where torch rounds after every operation: closer to the exact update.
    out_ty = p_ptr.dtype.element_ty
    tl.store(p_ptr, p.to(out_ty), mask=mask)
    tl.store(m_ptr, m.to(out_ty), mask=mask)
    tl.store(v_ptr, v.to(out_ty), mask=mask)


def _offsets(tensors: list[torch.Tensor]) -> list[int]:
    size = tensors[0].element_size()
    base = tensors[0].data_ptr()
    return [(t.data_ptr() - base) // size for t in tensors]


def _static_tables(bucket: Bucket) -> dict[str, Any]:
    device = bucket.params[0].device
    chunk_tensor: list[int] = []
    chunk_start: list[int] = []
    numels = []
    for i, p in enumerate(bucket.params):
        n = p.numel()
        numels.append(n)
        starts = range(0, n, BLOCK)
        chunk_tensor.extend([i] * len(starts))
        chunk_start.extend(starts)

    def as_tensor(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int64).to(device, non_blocking=True)

    return {
        "chunk_tensor": as_tensor(chunk_tensor),
        "chunk_start": as_tensor(chunk_start),
        "numels": as_tensor(numels),
        "m_offsets": as_tensor(_offsets(bucket.exp_avgs)),
        "v_offsets": as_tensor(_offsets(bucket.exp_avg_sqs)),
        "chunks": len(chunk_tensor),
        "contiguous": all(
            t.is_contiguous()
            for ts in (bucket.params, bucket.exp_avgs, bucket.exp_avg_sqs)
            for t in ts
        ),
    }


def triton_adam_step(bucket: Bucket, grads: list[torch.Tensor], h: Hyper) -> bool:
    """Update ``bucket`` in one launch; False (nothing done, use foreach) where the kernel does
    not apply: a non-contiguous tensor, or float64 (the kernel computes in fp32)."""
    if bucket.params[0].dtype not in _KERNEL_DTYPES:
        return False
    cache = bucket.kernel_cache
    if not cache:
        cache.update(_static_tables(bucket))
    if not cache["contiguous"] or not all([g.is_contiguous() for g in grads]):
        return False
    if cache["chunks"] == 0:
        return True
    device = bucket.params[0].device
    n = len(grads)
    pg = torch.tensor(_offsets(bucket.params) + _offsets(grads), dtype=torch.int64)
    pg = pg.to(device, non_blocking=True)
    _adam_kernel[(cache["chunks"],)](
        bucket.params[0],
        grads[0],
        bucket.exp_avgs[0],
        bucket.exp_avg_sqs[0],
        pg[:n],
        pg[n:],
        cache["m_offsets"],
        cache["v_offsets"],
        cache["chunk_tensor"],
        cache["chunk_start"],
        cache["numels"],
        1.0 - h.lr * h.weight_decay,
        h.weight_decay,
        1.0 - h.beta1,
        h.beta2,
        1.0 - h.beta2,
        h.eps,
        -h.step_size,
        h.bias_correction2_sqrt,
        DECAY_MODE=0 if h.weight_decay == 0 else (1 if h.adam_w_mode else 2),
        BLOCK=BLOCK,
    )
    return True
