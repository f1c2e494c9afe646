"""bfloat16 GEMMs of PyTorch-run nodes cut into row pieces across the engine's threads.

On a CPU without AVX-512 (no oneDNN bfloat16 path: ATen's CPU capability is AVX2 or lower),
PyTorch computes a bfloat16 ``mm``/``addmm`` with its reference kernel: one float32 dot product
per output element, on one thread whatever ``torch.get_num_threads()`` says, 10x float32's time
(a 1024x256 by 256x768 ``addmm``: 196 ms against 21 ms) and up to 75x for the layout a linear
layer's input gradient has (``grad @ weight``, 1024x768 by 768x256: 1.5 s). Under
``torch.autocast("cpu", torch.bfloat16)`` these GEMMs are nearly all of a training step, in
eager and in ORTModule alike (every bfloat16 operator is a PyTorch-run node,
:mod:`ortmodule_exporter.aten.low_precision`).

Each output element of that kernel is the same dot product whatever rows surround it, so
while the engine cuts splittable nodes into pieces (:func:`ortmodule_exporter.aten.parallel.width`
of 2 or more), :func:`row_pieces` runs the ``mm`` and ``addmm`` calls of a PyTorch-run node,
its autograd backward included, as one call per block of output rows on the engine's helper
threads: bitwise the whole call's result (tests/test_gemm_rows.py compares them), on every core
the user gave PyTorch.

>>> with row_pieces([x]):        # x: a bfloat16 CPU tensor among the node's inputs
...     y = torch.mm(x, w)       # in row pieces when the engine's width allows
"""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import parallel

__all__ = ["MIN_GEMM_WORK", "reference_kernel", "row_pieces"]

#: a GEMM with fewer multiply-adds (rows x inner x columns) runs whole: handing a piece to a
#: helper thread and back costs about 70 us, the reference kernel's rate is about 1 GFLOP/s
MIN_GEMM_WORK = 1 << 20

_ATEN = torch.ops.aten


def reference_kernel() -> bool:
    """Whether PyTorch's bfloat16 GEMM on this CPU is its single-threaded reference kernel:
    x86 without ATen's AVX512 capability (oneDNN's bfloat16 GEMM needs AVX-512 BW/VL/DQ)."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return False
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT", "NO AVX")


_REFERENCE = reference_kernel()


def _cpu_bf16(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.device.type == "cpu"


def _mm_out(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> Any:
    return _ATEN.mm.out(a, b, out=out)


def _split_gemm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)`` (``mm`` or ``addmm``) in row pieces, or None to run it whole."""
    if func is _ATEN.mm.default and not kwargs:
        a, b = args
        bias = None
    elif func is _ATEN.addmm.default:
        bias, a, b = args[:3]
        if len(args) > 3:
            return None  # beta/alpha given positionally: rare, run whole
    else:
        return None
    if not (_cpu_bf16(a) and _cpu_bf16(b)) or a.dim() != 2 or b.dim() != 2:
        return None
    rows, inner, cols = a.shape[0], a.shape[1], b.shape[1]
    if rows < 2 or rows * inner * cols < MIN_GEMM_WORK:
        return None
    if bias is not None:
        # a bias broadcast over rows is passed whole; one with a row per output row is cut
        if not _cpu_bf16(bias) or bias.dim() > 2:
            return None
        cut_bias = bias.dim() == 2 and bias.shape[0] == rows
        if bias.dim() == 2 and not cut_bias and bias.shape[0] != 1:
            return None
    out = torch.empty((rows, cols), dtype=a.dtype, device=a.device)
    # below autograd here, but the helper threads are not: they get plain tensors
    a, b = a.detach(), b.detach()
    bias = None if bias is None else bias.detach()

    def piece(start: int, stop: int) -> Any:
        if bias is None:
            return lambda: _mm_out(a[start:stop], b, out[start:stop])
        part = bias[start:stop] if cut_bias else bias
        return lambda: _ATEN.addmm.out(part, a[start:stop], b, **kwargs, out=out[start:stop])

    bounds = parallel._bounds(rows, min(parallel.width(), rows))
    if parallel.run_pieces([piece(s, e) for s, e in bounds]) is None:
        return None
    return out


class _RowPieces(TorchDispatchMode):
    """Runs bfloat16 ``mm``/``addmm`` in row pieces, every other operator as it is."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is _ATEN.mm.default or func is _ATEN.addmm.default:
            result = _split_gemm(func, args, kwargs)
            if result is not None:
                return result
        return func(*args, **kwargs)


@contextlib.contextmanager
def row_pieces(inputs: Sequence[Any]) -> Iterator[None]:
    """Within it, bfloat16 GEMMs run in row pieces when this CPU computes them with PyTorch's
    reference kernel, the engine's width allows and ``inputs`` hold a bfloat16 CPU tensor;
    otherwise (the common case) it does nothing."""
    if not _REFERENCE or parallel.width() < 2 or not any(_cpu_bf16(t) for t in inputs):
        yield
        return
    with _RowPieces():
        yield
