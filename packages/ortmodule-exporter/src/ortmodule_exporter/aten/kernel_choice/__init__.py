"""Per-operator kernel choice: the engine's kernel or PyTorch's, whichever measured faster here.

Some engine CPU kernels are several times slower than PyTorch's (GELU's backward, ``GeluGrad``,
was 3.4x in the GPT profile; ``ReluGrad`` is 20x PyTorch's ``threshold_backward`` on a CNN's
activations). For such an operator the exporter can instead write an ATen node that PyTorch
runs inside the engine, forward and backward; that node pays a fixed cost for crossing the
engine boundary (about 45 us per node, ``benchmarks/bench_python_op.py``). Which route wins
depends on the machine and the tensor size, so it is decided by measurement: the first export
that meets the operator times both routes on this machine (a few milliseconds) and keeps the
answer for the process, per (operator, dtype, size class).

The covered operators are a small table (:func:`register_kernel_choice`): GELU, ReLU,
convolution (``aten::_convolution``, not transposed), 2-d max pooling, LayerNorm (input,
weight and bias all trained) and cross-entropy on class indices (mean or sum, no class weights
or smoothing, and labels dense enough that label sparsity leaves the loss whole, judged on the
traced batch as that pass judges it); embedding lookups (``padding_idx`` and
``scale_grad_by_freq`` included) are covered from the exporter's own ``embedding`` symbolic
(:func:`embedding_route`). Each entry is a
symbolic that replaces the exporter's own while the mode is ``auto`` or ``torch``, and falls
back to it whenever the engine's kernel is chosen.

ReLU is decided in two halves (its backward first): the engine's ``Relu`` is as fast as
PyTorch's, its ``ReluGrad`` is not, so the forward can stay on the engine while the backward
runs on PyTorch (:data:`ENGINE_FORWARD`, ``passes/engine_forwards.py``).

Size classes: ReLU and pooling and convolution use the sizes the operator had when the export
traced the module (:func:`recording_traced_sizes`; the exported graph's own dims are dynamic);
convolution and pooling also key on their weight shape and settings. GELU keeps the class it
always had, the one measured at :data:`CALIBRATION_NUMEL` elements unless the export knows the
size. An operator whose traced sizes are unknown is measured at :data:`CALIBRATION_NUMEL`
(ReLU) or keeps the engine's kernel (convolution, pooling: their cost depends on the spatial
shape).

The PyTorch side is timed at the thread count PyTorch has while the engine runs a graph with
PyTorch-run nodes (``ORTMODULE_TORCH_THREADS_IN_ENGINE``, passed in by
:func:`configure_kernel_choice`), the engine side at PyTorch's current count (the count the
engine's sessions get).

``mode`` (``ORTMODULE_KERNEL_CHOICE``): ``auto`` measures, ``engine`` keeps every operator on
the engine's kernels, ``torch`` routes every covered operator to PyTorch. The measurements
time CPU kernels, so ``auto`` keeps the engine's kernels in an export that traced tensors on
another device (CUDA).

>>> from ortmodule_exporter.aten.kernel_choice import configure_kernel_choice, decisions
>>> configure_kernel_choice("auto", torch_threads=1)
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import torch
import torch.nn.functional as F
from torch.onnx import symbolic_helper as sh
from torch.overrides import TorchFunctionMode

from ...engine_binding import import_onnxruntime
from ...label_density import DENSITY_THRESHOLD, label_density
from ...onnx_graph import attribute
from ...symbolics import embedding as embedding_symbolic
from ...symbolics import losses
from ...symbolics.registry import register_symbolic, registered_symbolics, unregister_symbolic
from ..executor import ATEN_DOMAIN, AtenFunction, register_aten_function
from ..gradients import GradientNode, register_aten_gradient, register_stop_gradient_edges
from ..parallel import TorchThreadsInEngine, elementwise
from ..routes import embedding_node, traced_sizes

__all__ = [
    "ATEN_NODE_US",
    "CALIBRATION_NUMEL",
    "MODES",
    "CROSS_ENTROPY",
    "ENGINE_FORWARD",
    "ENGINE_FORWARDS",
    "CoveredOperator",
    "aten_cross_entropy",
    "calibration_seconds",
    "choose",
    "configure_kernel_choice",
    "covered_operators",
    "cross_entropy_route",
    "current_mode",
    "current_torch_threads",
    "decisions",
    "decisions_from_json",
    "decisions_to_json",
    "machine_fingerprint",
    "machine_key",
    "measure_conv",
    "measure_cross_entropy",
    "embedding_route",
    "measure_embedding",
    "measure_gelu",
    "measure_layer_norm",
    "measure_max_pool2d",
    "measure_relu",
    "measure_relu_backward",
    "measure_row_sum",
    "recording_traced_sizes",
    "register_kernel_choice",
    "row_sum_route",
]

logger = logging.getLogger("ortmodule.exporter")

MODES = ("auto", "engine", "torch")
#: what one ATen node costs beyond its kernel (forward, bench_python_op.py on the 2-core EPYC)
ATEN_NODE_US = 45.0
#: elements of the tensor the calibration times when the export does not know the size
CALIBRATION_NUMEL = 1 << 20

GELU = "_ortmodule_gelu"
GELU_BACKWARD = "_ortmodule_gelu_backward"
RELU = "_ortmodule_relu"
RELU_BACKWARD = "_ortmodule_relu_backward"
CONV = "_ortmodule_conv"
CONV_BACKWARD = "_ortmodule_conv_backward"
CROSS_ENTROPY = "_ortmodule_cross_entropy"
CROSS_ENTROPY_BACKWARD = "_ortmodule_cross_entropy_backward"
LAYER_NORM = "_ortmodule_layer_norm"
LAYER_NORM_BACKWARD = "_ortmodule_layer_norm_backward"
ROW_SUM = "_ortmodule_row_sum"
#: the overload of an ATen node whose forward runs on the engine's kernel and only its backward
#: on PyTorch's (see :data:`ENGINE_FORWARDS`)
ENGINE_FORWARD = "engine_forward"
MAX_POOL2D = "_ortmodule_max_pool2d"
MAX_POOL2D_BACKWARD = "_ortmodule_max_pool2d_backward"

_LOCK = threading.Lock()
# nothing is rerouted until a caller (ORTModule, through ExportConfig) asks for it
_MODE = ["engine"]
#: PyTorch's intra-op threads inside the engine (0: PyTorch's current count)
_TORCH_THREADS = [0]
#: (operator, dtype, size class) -> "engine" or "torch", with the timings that decided it
_DECISIONS: dict[tuple[str, str, Any], tuple[str, float, float]] = {}
#: (operator, dtype, size class) -> seconds its measurement took in this process
_SECONDS: dict[tuple[str, str, Any], float] = {}
_PREVIOUS: dict[str, Any] = {}


def current_mode() -> str:
    """The mode :func:`configure_kernel_choice` set last (``engine`` until it is called)."""
    return _MODE[0]


def current_torch_threads() -> int:
    """The PyTorch thread count the measurement uses (0: PyTorch's current count)."""
    return _TORCH_THREADS[0]


def decisions() -> dict[tuple[str, str, Any], tuple[str, float, float]]:
    """What was chosen so far: key -> (route, engine us, torch us incl. the ATen nodes)."""
    with _LOCK:
        return dict(_DECISIONS)


def calibration_seconds() -> dict[tuple[str, str, Any], float]:
    """Seconds each decision's measurement took in this process (keys of :func:`decisions`;
    a decision this process did not measure itself is absent)."""
    with _LOCK:
        return dict(_SECONDS)


# -- calibrations kept with the export cache -----------------------------------------------------------
#
# A graph exported under ``auto`` has the routes this machine measured baked into it, so the
# export cache keys such a graph by :func:`machine_fingerprint` (another CPU, thread count or
# library version exports and measures again), and keeps the decisions in the entry as plain
# JSON (:func:`decisions_to_json`) that a warm start takes back (:func:`decisions_from_json`)
# for the passes that consult the kernel choice after the export.


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def machine_key() -> dict[str, Any]:
    """What the measurements depend on: the CPU model, PyTorch's thread count (the engine's
    sessions get as many), the in-engine PyTorch thread count and the torch and ONNX Runtime
    versions."""
    return {
        "cpu": _cpu_model(),
        "threads": torch.get_num_threads(),
        "torch_threads_in_engine": _TORCH_THREADS[0],
        "torch": torch.__version__,
        "onnxruntime": str(getattr(import_onnxruntime(), "__version__", "?")),
        "aten_node_us": ATEN_NODE_US,
    }


def machine_fingerprint() -> str:
    """A SHA-256 of :func:`machine_key`: part of the export-cache key of ``auto`` graphs."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(machine_key(), sort_keys=True).encode()).hexdigest()


#: what a size key may hold once read back (ints, strings and nested tuples of them)
_MAX_DECISIONS = 10_000


def _key_to_json(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return {"tuple": [_key_to_json(v) for v in value]}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"kernel-choice key {value!r} is not plain data")


def _key_from_json(data: Any, depth: int = 0) -> Any:
    if depth > 8:
        raise ValueError("kernel-choice key nested too deeply")
    if isinstance(data, dict) and set(data) == {"tuple"} and isinstance(data["tuple"], list):
        return tuple(_key_from_json(v, depth + 1) for v in data["tuple"])
    if data is None or type(data) in (bool, int, float, str):
        return data
    raise ValueError(f"bad kernel-choice key {data!r}")


def _us_to_json(value: float) -> float | None:
    return None if math.isinf(value) else value  # JSON has no infinity


def decisions_to_json() -> list[list[Any]]:
    """Every decision of this process as plain JSON data (for the export cache)."""
    out = []
    for (op, dtype, size), (route, engine_us, torch_us) in decisions().items():
        try:
            out.append([op, dtype, _key_to_json(size), route, engine_us, _us_to_json(torch_us)])
        except TypeError:
            continue  # a size that is not plain data stays in this process only
    return out


def decisions_from_json(data: Any) -> int:
    """Take decisions that :func:`decisions_to_json` wrote (in an export-cache entry of this
    machine) that this process has not made itself; how many were taken. ``ValueError`` when
    ``data`` is not such a list (nothing is taken then)."""
    if not isinstance(data, list) or len(data) > _MAX_DECISIONS:
        raise ValueError("kernel-choice decisions must be a list")
    found: dict[tuple[str, str, Any], tuple[str, float, float]] = {}
    for item in data:
        if not isinstance(item, list) or len(item) != 6:
            raise ValueError("bad kernel-choice decision")
        op, dtype, size, route, engine_us, torch_us = item
        if (
            not isinstance(op, str)
            or not isinstance(dtype, str)
            or route not in ("engine", "torch")
        ):
            raise ValueError("bad kernel-choice decision")
        if type(engine_us) not in (int, float) or (
            torch_us is not None and type(torch_us) not in (int, float)
        ):
            raise ValueError("bad kernel-choice timing")
        found[(op, dtype, _key_from_json(size))] = (
            route,
            float(engine_us),
            math.inf if torch_us is None else float(torch_us),
        )
    with _LOCK:
        new = {k: v for k, v in found.items() if k not in _DECISIONS}
        _DECISIONS.update(new)
    return len(new)


# -- the table of covered operators -----------------------------------------------------------------


@dataclass(frozen=True)
class CoveredOperator:
    """An operator the kernel choice covers: ``symbolic(default, g, *args)`` replaces the
    exporter's symbolic for ``op`` and calls ``default(g, *args)`` (the symbolic it replaced,
    or ``fallback()`` when there was none) where the engine's kernel stays."""

    op: str
    symbolic: Callable[..., Any]
    fallback: Callable[[], Callable[..., Any]]
    opset: int = 9


