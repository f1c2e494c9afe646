"""Per-operator kernel choice: the engine's kernel or PyTorch's, whichever measured faster here.

Some engine CPU kernels are several times slower than PyTorch's (GELU's backward, ``GeluGrad``,
was 3.4x in the GPT profile). For such an operator the exporter can instead write an ATen node
that PyTorch runs inside the engine, forward and backward; that node pays a fixed cost for
crossing the engine boundary (about 45 us per node, ``benchmarks/bench_python_op.py``). Which
route wins depends on the machine and the tensor size, so it is decided by measurement: the
first export that meets the operator times both routes on this machine (a few milliseconds) and
keeps the answer for the process, per (operator, dtype, size class).

Export sizes are dynamic, so the size class is the one measured at :data:`CALIBRATION_NUMEL`
elements (an activation of the benchmark transformers, batch x sequence x hidden); operators
whose size is known at export use their own class.

``mode`` (``ORTMODULE_KERNEL_CHOICE``): ``auto`` measures, ``engine`` keeps every operator on
the engine's kernels, ``torch`` routes every covered operator to PyTorch.

>>> from ortmodule_exporter.aten.kernel_choice import configure_kernel_choice, decisions
>>> configure_kernel_choice("auto")
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.onnx import symbolic_helper as sh

from ..engine_binding import import_onnxruntime
from ..symbolics.registry import register_symbolic, registered_symbolics, unregister_symbolic
from .executor import ATEN_DOMAIN, AtenFunction, register_aten_function
from .gradients import GradientNode, register_aten_gradient

__all__ = [
    "ATEN_NODE_US",
    "CALIBRATION_NUMEL",
    "MODES",
    "choose",
    "configure_kernel_choice",
    "current_mode",
    "decisions",
    "measure_gelu",
]

logger = logging.getLogger("ortmodule.exporter")

MODES = ("auto", "engine", "torch")
#: what one ATen node costs beyond its kernel (forward, bench_python_op.py on the 2-core EPYC)
ATEN_NODE_US = 45.0
#: elements of the tensor the calibration times when the export does not know the size
CALIBRATION_NUMEL = 1 << 20

GELU = "_ortmodule_gelu"
GELU_BACKWARD = "_ortmodule_gelu_backward"

_LOCK = threading.Lock()
# nothing is rerouted until a caller (ORTModule, through ExportConfig) asks for it
_MODE = ["engine"]
#: (operator, dtype, size class) -> "engine" or "torch", with the timings that decided it
_DECISIONS: dict[tuple[str, str, int], tuple[str, float, float]] = {}
_PREVIOUS: dict[str, Any] = {}


def current_mode() -> str:
    """The mode :func:`configure_kernel_choice` set last (``engine`` until it is called)."""
    return _MODE[0]


def decisions() -> dict[tuple[str, str, int], tuple[str, float, float]]:
    """What was chosen so far: key -> (route, engine us, torch us incl. the ATen nodes)."""
    with _LOCK:
        return dict(_DECISIONS)


# -- the PyTorch side: our ATen functions and their gradient ----------------------------------------


def _gelu(approximate: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    (x,) = inputs
    assert x is not None
    return [F.gelu(x, approximate=approximate or "none")]


def _gelu_backward(
    approximate: str, inputs: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    grad, x = inputs
    assert grad is not None and x is not None
    return [torch.ops.aten.gelu_backward(grad, x, approximate=approximate or "none")]


def _all_tensors(_overload: str, _index: int, _is_input: bool) -> bool:
    return True


register_aten_function(GELU, AtenFunction(_gelu, _all_tensors))
register_aten_function(GELU_BACKWARD, AtenFunction(_gelu_backward, _all_tensors))
for _approximate in ("none", "tanh"):
    register_aten_gradient(
        GELU,
        _approximate,
        [GradientNode.aten(GELU_BACKWARD, ["GO(0)", "I(0)"], ["GI(0)"], overload=_approximate)],
    )


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


def measure_gelu(numel: int, approximate: str = "none") -> tuple[float, float]:
    """Microseconds of GELU forward + backward on ``numel`` float32 elements: (engine, torch).

    The engine side is its ``Gelu`` and ``GeluGrad`` kernels in one session (what the engine
    fuses an exported GELU into); the torch side adds the two ATen nodes' own cost.
    """
    import onnx
    from onnx import TensorProto, helper

    ort = import_onnxruntime()
    op = "Gelu" if approximate == "none" else "FastGelu"
    nodes = [
        helper.make_node(op, ["x"], ["y"], domain="com.microsoft"),
        helper.make_node(
            "GeluGrad" if approximate == "none" else "FastGeluGrad",
            ["dy", "x"],
            ["dx"],
            domain="com.microsoft",
        ),
    ]
    shape = [numel]
    graph = helper.make_graph(
        nodes,
        "gelu",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("dy", TensorProto.FLOAT, shape),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("dx", TensorProto.FLOAT, shape),
        ],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
        ir_version=8,
    )
    onnx.checker.check_model(model)
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=gen)
    dy = torch.randn(numel, generator=gen)
    feeds = {"x": x.numpy(), "dy": dy.numpy()}

    def engine() -> None:
        session.run(None, feeds)

    def torch_route() -> None:
        F.gelu(x, approximate=approximate)
        torch.ops.aten.gelu_backward(dy, x, approximate=approximate)

    engine_us = _best_us(engine)
    torch_us = _best_us(torch_route) + 2 * ATEN_NODE_US
    return engine_us, torch_us


def _size_class(numel: int) -> int:
    return 1 << max(0, round(math.log2(max(numel, 1))))


def choose(
    op: str, dtype: str, numel: int | None, measure: Callable[[int], tuple[float, float]]
) -> str:
    """``"engine"`` or ``"torch"`` for ``op`` on tensors of ``numel`` elements (None: unknown)."""
    mode = _MODE[0]
    if mode != "auto":
        return mode
    size = _size_class(numel if numel is not None else CALIBRATION_NUMEL)
    key = (op, dtype, size)
    with _LOCK:
        found = _DECISIONS.get(key)
    if found is None:
        try:
            engine_us, torch_us = measure(size)
        except Exception as err:  # noqa: BLE001 - no measurement: keep the engine's kernel
            logger.info("kernel choice: could not time %s (%s); using the engine's kernel", op, err)
            engine_us, torch_us = 0.0, math.inf
        route = "torch" if torch_us < engine_us else "engine"
        found = (route, engine_us, torch_us)
        with _LOCK:
            _DECISIONS[key] = found
        logger.info(
            "kernel choice: %s %s on %d elements runs on %s (engine %.0f us, PyTorch %.0f us "
            "with its ATen nodes)",
            op,
            dtype,
            size,
            route,
            engine_us,
            torch_us,
        )
    return found[0]


# -- the symbolic --------------------------------------------------------------------------------------


def _numel(value: Any) -> int | None:
    try:
        sizes = value.type().sizes()
    except (AttributeError, RuntimeError):
        return None
    if sizes is None or any(s is None for s in sizes):
        return None
    return math.prod(sizes)


def _gelu_symbolic(g: Any, self: Any, approximate: Any = None) -> Any:
    from torch.onnx._internal.torchscript_exporter import symbolic_opset9

    approx = "none" if approximate is None else sh._maybe_get_const(approximate, "s")
    dtype = self.type().scalarType() if hasattr(self.type(), "scalarType") else None
    previous = _PREVIOUS.get("aten::gelu")

    def default(g: Any, self: Any, approximate: Any) -> Any:
        # the symbolic we replaced, where it applies at this export's opset
        if previous is not None and g.opset >= previous.opset:
            return previous.fn(g, self, approximate)
        return symbolic_opset9.gelu(g, self, approximate)

    if approx not in ("none", "tanh") or dtype != "Float":
        return default(g, self, approximate)
    numel = _numel(self)
    route = choose(f"gelu({approx})", dtype, numel, lambda n: measure_gelu(n, approximate=approx))
    if route != "torch":
        return default(g, self, approximate)
    out = g.op(f"{ATEN_DOMAIN}::ATen", self, operator_s=GELU, overload_name_s=approx, outputs=1)
    out.setType(self.type())
    return out


def configure_kernel_choice(mode: str = "auto") -> None:
    """Install the kernel-choice symbolics (``auto``/``torch``) or remove them (``engine``)."""
    if mode not in MODES:
        raise ValueError(f"kernel choice mode must be one of {MODES}, got {mode!r}")
    _MODE[0] = mode
    current = registered_symbolics().get("aten::gelu")
    if mode == "engine":
        if current is not None and current.fn is _gelu_symbolic:
            previous = _PREVIOUS.pop("aten::gelu", None)
            if previous is not None:
                register_symbolic("aten::gelu", previous.fn, previous.opset)
            else:
                unregister_symbolic("aten::gelu")
        return
    if current is not None and current.fn is not _gelu_symbolic:
        _PREVIOUS["aten::gelu"] = current
    register_symbolic("aten::gelu", _gelu_symbolic, 9)
