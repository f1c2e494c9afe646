"""PyTorch-run nodes cut into pieces across the engine's threads, without OpenMP workers.

While the engine runs a graph that holds ATen nodes, PyTorch runs at
``ORTMODULE_TORCH_THREADS_IN_ENGINE`` threads (default 1, :class:`TorchThreadsInEngine`):
GNU OpenMP's workers spin after every parallel region, and a spinning PyTorch worker took a core
from the engine's own thread pool (GPT 1.44x eager's step with PyTorch's two threads, 1.15-1.28x
with one). One thread, though, left the heaviest PyTorch-run nodes, fused attention and GELU, on
one core while eager uses all of them.

So a node that separates by rows runs in pieces, one per thread PyTorch would have had: the
calling thread runs one piece and ORTModule's own helper threads the others, each at one PyTorch
thread. Helper threads wait on a lock between nodes, asleep, never spinning. Each piece computes
exactly what the whole computes for its rows (attention: whole batch rows; elementwise: whole
runs of 64 elements, so every element takes the same vectorised path), so the result is bitwise
the one-call result; the tests compare them.

Covered: PyTorch's CPU flash attention forward and backward (cut along the batch, without
dropout: dropout would draw its random numbers in another order), elementwise operators
written with an ``out=`` (GELU and its backward, :func:`elementwise`). The kernel choice times
PyTorch's side the same way, pieces included. Convolution and max pooling stay whole: in the
CNN benchmark's training step their pieces were slower than the whole (a convolution 1.7 ms
against 0.6 ms, pooling 1.4-2.2 ms against 1.5 ms), though alone they were faster (2.9 against
4.1 ms, 0.9 against 1.6 ms); a convolution's backward also sums its weight gradient over the
batch. Nodes with less work than :data:`MIN_ATTENTION_WORK` (:data:`MIN_ELEMENTWISE`) run
whole: handing a piece to a helper thread and back costs about 70 us.

>>> with TorchThreadsInEngine(1):     # what the engine does around a run
...     width()                        # the pieces a splittable node is cut into
2
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "MIN_ATTENTION_WORK",
    "MIN_ELEMENTWISE",
    "TorchThreadsInEngine",
    "elementwise",
    "helper_threads",
    "in_rows",
    "register_row_split",
    "row_splitter",
    "run_pieces",
    "width",
]

#: an attention node with less work than this (batch x heads x queries x keys x head dim) runs
#: whole: on the 2-core EPYC, PyTorch's CPU flash attention at batch 16, 4 heads, 64 tokens,
#: head dim 32 (8M) took 0.69 ms whole and 0.81 ms in two pieces; at batch 8, 128 tokens, head
#: dim 64 (34M) 2.9 ms whole and 1.6 ms in two pieces
MIN_ATTENTION_WORK = 1 << 24
#: an elementwise node with fewer elements runs whole: handing a piece to a helper thread and
#: back costs about 70 us on the 2-core EPYC, and GELU on 1M floats saves only about 50 us of it
MIN_ELEMENTWISE = 1 << 20
#: piece boundaries of elementwise operators fall on multiples of this (vector loops stay whole)
_ALIGN = 64

#: pieces per splittable node in the engine run in progress (1: no cutting)
_WIDTH = [1]


def width() -> int:
    """How many pieces a splittable PyTorch-run node is cut into right now (1: none)."""
    return _WIDTH[0]


class TorchThreadsInEngine:
    """PyTorch's intra-op thread count set to ``threads`` for the duration of an engine run,
    and splittable nodes cut into ``current // threads`` pieces meanwhile.

    The engine's kernels run on its own thread pool while ATen nodes and PythonOps run PyTorch
    code on the calling thread; see the module's docstring for why PyTorch gets one thread.
    ``threads=0`` does nothing. Runs may nest (a Function may call the model again)."""

    __slots__ = ("threads", "saved")

    def __init__(self, threads: int) -> None:
        self.threads = threads
        #: (thread count, width) to restore, one per run in progress
        self.saved: list[tuple[int, int]] = []

    def __enter__(self) -> None:
        if self.threads:
            current = torch.get_num_threads()
            self.saved.append((current, _WIDTH[0]))
            if current != self.threads:
                torch.set_num_threads(self.threads)
            _WIDTH[0] = max(1, current // self.threads)

    def __exit__(self, *exc: object) -> None:
        if self.threads:
            previous, _WIDTH[0] = self.saved.pop()
            if previous != self.threads:
                torch.set_num_threads(previous)


# -- helper threads ---------------------------------------------------------------------------------


class _Helper:
    """One daemon thread that runs a piece when told and sleeps otherwise."""

    def __init__(self) -> None:
        self._go = threading.Lock()
        self._go.acquire()
        self._done = threading.Lock()
        self._done.acquire()
        self._job: Callable[[], Any] | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        threading.Thread(target=self._loop, name="ortmodule-aten-piece", daemon=True).start()

    def _loop(self) -> None:
        while True:
            self._go.acquire()
            job, self._job = self._job, None
            try:
                # a helper's first PyTorch call takes the process's count, which is
                # the in-engine one while a run is in progress; keep it at one all the same
                if torch.get_num_threads() != 1:
                    torch.set_num_threads(1)
                assert job is not None
                self._result = job()
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                self._error = err
            del job
            self._done.release()

    def start(self, job: Callable[[], Any]) -> None:
        self._job = job
        self._go.release()

    def wait(self) -> Any:
        self._done.acquire()
        result, self._result = self._result, None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return result


_HELPERS: list[_Helper] = []


def helper_threads() -> int:
    """How many helper threads exist (they run PyTorch pieces only, never the engine)."""
    return len(_HELPERS)


# one caller at a time uses the helpers; another thread's node meanwhile runs whole
_BUSY = threading.Lock()


def run_pieces(pieces: Sequence[Callable[[], Any]]) -> list[Any] | None:
    """Run the pieces at once (the last on the calling thread) and return their results in
    order; None when the helpers are busy with another caller's node (run it whole then)."""
    if not _BUSY.acquire(blocking=False):
        return None
    try:
        while len(_HELPERS) < len(pieces) - 1:
            _HELPERS.append(_Helper())
        started = []
        try:
            for helper, piece in zip(_HELPERS, pieces[:-1], strict=False):
                helper.start(piece)
                started.append(helper)
            last = pieces[-1]()
        finally:
            # every started piece is waited for, also when one failed: they read our inputs
            results = []
            error: BaseException | None = None
            for helper in started:
                try:
                    results.append(helper.wait())
                except BaseException as err:  # noqa: BLE001
                    error = error or err
            if error is not None:
                raise error
        return [*results, last]
    finally:
        _BUSY.release()


