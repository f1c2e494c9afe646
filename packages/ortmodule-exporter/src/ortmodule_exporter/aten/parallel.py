"""PyTorch-run nodes cut into pieces across the engine's threads, without OpenMP workers.

While the engine runs a graph that holds ATen nodes, PyTorch runs at
``ORTMODULE_TORCH_THREADS_IN_ENGINE`` threads (:class:`TorchThreadsInEngine`; see the end for
its default):
GNU OpenMP's workers spin after every parallel region, and a spinning PyTorch worker took a core
from the engine's own thread pool (GPT 1.44x eager's step with PyTorch's two threads, 1.15-1.28x
with one). One thread, though, left the heaviest PyTorch-run nodes, fused attention and GELU, on
one core while eager uses all of them.

So a node that separates by rows runs in pieces, one per thread PyTorch would have had. The
calling thread and ORTModule's own helper threads (each at one PyTorch thread, asleep on a queue
between nodes, never spinning) claim the pieces (:class:`_Job`): a helper that wakes late finds
its piece done by the caller instead of holding the node up. Each piece computes
exactly what the whole computes for its rows (attention: whole batch rows; elementwise: whole
runs of 64 elements, so every element takes the same vectorised path), so the result is bitwise
the one-call result; the tests compare them.

Covered: PyTorch's CPU flash attention forward and backward (cut along the batch, without
dropout: dropout would draw its random numbers in another order), elementwise operators
written with an ``out=`` (GELU and its backward, :func:`elementwise`), and row-wise work that
writes into tensors the caller allocated (the cross-entropy route's logsumexp and gradient,
:func:`over_rows`). The kernel choice times
PyTorch's side the same way, pieces included. Convolution and max pooling stay whole: in the
CNN benchmark's training step their pieces were slower than the whole (a convolution 1.7 ms
against 0.6 ms, pooling 1.4-2.2 ms against 1.5 ms), though alone they were faster (2.9 against
4.1 ms, 0.9 against 1.6 ms); a convolution's backward also sums its weight gradient over the
batch. Nodes with less work than :data:`MIN_ATTENTION_WORK` (:data:`MIN_ELEMENTWISE`) run
whole: handing a piece to a helper thread and back costs about 70 us.

Which count is faster depends on the graph: one thread (pieces on helper threads) kept a
GPT-style decoder at 1.10x eager's step where PyTorch's own two threads gave 1.44x (the engine's
GEMMs run between the PyTorch-run nodes and lost a core to spinning OpenMP workers), while a CNN
whose convolutions and pooling are PyTorch-run went from 1.25-1.30x at one thread to 1.02x at
two. ``ORTMODULE_TORCH_THREADS_IN_ENGINE=AUTO`` (:data:`THREADS_AUTO`, the default) therefore
measures it per graph on the graph's own first training steps (:class:`ThreadTrial`); under
deterministic algorithms it stays at 1, as a choice made by timing could differ between runs.

>>> with TorchThreadsInEngine(1):     # what the engine does around a run
...     width()                        # the pieces a splittable node is cut into
2
"""

from __future__ import annotations

import functools
import logging
import queue
import statistics
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import output_pool

