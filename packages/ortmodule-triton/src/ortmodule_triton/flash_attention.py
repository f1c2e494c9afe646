"""Flash attention forward and backward as Triton kernels, with an optional mask.

``softmax(q @ k^T * scale + mask) @ v`` computed block by block with an online softmax, never
holding the ``[Sq, Sk]`` scores: ``q`` is ``[B, H, Sq, D]``, ``k`` ``[B, H, Sk, D]``, ``v``
``[B, H, Sk, Dv]``; ``mask`` broadcasts to ``[B, H, Sq, Sk]`` and is either bool (``False``
masks a score out, as a causal or padding mask) or floating point (added to the scores, as Hugging
Face's extended attention masks). Rows with every key masked give zeros (the exported pattern of
``scaled_dot_product_attention`` turns their NaNs into zeros too).

>>> # out = flash_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask=causal)   # autograd-aware

The kernels are Triton's (interpreted on CPU under ``TRITON_INTERPRET=1``); the graph rewrite that
routes attention here is :mod:`ortmodule_triton.attention_fusion`.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import torch

from .kernel import _source_dir
from .runtime import check_device, load_triton

__all__ = ["FlashAttentionFunction", "flash_attention"]

_KERNELS: dict[str, Any] = {}

_SOURCE = """
import triton
import triton.language as tl


