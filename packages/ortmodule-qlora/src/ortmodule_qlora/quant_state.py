"""What the engine's ``MatMulBnb4`` needs from a bitsandbytes ``QuantState``, or why it cannot.

>>> layout = engine_layout(weight.quant_state)      # doctest: +SKIP
>>> layout.N, layout.K, layout.block_size, layout.quant_type
(16, 32, 64, 1)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "QUANT_TYPES",
    "Bnb4Layout",
    "UnsupportedQuantState",
    "engine_layout",
    "operand_layout",
]

#: bitsandbytes' quant_type -> the engine's ``quant_type`` attribute
QUANT_TYPES = {"fp4": 0, "nf4": 1}


class UnsupportedQuantState(ValueError):
    """The 4-bit weight has a layout the engine's MatMulBnb4 cannot read; the message says why."""


@dataclass(frozen=True)
class Bnb4Layout:
    """One 4-bit weight as the engine reads it: ``W`` is ``[N, K]`` (out, in features)."""

    N: int
    K: int
    block_size: int
    #: 0 FP4, 1 NF4
    quant_type: int
    #: one float32 scale per block, nested (double) quantization already undone
    absmax: torch.Tensor


def _absmax(quant_state: Any) -> torch.Tensor:
    if not quant_state.nested:
        plain: torch.Tensor = quant_state.absmax.detach().float()
        return plain
    # Double quantization stores the scales in 8 bits; the engine reads float scales only. The
    # weight is frozen, so undoing it once at export gives the exact scales bitsandbytes' own
    # dequantize_4bit computes on every call.
    import bitsandbytes.functional as F

    absmax: torch.Tensor = F.dequantize_blockwise(quant_state.absmax, quant_state.state2)
    scales: torch.Tensor = (absmax + quant_state.offset).detach().float()
    return scales


def engine_layout(quant_state: Any) -> Bnb4Layout:
    """The engine's view of ``quant_state``; :class:`UnsupportedQuantState` says what blocks it."""
    if quant_state is None:
        raise UnsupportedQuantState("the weight has no quant_state (it is not quantized yet)")
    if getattr(quant_state, "packing_format_for_cpu", False):
        raise UnsupportedQuantState(
            "the weight was repacked by bitsandbytes for its AVX512-BF16 CPU inference kernel "
            "(packing_format_for_cpu), a layout MatMulBnb4 does not read"
        )
    if quant_state.nested and quant_state.state2 is None:
        raise UnsupportedQuantState("nested quant_state without its second-level state")
    return _layout(
        tuple(quant_state.shape),
        quant_state.quant_type,
        quant_state.blocksize,
        lambda: _absmax(quant_state),
    )


def operand_layout(
    shape: tuple[int, ...],
    quant_type: str,
    blocksize: int,
    absmax: torch.Tensor,
    absmax_8bit: torch.Tensor | None = None,
    absmax_code: torch.Tensor | None = None,
    absmax_offset: torch.Tensor | None = None,
) -> Bnb4Layout:
    """The engine's view of the operands of ``bitsandbytes::gemm_4bit`` (and ``gemv_4bit``).

    Nested (double-quantized) scales arrive as ``absmax_8bit`` codes with the second-level
    ``absmax`` (one per 256 scales), ``absmax_code`` and ``absmax_offset``.
    """

    def scales() -> torch.Tensor:
        if absmax_8bit is None:
            plain: torch.Tensor = absmax.detach().float()
            return plain
        if absmax_code is None or absmax_offset is None:
            raise UnsupportedQuantState("nested scales without their code table or offset")
        # the formula bitsandbytes' own gemm_4bit kernel applies on every call
        dequantize = torch.ops.bitsandbytes.dequantize_blockwise.default
        nested: torch.Tensor = dequantize(absmax_8bit, absmax, absmax_code, 256, torch.float32)
        return (nested + absmax_offset).detach().float()

    return _layout(tuple(shape), quant_type, blocksize, scales)


def _layout(
    shape: tuple[int, ...], quant_type: str, blocksize: int, scales: Callable[[], torch.Tensor]
) -> Bnb4Layout:
    if len(shape) != 2:
        raise UnsupportedQuantState(f"the weight has shape {shape}; MatMulBnb4 takes a 2-D weight")
    if quant_type not in QUANT_TYPES:
        raise UnsupportedQuantState(
            f"quant_type {quant_type!r} is not one of {sorted(QUANT_TYPES)}"
        )
    block = int(blocksize)
    if block < 16 or block & (block - 1):
        raise UnsupportedQuantState(
            f"block size {block} is not a power of two >= 16, which MatMulBnb4 requires"
        )
    n, k = (int(d) for d in shape)
    if k % block:
        # bitsandbytes cuts the flattened weight into blocks that run across rows; the engine
        # starts a new block at every row, so the scales would land on the wrong elements
        # (measured: outputs off by 1e-2 for K=32, block 64)
        raise UnsupportedQuantState(
            f"the weight's rows ({k} input features) are not a multiple of its block size "
            f"{block}; MatMulBnb4 needs whole blocks per row"
        )
    absmax = scales()
    blocks = -(-n * k // block)
    if absmax.numel() != blocks:
        raise UnsupportedQuantState(
            f"absmax has {absmax.numel()} scales, a [{n}, {k}] weight in blocks of {block} needs "
            f"{blocks}"
        )
    return Bnb4Layout(n, k, block, QUANT_TYPES[quant_type], absmax)