_COVERED: dict[str, CoveredOperator] = {}
_WRAPPERS: dict[str, Callable[..., Any]] = {}


def register_kernel_choice(entry: CoveredOperator) -> None:
    """Cover ``entry.op``; it is installed by the next :func:`configure_kernel_choice`.

    >>> register_kernel_choice(CoveredOperator("aten::relu", _relu_symbolic, _opset9("relu")))
    """
    op = entry.op

    def wrapper(g: Any, *args: Any) -> Any:
        return entry.symbolic(lambda g, *a: _default(op, g, *a), g, *args)

    wrapper.__qualname__ = f"kernel_choice[{op}]"
    _COVERED[op] = entry
    _WRAPPERS[op] = wrapper


def covered_operators() -> tuple[str, ...]:
    """The symbolics the kernel choice replaces (``aten::gelu``, ...)."""
    return tuple(_COVERED)


def _default(op: str, g: Any, *args: Any) -> Any:
    # the symbolic we replaced, where it applies at this export's opset
    previous = _PREVIOUS.get(op)
    if previous is not None and g.opset >= previous.opset:
        return previous.fn(g, *args)
    return _COVERED[op].fallback()(g, *args)


def _opset9(name: str) -> Callable[[], Callable[..., Any]]:
    def fallback() -> Callable[..., Any]:
        from torch.onnx._internal.torchscript_exporter import symbolic_opset9

        fn: Callable[..., Any] = getattr(symbolic_opset9, name)
        return fn

    return fallback


def configure_kernel_choice(mode: str = "auto", torch_threads: int | None = None) -> None:
    """Install the kernel-choice symbolics (``auto``/``torch``) or remove them (``engine``).

    ``torch_threads``: PyTorch's intra-op threads while the engine runs PyTorch-run nodes
    (``ORTMODULE_TORCH_THREADS_IN_ENGINE``; 0 keeps PyTorch's count), which the measurement
    of the PyTorch side uses; None leaves it as it is."""
    if mode not in MODES:
        raise ValueError(f"kernel choice mode must be one of {MODES}, got {mode!r}")
    if torch_threads is not None:
        if torch_threads < 0:
            raise ValueError(f"torch_threads must be >= 0, got {torch_threads}")
        _TORCH_THREADS[0] = torch_threads
    _MODE[0] = mode
    symbolics = registered_symbolics()
    for op, wrapper in _WRAPPERS.items():
        current = symbolics.get(op)
        if mode == "engine":
            if current is not None and current.fn is wrapper:
                previous = _PREVIOUS.pop(op, None)
                if previous is not None:
                    register_symbolic(op, previous.fn, previous.opset)
                else:
                    unregister_symbolic(op)
            continue
        if current is not None and current.fn is not wrapper:
            _PREVIOUS[op] = current
        register_symbolic(op, wrapper, _COVERED[op].opset)


# -- sizes seen while the export traces ---------------------------------------------------------------

_TRACE = threading.local()


@dataclass(frozen=True)
class _Traced:
    """One traced operator: its inputs' sizes (in the traced node's order) and which of its
    tensor arguments (in the Python call's order) need a gradient (an ATen node's gradient
    definition writes every input gradient it names, and the engine fails on one nobody needs)."""

    sizes: list[tuple[int, ...] | None]
    needs_grad: tuple[bool, ...]
    #: a cross-entropy's share of labels that count (not ``ignore_index``); None for others
    label_density: float | None = None

    @property
    def input_needs_grad(self) -> bool:
        return bool(self.needs_grad and self.needs_grad[0])


