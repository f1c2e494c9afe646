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
#: the median of 3 runs of a long kernel is as steady as that of 5 (the PyTorch side of
#: GPT-2's 50257-row embedding takes 70 ms a run; its calibration took 0.9 s of the cold start)
_ENOUGH_SECONDS = 0.1
_MIN_REPEATS = 3


def _best_us(fn: Callable[[], Any], repeats: int = 5) -> float:
    fn()  # first-call costs
    times: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
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
) -> float:
    """Microseconds of one run of ``nodes`` on the engine (at PyTorch's thread count)."""
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
    return _best_us(lambda: session.run(list(outputs), feeds))


def _torch_us(fn: Callable[[], Any], aten_nodes: int = 2) -> float:
    """Microseconds of ``fn`` at the in-engine thread count, plus its ATen nodes' own cost."""
    with _torch_threads_in_engine():
        return _best_us(fn) + aten_nodes * ATEN_NODE_US


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_randn.gen)  # type: ignore[attr-defined]


def _seeded() -> None:
    _randn.gen = torch.Generator().manual_seed(0)  # type: ignore[attr-defined]