def _fwd(Q, K, V, MASK, O, LSE, scale, SQ, SK, D, DV,
         sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, smb, smh, smm, smn,
         MASK_KIND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
         BDV: tl.constexpr):
    pid_m = tl.program_id(0)
    h, b = tl.program_id(1), tl.program_id(2)
    bh = b * tl.num_programs(1) + h  # the (batch, head) row of the contiguous outputs
    rm = pid_m * BM + tl.arange(0, BM)
    rd = tl.arange(0, BD)
    rdv = tl.arange(0, BDV)
    q = tl.load(Q + b * sqb + h * sqh + rm[:, None] * sqm + rd[None, :],
                mask=(rm[:, None] < SQ) & (rd[None, :] < D), other=0.0).to(tl.float32)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    for start in range(0, SK, BN):
        rn = start + tl.arange(0, BN)
        k = tl.load(K + b * skb + h * skh + rn[:, None] * skn + rd[None, :],
                    mask=(rn[:, None] < SK) & (rd[None, :] < D), other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale
        valid = (rm[:, None] < SQ) & (rn[None, :] < SK)
        if MASK_KIND != 0:
            mt = tl.load(MASK + b * smb + h * smh + rm[:, None] * smm + rn[None, :] * smn,
                         mask=valid, other=0)
            if MASK_KIND == 1:
                valid = valid & (mt != 0)
            else:
                s = s + mt.to(tl.float32)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(V + b * svb + h * svh + rn[:, None] * svn + rdv[None, :],
                    mask=(rn[:, None] < SK) & (rdv[None, :] < DV), other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    live = l_i > 0
    out = tl.where(live[:, None], acc / tl.where(live, l_i, 1.0)[:, None], 0.0)
    o_off = bh * SQ * DV + rm[:, None] * DV + rdv[None, :]
    tl.store(O + o_off, out.to(O.dtype.element_ty), mask=(rm[:, None] < SQ) & (rdv[None, :] < DV))
    lse = tl.where(live, tl.where(m_i == float("-inf"), 0.0, m_i) + tl.log(tl.where(live, l_i, 1.0)),
                   float("inf"))
    tl.store(LSE + bh * SQ + rm, lse, mask=rm < SQ)


def _bwd_kv(Q, K, V, MASK, DO, LSE, DELTA, DK, DV_OUT, scale, SQ, SK, D, DV,
            sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, smb, smh, smm, smn,
            MASK_KIND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
            BDV: tl.constexpr):
    pid_n = tl.program_id(0)
    h, b = tl.program_id(1), tl.program_id(2)
    bh = b * tl.num_programs(1) + h  # the (batch, head) row of the contiguous outputs
    rn = pid_n * BN + tl.arange(0, BN)
    rd = tl.arange(0, BD)
    rdv = tl.arange(0, BDV)
    k = tl.load(K + b * skb + h * skh + rn[:, None] * skn + rd[None, :],
                mask=(rn[:, None] < SK) & (rd[None, :] < D), other=0.0).to(tl.float32)
    v = tl.load(V + b * svb + h * svh + rn[:, None] * svn + rdv[None, :],
                mask=(rn[:, None] < SK) & (rdv[None, :] < DV), other=0.0).to(tl.float32)
    dk = tl.zeros([BN, BD], tl.float32)
    dv = tl.zeros([BN, BDV], tl.float32)
    for start in range(0, SQ, BM):
        rm = start + tl.arange(0, BM)
        q = tl.load(Q + b * sqb + h * sqh + rm[:, None] * sqm + rd[None, :],
                    mask=(rm[:, None] < SQ) & (rd[None, :] < D), other=0.0).to(tl.float32)
        do = tl.load(DO + bh * SQ * DV + rm[:, None] * DV + rdv[None, :],
                     mask=(rm[:, None] < SQ) & (rdv[None, :] < DV), other=0.0).to(tl.float32)
        lse = tl.load(LSE + bh * SQ + rm, mask=rm < SQ, other=float("inf"))
        delta = tl.load(DELTA + bh * SQ + rm, mask=rm < SQ, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        valid = (rm[:, None] < SQ) & (rn[None, :] < SK)
        if MASK_KIND != 0:
            mt = tl.load(MASK + b * smb + h * smh + rm[:, None] * smm + rn[None, :] * smn,
                         mask=valid, other=0)
            if MASK_KIND == 1:
                valid = valid & (mt != 0)
            else:
                s = s + mt.to(tl.float32)
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        dv += tl.dot(tl.trans(p), do)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds), q) * scale
    tl.store(DK + bh * SK * D + rn[:, None] * D + rd[None, :], dk.to(DK.dtype.element_ty),
             mask=(rn[:, None] < SK) & (rd[None, :] < D))
    tl.store(DV_OUT + bh * SK * DV + rn[:, None] * DV + rdv[None, :], dv.to(DV_OUT.dtype.element_ty),
             mask=(rn[:, None] < SK) & (rdv[None, :] < DV))


def _bwd_q(Q, K, V, MASK, DO, LSE, DELTA, DQ, scale, SQ, SK, D, DV,
           sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, smb, smh, smm, smn,
           MASK_KIND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
           BDV: tl.constexpr):
    pid_m = tl.program_id(0)
    h, b = tl.program_id(1), tl.program_id(2)
    bh = b * tl.num_programs(1) + h  # the (batch, head) row of the contiguous outputs
    rm = pid_m * BM + tl.arange(0, BM)
    rd = tl.arange(0, BD)
    rdv = tl.arange(0, BDV)
    q = tl.load(Q + b * sqb + h * sqh + rm[:, None] * sqm + rd[None, :],
                mask=(rm[:, None] < SQ) & (rd[None, :] < D), other=0.0).to(tl.float32)
    do = tl.load(DO + bh * SQ * DV + rm[:, None] * DV + rdv[None, :],
                 mask=(rm[:, None] < SQ) & (rdv[None, :] < DV), other=0.0).to(tl.float32)
    lse = tl.load(LSE + bh * SQ + rm, mask=rm < SQ, other=float("inf"))
    delta = tl.load(DELTA + bh * SQ + rm, mask=rm < SQ, other=0.0)
    dq = tl.zeros([BM, BD], tl.float32)
    for start in range(0, SK, BN):
        rn = start + tl.arange(0, BN)
        k = tl.load(K + b * skb + h * skh + rn[:, None] * skn + rd[None, :],
                    mask=(rn[:, None] < SK) & (rd[None, :] < D), other=0.0).to(tl.float32)
        v = tl.load(V + b * svb + h * svh + rn[:, None] * svn + rdv[None, :],
                    mask=(rn[:, None] < SK) & (rdv[None, :] < DV), other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale
        valid = (rm[:, None] < SQ) & (rn[None, :] < SK)
        if MASK_KIND != 0:
            mt = tl.load(MASK + b * smb + h * smh + rm[:, None] * smm + rn[None, :] * smn,
                         mask=valid, other=0)
            if MASK_KIND == 1:
                valid = valid & (mt != 0)
            else:
                s = s + mt.to(tl.float32)
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds, k) * scale
    tl.store(DQ + bh * SQ * D + rm[:, None] * D + rd[None, :], dq.to(DQ.dtype.element_ty),
             mask=(rm[:, None] < SQ) & (rd[None, :] < D))
"""


def _kernels() -> dict[str, Any]:
    if not _KERNELS:
        triton = load_triton()
        path = _source_dir() / "ortmodule_flash_attention.py"
        path.write_text(_SOURCE)
        spec = importlib.util.spec_from_file_location("ortmodule_triton_generated.flash", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for name in ("_fwd", "_bwd_kv", "_bwd_q"):
            _KERNELS[name] = triton.jit(getattr(module, name))
    return _KERNELS


def _pow2(n: int, low: int = 16) -> int:
    return max(low, 1 << max(n - 1, 0).bit_length())


def _mask_args(
    mask: torch.Tensor | None, shape: tuple[int, int, int, int]
) -> tuple[Any, list[int], int]:
    if mask is None:
        return None, [0, 0, 0, 0], 0
    if mask.dim() > 4:
        raise ValueError(
            f"flash_attention: the mask has rank {mask.dim()}; at most 4 (B, H, Sq, Sk)"
        )
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    m = m.expand(shape)  # broadcast dims get stride 0
    kind = 1 if m.dtype == torch.bool else 2
    return m, list(m.stride()), kind


def _launch_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, int]:
    B, H, SQ, D = q.shape
    SK, DV = k.shape[2], v.shape[3]
    return {"B": B, "H": H, "SQ": SQ, "SK": SK, "D": D, "DV": DV}


def _grid(s: dict[str, int], length: str, block: int) -> tuple[int, int, int]:
    """One program per ``block`` rows of ``length`` (``SQ`` or ``SK``), per head, per batch row."""
    return (-(-s[length] // block), s["H"], s["B"])


def _common(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_strides: list[int]
) -> list[Any]:
    s = _launch_shapes(q, k, v)
    return [
        s["SQ"], s["SK"], s["D"], s["DV"],
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        *mask_strides,
    ]  # fmt: skip


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"flash_attention: {name} must be [batch, heads, seq, head_dim], got {tuple(t.shape)}"
            )
        if t.stride(-1) != 1:
            raise ValueError(f"flash_attention: {name}'s last dimension must be contiguous")
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"flash_attention: shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    check_device(q.device, "flash_attention")


BM = BN = 16


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
             mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    _check(q, k, v)
    s = _launch_shapes(q, k, v)
    out = torch.empty((s["B"], s["H"], s["SQ"], s["DV"]), dtype=q.dtype, device=q.device)
    lse = torch.empty((s["B"], s["H"], s["SQ"]), dtype=torch.float32, device=q.device)
    m, strides, kind = _mask_args(mask, (s["B"], s["H"], s["SQ"], s["SK"]))
    _kernels()["_fwd"][_grid(s, "SQ", BM)](
        q, k, v, m, out, lse, scale, *_common(q, k, v, strides),
        MASK_KIND=kind, BM=BM, BN=BN, BD=_pow2(s["D"]), BDV=_pow2(s["DV"]),
    )  # fmt: skip
    return out, lse


class FlashAttentionFunction(torch.autograd.Function):
    """``(q, k, v, scale, mask) -> out``; gradients for q, k and v (not for the mask)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                mask: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        out, lse = _forward(q, k, v, scale, mask)
        ctx.save_for_backward(q, k, v, out, lse, *([mask] if mask is not None else []))
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        q, k, v, out, lse, *rest = ctx.saved_tensors
        mask = rest[0] if rest else None
        do = grad_out.contiguous()
        delta = (do.float() * out.float()).sum(-1).contiguous()
        s = _launch_shapes(q, k, v)
        m, strides, kind = _mask_args(mask, (s["B"], s["H"], s["SQ"], s["SK"]))
        dq = torch.empty((s["B"], s["H"], s["SQ"], s["D"]), dtype=q.dtype, device=q.device)
        dk = torch.empty((s["B"], s["H"], s["SK"], s["D"]), dtype=k.dtype, device=k.device)
        dv = torch.empty((s["B"], s["H"], s["SK"], s["DV"]), dtype=v.dtype, device=v.device)
        common = _common(q, k, v, strides)
        meta = {"MASK_KIND": kind, "BM": BM, "BN": BN, "BD": _pow2(s["D"]), "BDV": _pow2(s["DV"])}
        kernels = _kernels()
        kernels["_bwd_kv"][_grid(s, "SK", BN)](
            q, k, v, m, do, lse, delta, dk, dv, ctx.scale, *common, **meta
        )
        kernels["_bwd_q"][_grid(s, "SQ", BM)](
            q, k, v, m, do, lse, delta, dq, ctx.scale, *common, **meta
        )
        return dq, dk, dv, None, None


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` over ``k``/``v`` (see the module docstring); differentiable."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    out: torch.Tensor = FlashAttentionFunction.apply(q, k, v, float(scale), mask)  # type: ignore[no-untyped-call]
    return out