class _SizeRecorder(TorchFunctionMode):
    """Records the input sizes of every traced operator, per (scope, kind), in trace order."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[tuple[str, str], list[_Traced]] = {}
        self._seen: set[int] = set()
        #: whether a traced operator had a tensor off the CPU (the timings are CPU ones)
        self.off_cpu = False

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if torch._C._get_tracing_state() is None:
            return out
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if isinstance(first, torch.Tensor):
            try:
                value = torch._C._get_value_trace(first)  # type: ignore[attr-defined]
            except RuntimeError:  # not a traced value (a constant)
                return out
            if value.unique() not in self._seen:
                self._seen.add(value.unique())
                node = value.node()
                key = (node.scopeName(), node.kind().rstrip("_"))
                given = [*args, *(kwargs or {}).values()]
                if any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in given):
                    self.off_cpu = True
                self.sizes.setdefault(key, []).append(
                    _Traced(
                        [_complete_sizes(v) for v in node.inputs()],
                        tuple(a.requires_grad for a in given if isinstance(a, torch.Tensor)),
                        _label_density(func, args, kwargs or {}),
                    )
                )
        return out


def _label_density(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> float | None:
    """The share of counted labels of a traced ``F.cross_entropy`` call (what label sparsity
    decides on, from the same first batch); None for any other operator."""
    if func is not F.cross_entropy:
        return None
    bound = _CROSS_ENTROPY_SIGNATURE.bind(*args, **kwargs)
    target = bound.arguments.get("target")
    if not isinstance(target, torch.Tensor) or target.is_floating_point():
        return None  # class probabilities, not indices
    ignore_index = bound.arguments.get("ignore_index", -100)
    with warnings.catch_warnings():
        # read during the trace: the tracer's warning would name this line to the user
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return label_density(target.detach().cpu().numpy(), ignore_index)


_CROSS_ENTROPY_SIGNATURE = inspect.signature(F.cross_entropy)


def _complete_sizes(value: Any) -> tuple[int, ...] | None:
    """A traced value's sizes when all of them are known, else None."""
    sizes = traced_sizes(value)
    if sizes is None or any(s is None for s in sizes):
        return None
    return tuple(int(s) for s in sizes)  # type: ignore[arg-type]


@contextlib.contextmanager
def recording_traced_sizes() -> Iterator[None]:
    """For one export: remember the concrete sizes each operator had while it was traced, so
    the symbolics can class it (the exported graph's dims are dynamic). Does nothing in mode
    ``engine``, where no symbolic reads them."""
    if _MODE[0] == "engine":
        yield
        return
    previous = getattr(_TRACE, "recorder", None)
    recorder = _SizeRecorder()
    _TRACE.recorder = recorder
    try:
        with recorder:
            yield
    finally:
        _TRACE.recorder = previous


def _traced(g: Any) -> _Traced | None:
    """What the operator being exported had when it was traced, or None."""
    recorder = getattr(_TRACE, "recorder", None)
    node = getattr(g, "original_node", None)
    if recorder is None or node is None:
        return None
    key = (node.scopeName(), node.kind().rstrip("_"))
    seen = recorder.sizes.get(key)
    if not seen:
        return None
    # the n-th such operator of this module scope in the graph is the n-th one traced
    ordinal = 0
    other = node.prev()
    while other.kind() not in ("prim::Param", "prim::Return"):
        if (other.scopeName(), other.kind().rstrip("_")) == key:
            ordinal += 1
        other = other.prev()
    return seen[ordinal] if ordinal < len(seen) else None


# -- measuring ---------------------------------------------------------------------------------------


def _best_us(fn: Callable[[], Any], repeats: int = 5) -> float:
    fn()  # first-call costs
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    # the median of a few runs: one preempted run on a busy machine must not decide
    return statistics.median(times) * 1e6


def _torch_threads_in_engine() -> TorchThreadsInEngine:
    """What an engine run sets: PyTorch's in-engine thread count and the pieces of splittable
    nodes (a measurement runs our ATen functions, so it times the pieces too)."""
    return TorchThreadsInEngine(_TORCH_THREADS[0])


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


def measure_gelu(numel: int, approximate: str = "none") -> tuple[float, float]:
    """Microseconds of GELU forward + backward on ``numel`` float32 elements: (engine, torch).

    The engine side is its ``Gelu`` and ``GeluGrad`` kernels in one session (what the engine
    fuses an exported GELU into); the torch side adds the two ATen nodes' own cost.
    """
    from onnx import helper

    fast = approximate != "none"
    nodes = [
        helper.make_node("FastGelu" if fast else "Gelu", ["x"], ["y"], domain="com.microsoft"),
        helper.make_node(
            "FastGeluGrad" if fast else "GeluGrad", ["dy", "x"], ["dx"], domain="com.microsoft"
        ),
    ]
    _seeded()
    x, dy = _randn(numel), _randn(numel)
    engine_us = _engine_us("gelu", nodes, {"x": x, "dy": dy}, ["y", "dx"])

    def torch_route() -> None:
        _gelu(approximate, [x])
        _gelu_backward(approximate, [dy, x])

    return engine_us, _torch_us(torch_route)


def measure_relu(numel: int) -> tuple[float, float]:
    """Microseconds of ReLU forward on ``numel`` float32 elements: (engine, torch). Engine:
    ``Relu``; PyTorch: ``relu`` and one ATen node. The backward is timed on its own
    (:func:`measure_relu_backward`): the engine's ``Relu`` is quick, its ``ReluGrad`` is not."""
    from onnx import helper

    _seeded()
    x = _randn(numel)
    engine_us = _engine_us("relu", [helper.make_node("Relu", ["x"], ["y"])], {"x": x}, ["y"])
    return engine_us, _torch_us(lambda: _relu("", [x]), aten_nodes=1)


def measure_relu_backward(numel: int) -> tuple[float, float]:
    """Microseconds of ReLU's backward on ``numel`` float32 elements: (engine, torch). Engine:
    ``ReluGrad``; PyTorch: ``threshold_backward`` and one ATen node."""
    from onnx import helper

    nodes = [helper.make_node("ReluGrad", ["dy", "y"], ["dx"], domain="com.microsoft")]
    _seeded()
    y, dy = torch.relu(_randn(numel)), _randn(numel)
    engine_us = _engine_us("relu_backward", nodes, {"dy": dy, "y": y}, ["dx"])
    return engine_us, _torch_us(lambda: _relu_backward("", [dy, y]), aten_nodes=1)


@dataclass(frozen=True)
class _ConvSettings:
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    def params(self) -> list[int]:
        return [*self.stride, *self.padding, *self.dilation, self.groups]

    @classmethod
    def parse(cls, params: Sequence[int], n: int) -> _ConvSettings:
        return cls(
            tuple(params[:n]), tuple(params[n : 2 * n]), tuple(params[2 * n : 3 * n]), params[3 * n]
        )