__all__ = [
    "MIN_ATTENTION_WORK",
    "MIN_ELEMENTWISE",
    "THREADS_AUTO",
    "ThreadTrial",
    "TorchThreadsInEngine",
    "elementwise",
    "in_rows",
    "over_rows",
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

logger = logging.getLogger("ortmodule.exporter")

#: ``ORTMODULE_TORCH_THREADS_IN_ENGINE=auto``: the count is measured per graph (:class:`ThreadTrial`)
THREADS_AUTO = -1

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


class ThreadTrial:
    """Which in-engine PyTorch thread count makes one graph's engine runs faster, measured on
    the graph's own steps: one thread (with pieces) or PyTorch's count (left as it is).

    :meth:`next` is called at every forward run of the graph and returns the
    :class:`TorchThreadsInEngine` for it and its backward; :meth:`add` is given the wall time
    of each of those runs. The first :attr:`WARMUP` steps run at one thread (first-call costs),
    then the two candidates take turns for :attr:`ROUNDS` steps each; a step's sample is its
    forward and backward run time. The candidate with the lower median stays and
    :attr:`chosen` is set. Only engine time is compared: the wall time between forward runs
    would also hold the user's own code, whose pattern (two micro-batches per optimizer step,
    another model's step in between) can fall on one candidate's turns only."""

    WARMUP = 2
    ROUNDS = 5

    def __init__(self, label: str) -> None:
        self.label = label
        self.candidates = (TorchThreadsInEngine(1), TorchThreadsInEngine(0))
        self.chosen: TorchThreadsInEngine | None = None
        self._steps = 0
        self._current = -1  # the candidate of the step running (-1: a warm-up step)
        self._sample = 0.0
        self._times: tuple[list[float], list[float]] = ([], [])

    def next(self) -> TorchThreadsInEngine:
        """The thread setting for the step whose forward run starts now."""
        if self.chosen is not None:
            return self.chosen
        if self._current >= 0:
            self._times[self._current].append(self._sample)
        self._sample = 0.0
        step = self._steps
        self._steps += 1
        if step < self.WARMUP:
            self._current = -1
            return self.candidates[0]
        if min(len(t) for t in self._times) >= self.ROUNDS:
            return self._decide()
        self._current = (step - self.WARMUP) % 2
        return self.candidates[self._current]

    def add(self, seconds: float) -> None:
        """One engine run of the current step took ``seconds``."""
        self._sample += seconds

    def _decide(self) -> TorchThreadsInEngine:
        one, own = (statistics.median(t) for t in self._times)
        self.chosen = self.candidates[1 if own < one else 0]
        self._current = -1
        logger.info(
            "%s: PyTorch-run nodes at %s (median engine time per step %.2f ms at 1 thread, "
            "%.2f ms at PyTorch's %d)",
            self.label,
            "PyTorch's thread count" if self.chosen.threads == 0 else "1 thread",
            one * 1e3,
            own * 1e3,
            torch.get_num_threads(),
        )
        return self.chosen


# -- helper threads ---------------------------------------------------------------------------------


class _Job:
    """One node's pieces, claimed one at a time by whichever thread is free: the calling thread
    from the end, helper threads from the front. A helper that wakes late (a core still held
    by a spinning OpenMP worker: 1-4 ms at the start of a training step) finds its piece done
    by the caller instead of holding the node up."""

    __slots__ = ("pieces", "results", "error", "_front", "_back", "_left", "_lock", "_done")

    def __init__(self, pieces: Sequence[Callable[[], Any]]) -> None:
        self.pieces = pieces
        self.results: list[Any] = [None] * len(pieces)
        self.error: BaseException | None = None
        self._front = 0
        self._back = len(pieces)
        self._left = len(pieces)
        self._lock = threading.Lock()
        self._done = threading.Lock()
        self._done.acquire()

    def run(self, from_end: bool) -> None:
        """Run unclaimed pieces until none is left."""
        while True:
            with self._lock:
                if self._front >= self._back:
                    return
                if from_end:
                    self._back -= 1
                    index = self._back
                else:
                    index = self._front
                    self._front += 1
            try:
                self.results[index] = self.pieces[index]()
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                self.error = self.error or err
            with self._lock:
                self._left -= 1
                if not self._left:
                    self._done.release()

    def wait(self) -> list[Any]:
        """Every piece's result once all have run (they read the caller's inputs)."""
        self._done.acquire()
        if self.error is not None:
            raise self.error
        return self.results


def _helper_loop(jobs: queue.SimpleQueue[_Job]) -> None:
    """A helper thread: sleeps on the queue, runs what is left of each job it is handed."""
    while True:
        job = jobs.get()
        # a helper's first PyTorch call takes the process's count, which is the in-engine
        # one while a run is in progress; keep it at one all the same
        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)
        job.run(from_end=False)
        del job


_JOBS: queue.SimpleQueue[_Job] = queue.SimpleQueue()
_HELPERS: list[threading.Thread] = []


# one caller at a time uses the helpers; another thread's node meanwhile runs whole
_BUSY = threading.Lock()


