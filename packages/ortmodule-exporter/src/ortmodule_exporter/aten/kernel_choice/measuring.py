"""Timing both routes: a few ONNX nodes in an engine session (:func:`_engine_us`) against PyTorch's
kernels at the in-engine thread count plus the ATen nodes' own cost (:func:`_torch_us`); the
median of a few runs, on inputs from a fixed seed (:func:`_seeded`, :func:`_randn`).

>>> from ortmodule_exporter.aten.kernel_choice.measuring import _torch_us
>>> _torch_us(lambda: None, aten_nodes=1) > ATEN_NODE_US
True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...engine_binding import import_onnxruntime
from ..parallel import TorchThreadsInEngine
from .modes import current_torch_threads

#: what one ATen node costs beyond its kernel (forward, bench_python_op.py on the 2-core EPYC)
ATEN_NODE_US = 45.0


#: a measurement stops after :data:`_MIN_REPEATS` timed runs once they took this long together:
#: the median of 3 runs of a kernel of 17 ms or more is as steady as that of 5 (GPT-2's
#: calibrations time 20-70 ms kernels: the embedding table's gradient, the GELU gradient, the
#: 50257-class loss; at 0.1 s they took 5 runs each, 0.3 s of the cold start)
_ENOUGH_SECONDS = 0.05
_MIN_REPEATS = 3


#: a PyTorch side this many times faster or slower than the engine's is decided after one
#: timed run (slower: the untimed run too, since a preempted run only reads slower)
_CLEAR_RATIO = 2.0


def _best_us(
    fn: Callable[[], Any],
    repeats: int = 5,
    *,
    warmed: bool = False,
    against_us: float | None = None,
    added_us: float = 0.0,
) -> float:
    """The median microseconds of up to ``repeats`` timed runs of ``fn``, after one untimed run
    unless ``warmed`` (the caller ran it already). ``against_us``: the other route's time; a
    run that, plus ``added_us``, is clearly apart from it (:data:`_CLEAR_RATIO`) ends the
    timing early."""
    untimed = None
    if not warmed:
        start = time.perf_counter()
        fn()  # first-call costs
        untimed = (time.perf_counter() - start) * 1e6
    times: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if against_us is not None and len(times) == 1:
            us = times[0] * 1e6
            if (us + added_us) * _CLEAR_RATIO < against_us or (
                untimed is not None and min(us, untimed) + added_us > against_us * _CLEAR_RATIO
            ):
                return us
        if len(times) >= _MIN_REPEATS and sum(times) >= _ENOUGH_SECONDS:
            break
    # the median of a few runs: one preempted run on a busy machine must not decide
    return statistics.median(times) * 1e6


def _torch_threads_in_engine() -> TorchThreadsInEngine:
    """What an engine run sets: PyTorch's in-engine thread count and the pieces of splittable
    nodes (a measurement runs our ATen functions, so it times the pieces too)."""
    return TorchThreadsInEngine(current_torch_threads())


def _engine_us(
    name: str,
    nodes: list[Any],
    inputs: dict[str, torch.Tensor],
    outputs: Sequence[str],
    input_types: dict[str, int] | None = None,
    output_shapes: dict[str, tuple[int, ...]] | None = None,
) -> float:
    """Microseconds of one run of ``nodes`` on the engine (at PyTorch's thread count);
    ``output_shapes``: each output's shape, where the caller knows them (float32 outputs)."""
    from onnx import TensorProto, helper

    ort = import_onnxruntime()
    types = input_types or {}
    graph = helper.make_graph(
        nodes,
        name,
        [
            helper.make_tensor_value_info(k, types.get(k, TensorProto.FLOAT), list(v.shape))
            for k, v in inputs.items()
        ],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
        ir_version=8,
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    feeds = {k: v.numpy() for k, v in inputs.items()}
    # The timed runs write into outputs kept from before them, as a training session's arena
    # hands a step the blocks of the step before: the engine's steady state allocates nothing.
    # Left to allocate, its first two runs fault in fresh pages, which inside an export cost
    # 0.4 s a run for GPT-2's 154 MB embedding gradient (25 ms a run once warm). With
    # ``output_shapes`` the outputs are zeros PyTorch allocated (cheap faults: 0.06 s for the
    # same 154 MB); else the first run's own outputs, after that run.
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_cpu_input(name, array)
    if output_shapes is None:
        kept = session.run(list(outputs), feeds)
    else:
        kept = [torch.zeros(output_shapes[o]).numpy() for o in outputs]
    for name, array in zip(outputs, kept, strict=True):
        binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
    # ``kept`` holds the bound outputs' memory until the timing returns
    return _best_us(lambda: session.run_with_iobinding(binding), warmed=output_shapes is None)


def _torch_us(
    fn: Callable[[], Any], aten_nodes: int = 2, *, engine_us: float | None = None
) -> float:
    """Microseconds of ``fn`` at the in-engine thread count, plus its ATen nodes' own cost;
    ``engine_us``: the engine route's time, where measured first (a clear difference ends the
    timing early: GPT-2's embedding-table gradient, 63 ms against the engine's 24 ms, is timed
    twice instead of four times)."""
    own = aten_nodes * ATEN_NODE_US
    with _torch_threads_in_engine():
        return _best_us(fn, against_us=engine_us, added_us=own) + own


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_randn.gen)  # type: ignore[attr-defined]


def _seeded() -> None:
    _randn.gen = torch.Generator().manual_seed(0)  # type: ignore[attr-defined]