def measure_conv(
    input_shape: Sequence[int],
    weight_shape: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int = 1,
    bias: bool = False,
) -> tuple[float, float]:
    """Microseconds of a convolution's forward + backward (input, weight and bias gradients):
    (engine, torch). Engine: ``Conv`` + ``ConvGrad``; PyTorch: ``convolution`` +
    ``convolution_backward`` and two ATen nodes."""
    from onnx import helper

    n = len(weight_shape) - 2
    attrs: dict[str, Any] = {
        "kernel_shape": list(weight_shape[2:]),
        "strides": list(stride),
        "pads": list(padding) * 2,
        "dilations": list(dilation),
        "group": groups,
    }
    _seeded()
    x, w = _randn(*input_shape), _randn(*weight_shape)
    b = _randn(weight_shape[0])
    y = torch.convolution(
        x, w, b if bias else None, stride, padding, dilation, False, [0] * n, groups
    )
    dy = _randn(*y.shape)
    conv_inputs = ["x", "w", "b"] if bias else ["x", "w"]
    grads = ["dx", "dw", "db"] if bias else ["dx", "dw"]
    engine_x, engine_w, engine_dy = x, w, dy
    if n == 1 and groups > 1:
        # The engine's grouped 1-D ConvGrad clears memory past its input gradient (engine bug,
        # passes/grouped_conv_grad.py), so built graphs run it as the 2-D kernel with a height
        # of 1: time that form (and never run the faulty kernel here).
        engine_x, engine_w, engine_dy = x.unsqueeze(2), w.unsqueeze(2), dy.unsqueeze(2)
        attrs.update(
            kernel_shape=[1, *weight_shape[2:]],
            strides=[1, *stride],
            pads=[0, padding[0], 0, padding[0]],
            dilations=[1, *dilation],
        )
    nodes = [
        helper.make_node("Conv", conv_inputs, ["y"], **attrs),
        helper.make_node("ConvGrad", ["dy", "x", "w"], grads, domain="com.microsoft", **attrs),
    ]
    feeds = {"x": engine_x, "w": engine_w, "dy": engine_dy, **({"b": b} if bias else {})}
    engine_us = _engine_us("conv", nodes, feeds, ["y", *grads])

    params = torch.tensor(
        _ConvSettings(tuple(stride), tuple(padding), tuple(dilation), groups).params()
    )

    def torch_route() -> None:
        (out,) = _conv("xwb" if bias else "xw", [x, w, *([b] if bias else []), params])
        torch.ops.aten.convolution_backward(
            dy,
            x,
            w,
            [w.shape[0]] if bias else None,
            stride,
            padding,
            dilation,
            False,
            [0] * n,
            groups,
            [True, True, bias],
        )
        del out

    return engine_us, _torch_us(torch_route)


def measure_max_pool2d(
    input_shape: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool = False,
) -> tuple[float, float]:
    """Microseconds of 2-d max pooling forward + backward: (engine, torch). Engine: what
    ``symbolics/pooling.py`` exports (``MaxPool`` for the indices, ``Gather`` from the
    flattened input) and ``GatherGrad``; PyTorch: ``max_pool2d_with_indices`` and its backward
    and two ATen nodes."""
    from onnx import TensorProto, helper

    _seeded()
    x = _randn(*input_shape)
    values, indices = torch.ops.aten.max_pool2d_with_indices(
        x, kernel, stride, padding, dilation, ceil_mode
    )
    dy = _randn(*values.shape)
    nodes = [
        helper.make_node(
            "MaxPool",
            ["x"],
            ["unused", "idx"],
            kernel_shape=list(kernel),
            strides=list(stride),
            pads=list(padding) * 2,
            dilations=list(dilation),
            ceil_mode=int(ceil_mode),
        ),
        helper.make_node("Reshape", ["x", "minus_one"], ["flat"]),
        helper.make_node("Gather", ["flat", "idx"], ["y"], axis=0),
        helper.make_node("Shape", ["flat"], ["flat_shape"]),
        helper.make_node(
            "GatherGrad", ["flat_shape", "idx", "dy"], ["dflat"], domain="com.microsoft", axis=0
        ),
    ]
    feeds = {"x": x, "dy": dy, "minus_one": torch.tensor([-1])}
    engine_us = _engine_us(
        "max_pool2d", nodes, feeds, ["y", "dflat"], {"minus_one": TensorProto.INT64}
    )

    settings = [*kernel, *stride, *padding, *dilation, int(ceil_mode)]
    params = torch.tensor(settings)
    layout = pool_layout(input_shape, settings)

    def torch_route() -> None:
        _max_pool2d(layout, [x, params])
        torch.ops.aten.max_pool2d_with_indices_backward(
            dy, x, kernel, stride, padding, dilation, ceil_mode, indices
        )

    return engine_us, _torch_us(torch_route)


def measure_layer_norm(rows: int, normalized_shape: Sequence[int]) -> tuple[float, float]:
    """Microseconds of LayerNorm forward + backward (input, weight and bias gradients) on
    ``rows`` rows of ``normalized_shape``: (engine, torch). Engine: ``LayerNormalization`` +
    ``LayerNormalizationGrad``; PyTorch: ``native_layer_norm`` and its backward, two ATen
    nodes."""
    from onnx import helper

    shape = list(normalized_shape)
    axis = -len(shape)
    _seeded()
    x, dy = _randn(rows, *shape), _randn(rows, *shape)
    w, b = _randn(*shape), _randn(*shape)
    nodes = [
        helper.make_node("LayerNormalization", ["x", "w", "b"], ["y", "mean", "rstd"], axis=axis),
        helper.make_node(
            "LayerNormalizationGrad",
            ["dy", "x", "w", "mean", "rstd"],
            ["dx", "dw", "db"],
            domain="com.microsoft",
            axis=axis,
        ),
    ]
    feeds = {"x": x, "w": w, "b": b, "dy": dy}
    engine_us = _engine_us("layer_norm", nodes, feeds, ["y", "dx", "dw", "db"])
    params = [torch.tensor(shape), torch.tensor(1e-5, dtype=torch.float64)]

    def torch_route() -> None:
        _y, mean, rstd = _layer_norm("", [x, w, b, *params])
        _layer_norm_backward("", [dy, x, mean, rstd, w, b, params[0]])

    return engine_us, _torch_us(torch_route)


def measure_cross_entropy(rows: int, classes: int) -> tuple[float, float]:
    """Microseconds of a mean cross-entropy over ``rows`` x ``classes`` logits, forward +
    backward: (engine, torch). Engine: ``SoftmaxCrossEntropyLoss`` and its gradient; PyTorch:
    ``log_softmax`` + ``nll_loss`` and their backwards, two ATen nodes."""
    from onnx import TensorProto, helper

    _seeded()
    logits = _randn(rows, classes)
    target = torch.randint(0, classes, (rows,), generator=_randn.gen)  # type: ignore[attr-defined]
    nodes = [
        helper.make_node(
            "SoftmaxCrossEntropyLoss", ["x", "t"], ["loss", "log_prob"], reduction="mean"
        ),
        helper.make_node(
            "SoftmaxCrossEntropyLossGrad",
            ["dloss", "log_prob", "t"],
            ["dx"],
            domain="com.microsoft",
            reduction="mean",
        ),
    ]
    feeds = {"x": logits, "t": target, "dloss": torch.tensor(1.0)}
    engine_us = _engine_us("cross_entropy", nodes, feeds, ["loss", "dx"], {"t": TensorProto.INT64})
    params = torch.tensor([_MEAN, -100])

    def torch_route() -> None:
        _loss, log_prob, total = _cross_entropy("", [logits, target, params])
        _cross_entropy_backward("", [torch.tensor(1.0), log_prob, target, total, params])

    return engine_us, _torch_us(torch_route)


def measure_embedding(rows: int, dim: int, lookups: int) -> tuple[float, float]:
    """Microseconds of an embedding lookup of ``lookups`` indices into a ``rows`` x ``dim``
    table, forward + backward (the table's gradient): (engine, torch). Engine: ``Gather`` +
    ``GatherGrad``; PyTorch: ``embedding`` and ``embedding_backward``, two ATen nodes."""
    from onnx import TensorProto, helper

    _seeded()
    w, dy = _randn(rows, dim), _randn(lookups, dim)
    idx = torch.randint(0, rows, (lookups,), generator=_randn.gen)  # type: ignore[attr-defined]
    nodes = [
        helper.make_node("Gather", ["w", "idx"], ["y"]),
        helper.make_node("Shape", ["w"], ["shape"]),
        helper.make_node("GatherGrad", ["shape", "idx", "dy"], ["dw"], domain="com.microsoft"),
    ]
    feeds = {"w": w, "idx": idx, "dy": dy}
    engine_us = _engine_us("embedding", nodes, feeds, ["y", "dw"], {"idx": TensorProto.INT64})

    def torch_route() -> None:
        torch.ops.aten.embedding(w, idx)
        torch.ops.aten.embedding_backward(dy, idx, rows, -1, False, False)

    return engine_us, _torch_us(torch_route)


