"""Matrix products with one 2-d operand (a weight or a weight's gradient): the engine's ``Gemm``
and ``FusedMatMul`` or PyTorch's ``mm``/``addmm`` as an ATen node (``_ortmodule_matmul``). The
built-graph pass ``passes/matmul_routes.py`` writes the nodes; there is no symbolic, since the
gradient products exist only once the engine has built the gradient graph.

Which side is faster depends on the CPU: on the 2-core Xeon with AVX-512 PyTorch's products are
1.2-2.0x faster than the engine's at every GPT-2 124M shape of 512 rows or more, on the 2-core
AMD EPYC they were within 10 % either way per layer and the engine was faster at two of the LM
head's three. So it is measured, per (rows, inner, columns, transposes) class.

Sizing. The row count is the batch's token count, which the built graph does not know (its
dims are dynamic): a dim the graph does not fix is timed at :data:`CALIBRATION_ROWS`, and every
dim is capped at :data:`CALIBRATION_CAP`, so that one timing takes a few milliseconds where the
real product (the LM head's 1024 x 768 x 50257) takes a quarter of a second. On the Xeon the
ranking at the capped shape was that of the full one for every GPT-2 product (ratios 1.10-1.39
capped, 1.24-1.98 full); at 256 rows it turned (0.65-0.95), so the calibration stays at
1024 rows.

The overload name carries ``transA``, ``transB``, ``alpha`` and ``beta`` (``"01|1.0|1.0"``); the
inputs are ``A``, ``B`` and, for a ``Gemm`` with a ``C``, ``C``. ``A`` may have more than 2 dims
when it is not transposed (``MatMul`` of an activation by a weight).

>>> from ortmodule_exporter.aten.kernel_choice.matmul import _matmul
>>> _matmul("01|1.0|0.0", [torch.ones(2, 3), torch.ones(4, 3)])[0].shape
torch.Size([2, 4])
"""

from __future__ import annotations

import torch

from .. import output_pool
from ..executor import AtenFunction, register_aten_function
from ..parallel import over_rows
from .choice import _decide
from .helpers import _all_tensors
from .measuring import _engine_us, _randn, _seeded, _torch_us

MATMUL = "_ortmodule_matmul"

#: rows a product is timed at when the built graph does not fix them (the batch's tokens)
CALIBRATION_ROWS = 1024
#: every dim of a timed product is capped at this (the LM head's 50257 columns: 1024)
CALIBRATION_CAP = 1024
#: a product with fewer multiply-adds runs whole (handing a piece to a helper thread and back
#: costs about 70 us; a 64 x 256 x 256 product takes about 30 us)
MIN_PIECES_WORK = 1 << 24


def matmul_overload(
    trans_a: bool, trans_b: bool, alpha: float, beta: float, graph_output: bool = False
) -> str:
    """The ATen node's overload name for these ``Gemm`` attributes; ``graph_output``: the
    product is one of the graph's outputs (a weight's gradient, which the user keeps)."""
    flags = f"{int(trans_a)}{int(trans_b)}{'o' if graph_output else ''}"
    return f"{flags}|{float(alpha)!r}|{float(beta)!r}"


def parse_matmul_overload(overload: str) -> tuple[bool, bool, float, float, bool]:
    """``(trans_a, trans_b, alpha, beta, graph_output)`` of an overload name
    (:func:`matmul_overload`)."""
    flags, alpha, beta = overload.split("|")
    return flags[0] == "1", flags[1] == "1", float(alpha), float(beta), flags[2:] == "o"