def _bounds(total: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``range(total)``, each start a multiple of ``align``."""
    step = -(-total // parts)
    step = -(-step // align) * align
    return [(s, min(s + step, total)) for s in range(0, total, step)]


# -- elementwise operators ---------------------------------------------------------------------------


def elementwise(
    op: Callable[..., Any], inputs: Sequence[torch.Tensor], out_arg: str = "out", **kwargs: Any
) -> torch.Tensor:
    """``op(*inputs, **kwargs, out=out)`` for an elementwise ``op`` with an ``out`` overload
    (``torch.ops.aten.gelu.out``; ``out_arg`` names its output argument): in pieces when the
    engine's threads allow and every input is contiguous with the same shape, else in one
    call. Returns ``out``."""
    first = inputs[0]
    out = torch.empty_like(first)
    whole = {**kwargs, out_arg: out}
    n = first.numel()
    pieces = _WIDTH[0]
    if (
        pieces < 2
        or n < MIN_ELEMENTWISE
        or any(t.shape != first.shape or not t.is_contiguous() for t in inputs)
    ):
        op(*inputs, **whole)
        return out
    flat = [t.view(-1) for t in inputs]
    flat_out = out.view(-1)

    def piece(start: int, stop: int) -> Callable[[], Any]:
        part = {**kwargs, out_arg: flat_out[start:stop]}
        return lambda: op(*(f[start:stop] for f in flat), **part)

    if run_pieces([piece(a, b) for a, b in _bounds(n, pieces, _ALIGN)]) is None:
        op(*inputs, **whole)
    return out


# -- operators cut along the batch ---------------------------------------------------------------


def in_rows(
    op: Callable[..., Any],
    args: list[Any],
    kwargs: dict[str, Any],
    rows: Sequence[int],
    work: int,
    mask: str = "",
    unless: int = -1,
) -> Any:
    """``op(*args, **kwargs)``, cut along dim 0 of the positional arguments ``rows`` (all with
    the same size there) when the engine's threads allow and ``work`` reaches
    :data:`MIN_ATTENTION_WORK`. The keyword argument ``mask`` (an attention mask) is cut too
    when it is 4-d with that size in dim 0, and passed whole when it is broadcast over the batch
    (dim 0 of 1, or fewer dims). ``unless``: the position of an argument that, when truthy,
    makes the node run whole (dropout). Every tensor result is concatenated along dim 0."""
    batch = args[rows[0]].shape[0]
    if (
        _WIDTH[0] < 2
        or batch < 2
        or work < MIN_ATTENTION_WORK
        or (0 <= unless < len(args) and args[unless])
        or any(args[i].shape[0] != batch for i in rows)
    ):
        return op(*args, **kwargs)
    cut_mask = False
    value = kwargs.get(mask) if mask else None
    if isinstance(value, torch.Tensor) and value.dim() == 4 and value.shape[0] != 1:
        if value.shape[0] != batch:
            return op(*args, **kwargs)
        cut_mask = True

    def piece(start: int, stop: int) -> Callable[[], Any]:
        part = [a[start:stop] if i in rows else a for i, a in enumerate(args)]
        named = {**kwargs, mask: kwargs[mask][start:stop]} if cut_mask else kwargs
        return lambda: op(*part, **named)

    results = run_pieces([piece(a, b) for a, b in _bounds(batch, min(_WIDTH[0], batch))])
    if results is None:
        return op(*args, **kwargs)
    if isinstance(results[0], torch.Tensor):
        return torch.cat(results)
    return tuple(
        torch.cat([r[k] for r in results]) if isinstance(first, torch.Tensor) else first
        for k, first in enumerate(results[0])
    )


RowSplitter = Callable[[Callable[..., Any], list[Any], dict[str, Any]], Any]
_ROW_SPLITTERS: dict[str, RowSplitter] = {}


def register_row_split(
    op_name: str,
    rows: Sequence[int],
    work: Callable[[list[Any]], int],
    mask: str = "",
    unless: int = -1,
) -> None:
    """Let the aten operator ``op_name`` run through :func:`in_rows`; ``work(args)``: how much
    work a call is, compared with :data:`MIN_ATTENTION_WORK`."""

    def split(op: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> Any:
        return in_rows(op, args, kwargs, rows, work(args), mask, unless)

    _ROW_SPLITTERS[op_name] = split


def row_splitter(op_name: str) -> RowSplitter | None:
    """How to run ``aten::op_name`` in pieces now, or None (no splitter, or no pieces)."""
    if _WIDTH[0] < 2:
        return None
    return _ROW_SPLITTERS.get(op_name)


def _attention_work(q: torch.Tensor, k: torch.Tensor) -> int:
    # batch x heads x queries x head dim, times keys
    return q.numel() * k.shape[-2]


# q, k, v, dropout_p, is_causal, attn_mask, scale -> output, logsumexp
register_row_split(
    "_scaled_dot_product_flash_attention_for_cpu",
    rows=(0, 1, 2),
    work=lambda args: _attention_work(args[0], args[1]),
    mask="attn_mask",
    unless=3,
)
# grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, attn_mask, scale -> dq, dk, dv
register_row_split(
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    rows=(0, 1, 2, 3, 4, 5),
    work=lambda args: _attention_work(args[1], args[2]),
    mask="attn_mask",
    unless=6,
)