def measure_row_sum(rows: int, cols: int) -> tuple[float, float]:
    """Microseconds of summing a ``rows`` x ``cols`` float32 matrix over its rows (a bias's
    gradient): (engine, torch). Engine: ``ReduceSum`` over axis 0; PyTorch: ``sum(0)`` and one
    ATen node."""
    from onnx import TensorProto, helper

    _seeded()
    x = _randn(rows, cols)
    nodes = [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)]
    feeds = {"x": x, "axes": torch.tensor([0])}
    engine_us = _engine_us("row_sum", nodes, feeds, ["y"], {"axes": TensorProto.INT64})
    return engine_us, _torch_us(lambda: _row_sum("1", [x]), aten_nodes=1)


def row_sum_route(cols: int) -> str:
    """``"engine"`` or ``"torch"`` for a float32 sum over every axis but the last, ``cols``
    wide (a bias gradient the engine's gradient builder writes as ``ReduceSum``). Timed at
    :data:`CALIBRATION_NUMEL` elements: the row count is the batch's, unknown when the graph
    is built."""
    rows = max(1, CALIBRATION_NUMEL // max(cols, 1))
    return _decide(f"row_sum({cols})", "Float", rows, lambda: measure_row_sum(rows, cols))


def cross_entropy_route(rows: int, classes: int) -> str:
    """``"engine"`` or ``"torch"`` for a float32 mean or sum cross-entropy over ``rows`` x
    ``classes`` logits and class indices, forward and backward (timed at ``rows``' size
    class)."""
    size = _size_class(rows)
    return _decide(
        f"cross_entropy({classes})", "Float", size, lambda: measure_cross_entropy(size, classes)
    )


def aten_cross_entropy(loss: onnx.NodeProto) -> tuple[onnx.NodeProto, onnx.TensorProto]:
    """The ATen node PyTorch's cross-entropy runs as, in place of the engine's
    ``SoftmaxCrossEntropyLoss`` node ``loss`` (reduction mean or sum, an ``ignore_index``, no
    weight): the node, with ``loss``'s name, inputs and outputs and a third output, and the
    initializer of its reduction and ignore index."""
    reduction = attribute(loss, "reduction", "mean")
    ignore_index = attribute(loss, "ignore_index")
    if reduction not in ("mean", "sum") or ignore_index is None or len(loss.input) != 2:
        raise ValueError(f"{loss.name}: not a mean or sum cross-entropy with an ignore_index")
    code = _MEAN if reduction == "mean" else _SUM
    params = onnx.numpy_helper.from_array(
        np.array([code, int(ignore_index)], np.int64), f"{loss.name}/reduction_and_ignore_index"
    )
    log_prob = loss.output[1] if len(loss.output) > 1 and loss.output[1] else ""
    outputs = [loss.output[0], log_prob or f"{loss.name}/log_prob", f"{loss.name}/total"]
    node = onnx.helper.make_node(
        "ATen",
        [loss.input[0], loss.input[1], params.name],
        outputs,
        name=loss.name,
        domain=ATEN_DOMAIN,
        operator=CROSS_ENTROPY,
        overload_name="",
    )
    return node, params


def _size_class(numel: int) -> int:
    return 1 << max(0, round(math.log2(max(numel, 1))))


def _decide(op: str, dtype: str, size: Any, measure: Callable[[], tuple[float, float]]) -> str:
    mode = _MODE[0]
    if mode != "auto":
        return mode
    recorder = getattr(_TRACE, "recorder", None)
    if recorder is not None and recorder.off_cpu:
        # the measurements time CPU kernels; on CUDA the engine's stay until they time CUDA
        return "engine"
    key = (op, dtype, size)
    with _LOCK:
        found = _DECISIONS.get(key)
    if found is None:
        start = time.perf_counter()
        try:
            engine_us, torch_us = measure()
        except Exception as err:  # noqa: BLE001 - no measurement: keep the engine's kernel
            logger.info("kernel choice: could not time %s (%s); using the engine's kernel", op, err)
            engine_us, torch_us = 0.0, math.inf
        route = "torch" if torch_us < engine_us else "engine"
        found = (route, engine_us, torch_us)
        with _LOCK:
            _DECISIONS[key] = found
            _SECONDS[key] = time.perf_counter() - start
        logger.info(
            "kernel choice: %s %s on %s runs on %s (engine %.0f us, PyTorch %.0f us "
            "with its ATen nodes, %d PyTorch threads)",
            op,
            dtype,
            size,
            route,
            engine_us,
            torch_us,
            _TORCH_THREADS[0] or torch.get_num_threads(),
        )
    return found[0]


def choose(
    op: str, dtype: str, numel: int | None, measure: Callable[[int], tuple[float, float]]
) -> str:
    """``"engine"`` or ``"torch"`` for ``op`` on tensors of ``numel`` elements (None: unknown)."""
    size = _size_class(numel if numel is not None else CALIBRATION_NUMEL)
    return _decide(op, dtype, size, lambda: measure(size))


# -- GELU ---------------------------------------------------------------------------------------------


def _all_tensors(_overload: str, _index: int, _is_input: bool) -> bool:
    return True


def _row_sum(overload: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The sum over the first ``int(overload)`` axes (a built-graph pass writes these nodes:
    ``passes/row_sums.py``); they are gradient nodes, with no gradient of their own."""
    (x,) = inputs
    assert x is not None
    return [x.sum(tuple(range(int(overload))))]


register_aten_function(ROW_SUM, AtenFunction(_row_sum, _all_tensors))


def _gelu(approximate: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    (x,) = inputs
    assert x is not None
    return [elementwise(torch.ops.aten.gelu.out, [x], approximate=approximate or "none")]


def _gelu_backward(
    approximate: str, inputs: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    grad, x = inputs
    assert grad is not None and x is not None
    op = torch.ops.aten.gelu_backward.grad_input
    return [elementwise(op, [grad, x], "grad_input", approximate=approximate or "none")]


register_aten_function(GELU, AtenFunction(_gelu, _all_tensors))
register_aten_function(GELU_BACKWARD, AtenFunction(_gelu_backward, _all_tensors))
for _approximate in ("none", "tanh"):
    register_aten_gradient(
        GELU,
        _approximate,
        [GradientNode.aten(GELU_BACKWARD, ["GO(0)", "I(0)"], ["GI(0)"], overload=_approximate)],
    )


def _numel(value: Any) -> int | None:
    sizes = _complete_sizes(value)
    return math.prod(sizes) if sizes is not None else None


def _dtype(value: Any) -> str | None:
    jit_type = value.type()
    return jit_type.scalarType() if hasattr(jit_type, "scalarType") else None


def _gelu_symbolic(default: Callable[..., Any], g: Any, self: Any, approximate: Any = None) -> Any:
    approx = "none" if approximate is None else sh._maybe_get_const(approximate, "s")
    dtype = _dtype(self)
    if approx not in ("none", "tanh") or dtype != "Float":
        return default(g, self, approximate)
    route = choose(
        f"gelu({approx})", dtype, _numel(self), lambda n: measure_gelu(n, approximate=approx)
    )
    if route != "torch":
        return default(g, self, approximate)
    out = g.op(f"{ATEN_DOMAIN}::ATen", self, operator_s=GELU, overload_name_s=approx, outputs=1)
    out.setType(self.type())
    return out


# -- ReLU ---------------------------------------------------------------------------------------------


def _relu(_overload: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    (x,) = inputs
    assert x is not None
    return [torch.relu(x)]


def _relu_backward(_overload: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    grad, y = inputs
    assert grad is not None and y is not None
    # eager's derivative of relu reads its result
    return [torch.ops.aten.threshold_backward(grad, y, 0)]


register_aten_function(RELU, AtenFunction(_relu, _all_tensors))
register_aten_function(RELU_BACKWARD, AtenFunction(_relu_backward, _all_tensors))
for _overload in ("", ENGINE_FORWARD):
    register_aten_gradient(
        RELU, _overload, [GradientNode.aten(RELU_BACKWARD, ["GO(0)", "O(0)"], ["GI(0)"])]
    )
#: an ATen operator -> the engine's node its ``ENGINE_FORWARD`` overload becomes once the graph
#: is built (``passes/engine_forwards.py``)
ENGINE_FORWARDS: dict[str, str] = {RELU: "Relu"}


def _relu_symbolic(default: Callable[..., Any], g: Any, self: Any) -> Any:
    """ReLU's forward and backward are chosen apart: the engine's ``Relu`` is about as fast as
    PyTorch's, its ``ReluGrad`` several times slower at a CNN's activation sizes. Forward on
    the engine with the backward on PyTorch is an ATen node of overload ``ENGINE_FORWARD``
    (its gradient is PyTorch's) that a built-graph pass turns back into ``Relu``. A forward on
    PyTorch always has its backward there too (no ``ReluGrad`` after an ATen forward)."""
    dtype = _dtype(self)
    traced = _traced(g)
    # without a trace record the gradient's needs are unknown: the engine's kernel stays
    if dtype != "Float" or traced is None or not traced.input_needs_grad:
        return default(g, self)
    sizes = traced.sizes[0] if traced.sizes else None
    numel = math.prod(sizes) if sizes is not None else None
    if choose("relu_backward", dtype, numel, measure_relu_backward) != "torch":
        return default(g, self)
    forward = choose("relu", dtype, numel, measure_relu)
    overload = ENGINE_FORWARD if forward == "engine" else ""
    out = g.op(f"{ATEN_DOMAIN}::ATen", self, operator_s=RELU, overload_name_s=overload, outputs=1)
    out.setType(self.type())
    return out


# -- convolution --------------------------------------------------------------------------------------


# Overloads: "xw" without bias, "xwb" with one. The engine builds every input gradient a
# gradient definition writes and fails when nobody needs one (a convolution of the model's input:
# "invalid index -1"; a definition without the input's gradient was refused too, "failed to find
# NodeArg <weight>_grad"), so only convolutions whose input needs a gradient are routed.
_CONV_OVERLOADS = ("xw", "xwb")


def _conv(overload: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    x, weight, *rest = inputs
    assert x is not None and weight is not None and rest[-1] is not None
    bias = rest[0] if "b" in overload else None
    n = weight.dim() - 2
    s = _ConvSettings.parse(rest[-1].tolist(), n)
    # whole, not in pieces (see aten/parallel.py)
    return [
        torch.convolution(
            x, weight, bias, s.stride, s.padding, s.dilation, False, [0] * n, s.groups
        )
    ]


def _conv_backward(overload: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    grad, x, weight, params = inputs
    assert grad is not None and x is not None and weight is not None and params is not None
    n = weight.dim() - 2
    s = _ConvSettings.parse(params.tolist(), n)
    mask = ["x" in overload, True, "b" in overload]
    grads = torch.ops.aten.convolution_backward(
        grad,
        x,
        weight,
        [weight.shape[0]] if mask[2] else None,
        s.stride,
        s.padding,
        s.dilation,
        False,
        [0] * n,
        s.groups,
        mask,
    )
    return [g for g, wanted in zip(grads, mask, strict=True) if wanted]


register_aten_function(CONV, AtenFunction(_conv, _all_tensors))
register_aten_function(CONV_BACKWARD, AtenFunction(_conv_backward, _all_tensors))
for _overload in _CONV_OVERLOADS:
    _params = "I(3)" if "b" in _overload else "I(2)"
    register_aten_gradient(
        CONV,
        _overload,
        [
            GradientNode.aten(
                CONV_BACKWARD,
                ["GO(0)", "I(0)", "I(1)", _params],
                [f"GI({i})" for i, c in enumerate("xwb") if c in _overload],
                overload=_overload,
            )
        ],
    )
    register_stop_gradient_edges(CONV, _overload, [int(_params[2])])


def _ints_const(g: Any, values: Sequence[int]) -> Any:
    return g.op("Constant", value_t=torch.tensor(list(values), dtype=torch.int64))


def _convolution_symbolic(default: Callable[..., Any], g: Any, *args: Any) -> Any:
    x, weight, bias, stride, padding, dilation, transposed = args[:7]
    groups = args[8]
    dtype = _dtype(x)
    weight_sizes = sh._get_tensor_sizes(weight)
    if (
        dtype != "Float"
        or _dtype(weight) != "Float"
        or sh._maybe_get_const(transposed, "i")
        or weight_sizes is None
        or any(s is None for s in weight_sizes)
        or len(weight_sizes) < 3
    ):
        return default(g, *args)
    n = len(weight_sizes) - 2
    has_bias = not sh._is_none(bias)
    try:
        settings = _ConvSettings(
            tuple(_per_dim(sh._maybe_get_const(stride, "is"), n, 1)),
            tuple(_per_dim(sh._maybe_get_const(padding, "is"), n, 0)),
            tuple(_per_dim(sh._maybe_get_const(dilation, "is"), n, 1)),
            int(sh._maybe_get_const(groups, "i")),
        )
    except (TypeError, ValueError):  # a setting only known at run time
        return default(g, *args)
    traced = _traced(g)
    if traced is None or not traced.input_needs_grad:
        return default(g, *args)
    input_shape = traced.sizes[0] if traced.sizes else None
    op = (
        f"conv(weight={'x'.join(map(str, weight_sizes))},stride={settings.stride},"
        f"padding={settings.padding},dilation={settings.dilation},groups={settings.groups},"
        f"bias={int(has_bias)})"
    )
    if input_shape is None or len(input_shape) != n + 2:
        # the cost depends on the spatial sizes: without them nothing can be measured
        route = _decide(op, dtype, None, lambda: (0.0, math.inf))
    else:
        route = _decide(
            op,
            dtype,
            tuple(input_shape),
            lambda: measure_conv(
                input_shape,
                weight_sizes,
                settings.stride,
                settings.padding,
                settings.dilation,
                settings.groups,
                has_bias,
            ),
        )
    if route != "torch":
        return default(g, *args)
    params = _ints_const(g, settings.params())
    inputs = [x, weight, bias, params] if has_bias else [x, weight, params]
    overload = "xwb" if has_bias else "xw"
    out = g.op(
        f"{ATEN_DOMAIN}::ATen", *inputs, operator_s=CONV, overload_name_s=overload, outputs=1
    )
    out.setType(x.type().with_sizes([None, int(weight_sizes[0]), *([None] * n)]))
    return out


def _per_dim(values: Any, n: int, fill: int) -> list[int]:
    values = [int(v) for v in values] if values is not None else []
    if not values:
        return [fill] * n
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise ValueError(f"{values} does not give {n} dims")
    return values


def _default_convolution() -> Callable[..., Any]:
    from torch.onnx import symbolic_opset9

    fn: Callable[..., Any] = symbolic_opset9._convolution
    return fn


# -- LayerNorm ----------------------------------------------------------------------------------------


def _layer_norm(_overload: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    x, weight, bias, shape, eps = inputs
    assert x is not None and shape is not None and eps is not None
    return list(torch.ops.aten.native_layer_norm(x, shape.tolist(), weight, bias, eps.item()))


def _layer_norm_backward(
    _overload: str, inputs: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    grad, x, mean, rstd, weight, bias, shape = inputs
    assert grad is not None and x is not None and shape is not None
    return list(
        torch.ops.aten.native_layer_norm_backward(
            grad, x, shape.tolist(), mean, rstd, weight, bias, [True, True, True]
        )
    )


register_aten_function(LAYER_NORM, AtenFunction(_layer_norm, _all_tensors))
register_aten_function(LAYER_NORM_BACKWARD, AtenFunction(_layer_norm_backward, _all_tensors))
register_aten_gradient(
    LAYER_NORM,
    "",
    [
        GradientNode.aten(
            LAYER_NORM_BACKWARD,
            ["GO(0)", "I(0)", "O(1)", "O(2)", "I(1)", "I(2)", "I(3)"],
            ["GI(0)", "GI(1)", "GI(2)"],
        )
    ],
)
register_stop_gradient_edges(LAYER_NORM, "", [3, 4])


def _layer_norm_symbolic(
    default: Callable[..., Any],
    g: Any,
    x: Any,
    normalized_shape: Any,
    weight: Any,
    bias: Any,
    eps: Any,
    cudnn_enable: Any,
) -> Any:
    args = (x, normalized_shape, weight, bias, eps, cudnn_enable)
    dtype = _dtype(x)
    shape = sh._maybe_get_const(normalized_shape, "is")
    eps_value = sh._maybe_get_const(eps, "f")
    traced = _traced(g)
    if (
        dtype != "Float"
        or sh._is_none(weight)
        or sh._is_none(bias)
        or not isinstance(shape, list)
        or not isinstance(eps_value, float)
        or traced is None
        # input, weight and bias all need their gradient (a frozen LayerNorm stays on the engine)
        or len(traced.needs_grad) != 3
        or not all(traced.needs_grad)
        or not traced.sizes
        or traced.sizes[0] is None
    ):
        return default(g, *args)
    cols = math.prod(shape)
    rows = _size_class(math.prod(traced.sizes[0]) // max(cols, 1))
    route = _decide(
        f"layer_norm({'x'.join(map(str, shape))})",
        dtype,
        rows,
        lambda: measure_layer_norm(rows, shape),
    )
    if route != "torch":
        return default(g, *args)
    eps_const = g.op("Constant", value_t=torch.tensor(eps_value, dtype=torch.float64))
    y, mean, rstd = g.op(
        f"{ATEN_DOMAIN}::ATen",
        x,
        weight,
        bias,
        _ints_const(g, shape),
        eps_const,
        operator_s=LAYER_NORM,
        overload_name_s="",
        outputs=3,
    )
    y.setType(x.type())
    # the statistics keep the input's rank (size 1 in the normalized dims)
    for stat in (mean, rstd):
        stat.setType(x.type().with_sizes([None] * len(traced.sizes[0])))
    return y


# -- cross-entropy -------------------------------------------------------------------------------------

#: ATen's reduction codes the route takes (``none`` keeps the engine's kernel)
_MEAN, _SUM = 1, 2


def _cross_entropy(_overload: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    logits, target, params = inputs
    assert logits is not None and target is not None and params is not None
    reduction, ignore_index = params.tolist()
    # what F.cross_entropy runs on class indices: log_softmax, then nll_loss
    log_prob = torch.log_softmax(logits, 1)
    loss, total = torch.ops.aten.nll_loss_forward(log_prob, target, None, reduction, ignore_index)
    return [loss, log_prob, total]


def _cross_entropy_backward(
    _overload: str, inputs: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    grad, log_prob, target, total, params = inputs
    assert grad is not None and log_prob is not None and target is not None
    assert total is not None and params is not None
    reduction, ignore_index = params.tolist()
    grad_log_prob = torch.ops.aten.nll_loss_backward(
        grad, log_prob, target, None, reduction, ignore_index, total
    )
    return [torch.ops.aten._log_softmax_backward_data(grad_log_prob, log_prob, 1, log_prob.dtype)]


register_aten_function(CROSS_ENTROPY, AtenFunction(_cross_entropy, _all_tensors))
register_aten_function(CROSS_ENTROPY_BACKWARD, AtenFunction(_cross_entropy_backward, _all_tensors))
register_aten_gradient(
    CROSS_ENTROPY,
    "",
    [
        GradientNode.aten(
            CROSS_ENTROPY_BACKWARD, ["GO(0)", "O(1)", "I(1)", "O(2)", "I(2)"], ["GI(0)"]
        )
    ],
)
register_stop_gradient_edges(CROSS_ENTROPY, "", [1, 2])


def _cross_entropy_symbolic(
    default: Callable[..., Any],
    g: Any,
    logits: Any,
    target: Any,
    weight: Any,
    reduction: Any,
    ignore_index: Any,
    label_smoothing: Any,
) -> Any:
    args = (logits, target, weight, reduction, ignore_index, label_smoothing)
    mode = sh._maybe_get_const(reduction, "i")
    ignored = sh._maybe_get_const(ignore_index, "i")
    smoothing = sh._maybe_get_const(label_smoothing, "f")
    traced = _traced(g)
    if (
        _dtype(logits) != "Float"
        or not sh._is_none(weight)
        or mode not in (_MEAN, _SUM)
        or not isinstance(ignored, int)
        or smoothing != 0.0
        or traced is None
        or not traced.input_needs_grad
        # label sparsity would shrink this loss to its labelled rows: the engine's node stays
        or traced.label_density is None
        or traced.label_density < DENSITY_THRESHOLD
        or len(traced.sizes) < 2
        or traced.sizes[0] is None
        or len(traced.sizes[0]) != 2
        or traced.sizes[1] is None
        or len(traced.sizes[1]) != 1
    ):
        return default(g, *args)
    rows, classes = traced.sizes[0]
    if cross_entropy_route(rows, classes) != "torch":
        return default(g, *args)
    loss, log_prob, total = g.op(
        f"{ATEN_DOMAIN}::ATen",
        logits,
        target,
        _ints_const(g, [mode, ignored]),
        operator_s=CROSS_ENTROPY,
        overload_name_s="",
        outputs=3,
    )
    loss.setType(logits.type().with_sizes([]))
    log_prob.setType(logits.type().with_sizes([None, None]))
    total.setType(logits.type().with_sizes([]))
    return loss


# -- embedding -----------------------------------------------------------------------------------------


def embedding_route(
    g: Any, weight: Any, indices: Any, padding_idx: int = -1, scale_grad_by_freq: bool = False
) -> Any:
    """An ATen ``embedding`` node (PyTorch's lookup and ``embedding_backward``, with
    ``padding_idx`` and ``scale_grad_by_freq`` as eager has them) where PyTorch's kernels
    measured faster, else None (the exporter's own form). Called by the exporter's
    ``embedding`` symbolic.

    Timed on the plain lookup (``Gather`` + ``GatherGrad`` against PyTorch's pair): the
    engine's form with a padding row or frequency scaling adds nodes to that (an ``Equal``,
    a ``Where`` and a second ``Gather``; a ``ScatterElements`` count), PyTorch's pair stays
    one kernel each, so where PyTorch wins the plain lookup it wins these too."""
    if _MODE[0] == "engine":
        return None
    weight_sizes = sh._get_tensor_sizes(weight)
    traced = _traced(g)
    if (
        _dtype(weight) != "Float"
        or weight_sizes is None
        or len(weight_sizes) != 2
        or any(s is None for s in weight_sizes)
        or traced is None
        # F.embedding(indices, weight): the table's gradient must be wanted
        or len(traced.needs_grad) != 2
        or not traced.needs_grad[1]
        or len(traced.sizes) < 2
        or traced.sizes[1] is None
    ):
        return None
    rows, dim = (int(s) for s in weight_sizes)
    lookups = _size_class(math.prod(traced.sizes[1]))
    route = _decide(
        f"embedding({rows}x{dim})",
        "Float",
        lookups,
        lambda: measure_embedding(rows, dim, lookups),
    )
    if route != "torch":
        return None
    out = embedding_node(
        g, weight, indices, padding_idx, scale_grad_by_freq, index_rank=len(traced.sizes[1])
    )
    # The engine knows no shape for an ATen node's output, whatever the graph declares, and
    # its broadcasting gradients need one (a position embedding added to a batch of token
    # embeddings: "GetShape(input_grad ...) was false"); a Reshape to the indices' shape plus
    # the embedding dim, which it infers the rank of, gives it one.
    shape = g.op("Concat", g.op("Shape", indices), _ints_const(g, [dim]), axis_i=0)
    reshaped = g.op("Reshape", out, shape)
    reshaped.setType(out.type())
    return reshaped


embedding_symbolic.LOOKUP_ROUTE[0] = embedding_route


# -- 2-d max pooling ----------------------------------------------------------------------------------


def _pool_settings(params: torch.Tensor) -> tuple[list[int], list[int], list[int], list[int], bool]:
    p = params.tolist()
    return p[0:2], p[2:4], p[4:6], p[6:8], bool(p[8])


#: the overload of MAX_POOL2D that pools a channels-last copy of its input
CHANNELS_LAST = "channels_last"
_POOL_LAYOUTS: dict[tuple[Any, ...], str] = {}


def pool_layout(input_shape: Sequence[int], settings: Sequence[int]) -> str:
    """The faster way for PyTorch to max-pool a contiguous (N, C, H, W) input of this shape:
    ``""`` (as is) or :data:`CHANNELS_LAST` (pool a channels-last copy, hand back contiguous
    results), timed once per shape and ``settings`` (kernel, stride, padding, dilation,
    ceil_mode, flat: the ATen node's parameter tensor) at the in-engine thread count.

    PyTorch's kernel for contiguous NCHW input walks one plane at a time; the channels-last
    one vectorises over channels. At (16, 16, 32, 32), one thread: 1417 us as is, 498 us with
    the copy in and out (297 us of it the copy). Both give the same values and indices (the
    same first-maximum-in-window rule, NaN taken as the maximum), so the choice changes no
    result; the backward stays on the NCHW kernel, which is the fast one there (58 us).
    """
    key = (tuple(input_shape), tuple(settings))
    with _LOCK:
        found = _POOL_LAYOUTS.get(key)
    if found is not None:
        return found
    found = ""
    if len(input_shape) == 4 and input_shape[1] > 1:
        _seeded()
        x = _randn(*input_shape)
        params = torch.tensor(list(settings))
        as_is = _torch_us(lambda: _max_pool2d("", [x, params]), 0)
        copied = _torch_us(lambda: _max_pool2d(CHANNELS_LAST, [x, params]), 0)
        found = CHANNELS_LAST if copied < as_is else ""
        logger.info(
            "kernel choice: max_pool2d on %s pools %s (as is %.0f us, channels-last copy %.0f us)",
            tuple(input_shape),
            "a channels-last copy" if found else "the input as is",
            as_is,
            copied,
        )
    with _LOCK:
        _POOL_LAYOUTS[key] = found
    return found


def _max_pool2d(overload: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    x, params = inputs
    assert x is not None and params is not None
    # whole, not in pieces (see aten/parallel.py)
    if overload == CHANNELS_LAST and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
        values, indices = torch.ops.aten.max_pool2d_with_indices(x, *_pool_settings(params))
        return [values.contiguous(), indices.contiguous()]
    values, indices = torch.ops.aten.max_pool2d_with_indices(x, *_pool_settings(params))
    return [values, indices]


def _max_pool2d_backward(
    _overload: str, inputs: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    grad, x, indices, params = inputs
    assert grad is not None and x is not None and indices is not None and params is not None
    return [
        torch.ops.aten.max_pool2d_with_indices_backward(grad, x, *_pool_settings(params), indices)
    ]


register_aten_function(MAX_POOL2D, AtenFunction(_max_pool2d, _all_tensors))
register_aten_function(MAX_POOL2D_BACKWARD, AtenFunction(_max_pool2d_backward, _all_tensors))
for _layout in ("", CHANNELS_LAST):  # the backward is the NCHW kernel either way
    register_aten_gradient(
        MAX_POOL2D,
        _layout,
        [GradientNode.aten(MAX_POOL2D_BACKWARD, ["GO(0)", "I(0)", "O(1)", "I(1)"], ["GI(0)"])],
    )
    register_stop_gradient_edges(MAX_POOL2D, _layout, [1])


def _max_pool2d_symbolic(with_indices: bool) -> Callable[..., Any]:
    def symbolic(
        default: Callable[..., Any],
        g: Any,
        x: Any,
        kernel: Any,
        stride: Any,
        padding: Any,
        dilation: Any,
        ceil_mode: Any,
    ) -> Any:
        args = (x, kernel, stride, padding, dilation, ceil_mode)
        dtype = _dtype(x)
        if dtype != "Float":
            return default(g, *args)
        try:
            k = _per_dim(sh._maybe_get_const(kernel, "is"), 2, 1)
            s = _per_dim(sh._maybe_get_const(stride, "is"), 2, 0)
            if not any(s):  # eager: an empty stride is the kernel
                s = list(k)
            p = _per_dim(sh._maybe_get_const(padding, "is"), 2, 0)
            d = _per_dim(sh._maybe_get_const(dilation, "is"), 2, 1)
            ceil = bool(sh._maybe_get_const(ceil_mode, "i"))
        except (TypeError, ValueError):
            return default(g, *args)
        traced = _traced(g)
        if traced is None or not traced.input_needs_grad:
            return default(g, *args)
        input_shape = traced.sizes[0] if traced.sizes else None
        op = f"max_pool2d(kernel={k},stride={s},padding={p},dilation={d},ceil_mode={int(ceil)})"
        if input_shape is None or len(input_shape) not in (3, 4):
            route = _decide(op, dtype, None, lambda: (0.0, math.inf))
        else:
            shape = tuple(input_shape)
            route = _decide(op, dtype, shape, lambda: measure_max_pool2d(shape, k, s, p, d, ceil))
        if route != "torch":
            return default(g, *args)
        settings = [*k, *s, *p, *d, int(ceil)]
        layout = pool_layout(tuple(input_shape), settings) if input_shape else ""
        params = _ints_const(g, settings)
        values, indices = g.op(
            f"{ATEN_DOMAIN}::ATen",
            x,
            params,
            operator_s=MAX_POOL2D,
            overload_name_s=layout,
            outputs=2,
        )
        rank = len(input_shape) if input_shape is not None else sh._get_tensor_rank(x) or 4
        sizes = sh._get_tensor_sizes(x) or [None] * rank
        spatial = [*sizes[:-2], None, None]  # the leading dims stay, the pooled ones are dynamic
        values.setType(x.type().with_sizes(spatial))
        indices.setType(x.type().with_sizes(spatial).with_dtype(torch.int64))
        return (values, indices) if with_indices else values

    return symbolic


def _no_previous(name: str) -> Callable[[], Callable[..., Any]]:
    def fallback() -> Callable[..., Any]:
        raise RuntimeError(f"kernel choice: no symbolic to fall back to for {name}")

    return fallback


register_kernel_choice(CoveredOperator("aten::gelu", _gelu_symbolic, _opset9("gelu")))
register_kernel_choice(CoveredOperator("aten::relu", _relu_symbolic, _opset9("relu")))
register_kernel_choice(
    CoveredOperator("aten::layer_norm", _layer_norm_symbolic, _opset9("layer_norm"), opset=17)
)
register_kernel_choice(
    CoveredOperator(
        "aten::cross_entropy_loss",
        _cross_entropy_symbolic,
        lambda: losses.cross_entropy_loss,
    )
)
register_kernel_choice(
    CoveredOperator("aten::_convolution", _convolution_symbolic, _default_convolution)
)
# the exporter's own max-pool symbolics (symbolics/pooling.py) are what the engine route uses
register_kernel_choice(
    CoveredOperator(
        "aten::max_pool2d", _max_pool2d_symbolic(False), _no_previous("aten::max_pool2d")
    )
)
register_kernel_choice(
    CoveredOperator(
        "aten::max_pool2d_with_indices",
        _max_pool2d_symbolic(True),
        _no_previous("aten::max_pool2d_with_indices"),
    )
)