def _matmul(overload: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """``alpha * op(A) @ op(B) + beta * C``, in row pieces across the engine's threads when they
    allow (each piece writes its rows of the pooled output)."""
    trans_a, trans_b, alpha, beta, graph_output = parse_matmul_overload(overload)
    a, b = inputs[0], inputs[1]
    c = inputs[2] if len(inputs) > 2 and beta != 0.0 else None
    assert a is not None and b is not None
    lead: tuple[int, ...] = ()
    if a.dim() != 2:
        if trans_a or a.dim() < 2:
            # a vector: a MatMul's A of a rank the built graph did not know (the pass writes a
            # transposed A only when it knows A is 2-d)
            x = a.transpose(-1, -2) if trans_a else a
            y = torch.matmul(x, b.t() if trans_b else b)
            return [y * alpha if alpha != 1.0 else y]
        lead = tuple(a.shape[:-1])
        a = a.reshape(-1, a.shape[-1])
    x = a.t() if trans_a else a
    y = b.t() if trans_b else b
    rows, cols = x.shape[0], y.shape[1]
    # a graph output (a weight's gradient) is the user's to keep: not a pooled buffer, which
    # would only take the pool's room until the user drops it
    dtype = torch.result_type(x, y)
    out = output_pool.empty_output((rows, cols), dtype, x.device, graph_output)
    broadcast = c is None or c.dim() < 2 or c.shape[0] != rows

    def fill(start: int, stop: int) -> None:
        part = out[start:stop]
        if c is not None:
            torch.addmm(
                c if broadcast else c[start:stop],
                x[start:stop],
                y,
                beta=beta,
                alpha=alpha,
                out=part,
            )
            return
        torch.mm(x[start:stop], y, out=part)
        if alpha != 1.0:
            part.mul_(alpha)

    over_rows(fill, rows, rows * x.shape[1] * cols, min_work=MIN_PIECES_WORK)
    return [out.view(*lead, cols) if lead else out]


register_aten_function(MATMUL, AtenFunction(_matmul, _all_tensors))


def _calibration_dim(dim: int | None) -> int:
    return min(dim, CALIBRATION_CAP) if dim else min(CALIBRATION_ROWS, CALIBRATION_CAP)


def measure_matmul(
    m: int, k: int, n: int, trans_a: bool, trans_b: bool, bias: bool, fused: bool
) -> tuple[float, float]:
    """Microseconds of ``op(A) @ op(B)`` (plus a bias of ``n`` when ``bias``) with ``op(A)``
    ``m`` x ``k`` and ``op(B)`` ``k`` x ``n``: (engine, torch). Engine: ``Gemm``, or
    ``FusedMatMul`` when ``fused`` (what the session makes of a ``MatMul`` whose operand is
    transposed); PyTorch: ``mm``/``addmm`` in one ATen node."""
    from onnx import helper

    _seeded()
    a = _randn(k, m) if trans_a else _randn(m, k)
    b = _randn(n, k) if trans_b else _randn(k, n)
    feeds = {"a": a, "b": b}
    inputs = ["a", "b"]
    if bias:
        feeds["c"] = _randn(n)
        inputs.append("c")
    node = (
        helper.make_node(
            "FusedMatMul",
            inputs,
            ["y"],
            domain="com.microsoft",
            transA=int(trans_a),
            transB=int(trans_b),
        )
        if fused
        else helper.make_node("Gemm", inputs, ["y"], transA=int(trans_a), transB=int(trans_b))
    )
    engine_us = _engine_us("matmul", [node], feeds, ["y"], output_shapes={"y": (m, n)})
    overload = matmul_overload(trans_a, trans_b, 1.0, 1.0 if bias else 0.0)
    tensors: list[torch.Tensor | None] = [feeds["a"], feeds["b"], feeds.get("c")]
    return engine_us, _torch_us(
        lambda: _matmul(overload, tensors), aten_nodes=1, engine_us=engine_us
    )


def matmul_route(
    m: int | None,
    k: int | None,
    n: int | None,
    trans_a: bool,
    trans_b: bool,
    *,
    bias: bool = False,
    fused: bool = False,
    backward: bool = False,
) -> str:
    """``"engine"`` or ``"torch"`` for a float32 product of ``op(A)`` (``m`` x ``k``) by
    ``op(B)`` (``k`` x ``n``); a dim the graph does not fix is None (timed at
    :data:`CALIBRATION_ROWS`). ``backward``: a node of the built graph's backward half (it is
    measured under the recompute levels too, which keep forward nodes on the engine)."""
    cm, ck, cn = (_calibration_dim(d) for d in (m, k, n))
    return _decide(
        f"matmul({'fused_matmul' if fused else 'gemm'})",
        "Float",
        (cm, ck, cn, trans_a, trans_b, bias),
        lambda: measure_matmul(cm, ck, cn, trans_a, trans_b, bias, fused),
        backward_only=backward,
    )