def run_pieces(pieces: Sequence[Callable[[], Any]]) -> list[Any] | None:
    """Run the pieces at once, on the calling thread and ``len(pieces) - 1`` helper threads,
    and return their results in order; None when the helpers are busy with another caller's
    node (run it whole then)."""
    if not _BUSY.acquire(blocking=False):
        return None
    try:
        while len(_HELPERS) < len(pieces) - 1:
            helper = threading.Thread(
                target=_helper_loop, args=(_JOBS,), name="ortmodule-aten-piece", daemon=True
            )
            helper.start()
            _HELPERS.append(helper)
        job = _Job(pieces)
        for _ in range(len(pieces) - 1):
            _JOBS.put(job)
        job.run(from_end=True)
        return job.wait()
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
    # the input's layout, as eager's result has it (a transposed input's result is computed
    # along its memory, bitwise eager's); a contiguous one on a pooled buffer
    out = (
        output_pool.empty(first.shape, first.dtype, first.device)
        if first.is_contiguous()
        else torch.empty_like(first)
    )
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


def over_rows(
    fill: Callable[[int, int], Any], rows: int, work: int, min_work: int | None = None
) -> None:
    """``fill(start, stop)`` for every row of ``range(rows)``: in pieces, one per thread PyTorch
    would have had, when the engine's threads allow and ``work`` reaches ``min_work`` (by
    default :data:`MIN_ELEMENTWISE`, both in elements); else in one call. ``fill`` writes its rows' results into tensors
    the caller allocated, and computes each row alone (a row's result is the same in any
    piece): the cross-entropy's logsumexp and its gradient (``kernel_choice.cross_entropy``),
    the rows of a matrix product (``kernel_choice.matmul``, ``work`` in multiply-adds)."""
    pieces = min(_WIDTH[0], rows)
    if pieces < 2 or work < (MIN_ELEMENTWISE if min_work is None else min_work):
        fill(0, rows)
        return
    ranges = _bounds(rows, pieces)
    if run_pieces([functools.partial(fill, a, b) for a, b in ranges]) is None:
        fill(0, rows)


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

    gather = _Gather(batch)

    def piece(start: int, stop: int) -> Callable[[], Any]:
        part = [a[start:stop] if i in rows else a for i, a in enumerate(args)]
        named = {**kwargs, mask: kwargs[mask][start:stop]} if cut_mask else kwargs
        return lambda: gather.put(start, stop, op(*part, **named))

    if run_pieces([piece(a, b) for a, b in _bounds(batch, min(_WIDTH[0], batch))]) is None:
        return op(*args, **kwargs)
    return gather.result()


class _Gather:
    """The pieces' results joined along dim 0: each piece copies its rows into the joined
    outputs on its own thread as soon as it has them (in parallel, from its own caches),
    instead of the caller concatenating them after the last piece (1 MB of attention output
    took about 90 us to join). The joined outputs are pooled buffers (no fresh pages each step),
    allocated by the first piece to finish; a result that is not a tensor is the first rows'."""

    __slots__ = ("batch", "buffers", "single", "values", "_lock")

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.buffers: list[torch.Tensor | None] | None = None
        self.single = False
        self.values: list[Any] = []
        self._lock = threading.Lock()

    def put(self, start: int, stop: int, result: Any) -> None:
        parts = (result,) if isinstance(result, torch.Tensor) else tuple(result)
        with self._lock:
            if self.buffers is None:
                self.single = isinstance(result, torch.Tensor)
                self.buffers = [
                    output_pool.empty((self.batch, *p.shape[1:]), p.dtype, p.device)
                    if isinstance(p, torch.Tensor)
                    else None
                    for p in parts
                ]
            if start == 0:
                self.values = list(parts)
            buffers = self.buffers
        for buffer, part in zip(buffers, parts, strict=True):
            if buffer is not None:
                buffer[start:stop].copy_(part)

    def result(self) -> Any:
        assert self.buffers is not None
        joined = [b if b is not None else v for b, v in zip(self.buffers, self.values, strict=True)]
        return joined[0] if self.single else tuple(joined)


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
