"""Keep ``detach()`` and ``torch.no_grad()`` inside a traced forward: cut the gradient there.

ONNX has no notion of a value that does not require grad: PyTorch's exporter erases
``aten::detach`` and records the ops of a ``with torch.no_grad():`` block like any other, and the
engine differentiates every path from a trainable input to the loss. Without a cut, the gradient
flows through ``h.detach()`` and through a recurrence whose first steps run under ``no_grad``
(the Hierarchical Reasoning Model's ``L_bp_cycles``): a silently wrong gradient.

The trace says which ops ran with grad disabled: while it runs, each switch of grad mode from
Python (``torch.no_grad()``, ``torch.set_grad_enabled``, ``@torch.no_grad()``) is noted with the
mark node in the trace. (The value types the tracer records are not enough: it records
``aten::_convolution`` below autograd, so a convolution's result never requires grad there.)
Before torch.onnx lowers the traced graph, :func:`cut_gradients` works out which values require
grad as eager's autograd does (an op run with grad enabled, other than ``detach``, requires grad
when an input does), finds each place where a value that does *not* require grad, but was
computed from a trainable input, is read by an op whose result does, and routes that read
through ``ortmodule::stop_gradient``, which exports as the value itself with no gradient path
back (the ``BatchNormalization`` trick of ``symbolics.helpers._stop_gradient`` for float32 and
float16, a copy in an ATen node whose input the engine never differentiates for the other
types). Exactly these reads carry gradient in the engine's graph and none in eager's.

>>> with cutting_gradients():           # the exporter does this around torch.onnx.export
...     torch.onnx.export(module, ...)
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch

from ..aten.executor import ATEN_DOMAIN
from ..aten.stop_gradient import STOP_GRADIENT as ATEN_STOP_GRADIENT
from ..symbolics.helpers import Value, _stop_gradient
from ..symbolics.registry import register_symbolic
from .lowering_hooks import before_lowering

__all__ = [
    "DETACHING_OPERATORS",
    "STOP_GRADIENT",
    "VALUE_FREE_OPERATORS",
    "cut_gradients",
    "cutting_gradients",
    "plain_grad_switch",
]

#: the marker op the cut inserts into the traced graph
STOP_GRADIENT = "ortmodule::stop_gradient"

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# ops whose result depends on the input's shape, dtype or device only, never on its values:
# their result carries no gradient path even when they read a trainable tensor
VALUE_FREE_OPERATORS = frozenset(
    f"aten::{name}"
    for name in (
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_zeros",
        "new_ones",
        "new_empty",
        "new_full",
        "new_tensor",
        "size",
        "numel",
        "dim",
    )
)

_LIB = torch.library.Library("ortmodule", "FRAGMENT")
_LIB.define("stop_gradient(Tensor x) -> Tensor")


def _stop_gradient_eager(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone()


_LIB.impl("stop_gradient", _stop_gradient_eager, "CompositeExplicitAutograd")


def _stop_gradient_symbolic(g: Any, x: Value) -> Value:
    if x.type().scalarType() in ("Float", "Half"):
        return _stop_gradient(g, x)
    # the engine's BatchNormalization has no CPU kernel for these types
    out = g.op(f"{ATEN_DOMAIN}::ATen", x, operator_s=ATEN_STOP_GRADIENT, outputs=1)
    out.setType(x.type())
    return out


register_symbolic(STOP_GRADIENT, _stop_gradient_symbolic)


def _tensor_type(v: Any) -> Any:
    t = v.type()
    return t if isinstance(t, torch._C.TensorType) else None


def _requires_grad(v: Any) -> bool:
    t = _tensor_type(v)
    return t is not None and bool(t.requires_grad())


def _is_float(v: Any) -> bool:
    t = _tensor_type(v)
    return t is not None and t.dtype() in _FLOAT


def _carries(v: Any) -> bool:
    """A float tensor, or a list or tuple holding tensors (``torch.stack`` of a loop's steps
    reads a ``prim::ListConstruct``; ``split`` writes a list that ``prim::ListUnpack`` reads):
    what requires grad and what depends on a trainable input passes through them too. Without
    this, ``torch.stack(steps).detach()`` was not cut (the stack lost track of the parameter)
    and the engine's gradient was twice eager's (fuzz seed 42939)."""
    if _is_float(v):
        return True
    t = v.type()
    if isinstance(t, torch._C.ListType):
        return isinstance(t.getElementType(), torch._C.TensorType)
    if isinstance(t, torch._C.TupleType):
        return any(isinstance(e, torch._C.TensorType) for e in t.elements())
    return False


#: ops whose result never requires grad, whatever the grad mode
DETACHING_OPERATORS = frozenset({"aten::detach", "aten::detach_"})


#: the text of the grad-mode marks written into the trace
_MARK = "ortmodule:grad_enabled="


def _mark_mode(node: Any) -> bool | None:
    """The grad mode a mark node sets, None for other nodes."""
    if node.kind() != "prim::Print" or node.inputsSize() != 1:
        return None
    text = node.input().toIValue() if node.input().node().kind() == "prim::Constant" else None
    if not isinstance(text, str) or not text.startswith(_MARK):
        return None
    return text == _MARK + "1"


def cut_gradients(graph: torch._C.Graph, grad_enabled: bool = True) -> int:
    """Insert a stop-gradient on each read of a value that does not require grad but depends
    on a trainable graph input, by an op whose result requires grad; remove the grad-mode
    marks. ``grad_enabled``: the mode the trace began in. Returns the number of values cut."""
    trainable: set[Any] = {v for v in graph.inputs() if _requires_grad(v)}
    requires_grad: set[Any] = set(trainable)
    mode = grad_enabled
    cuts: dict[Any, Any] = {}
    for node in list(graph.nodes()):
        marked = _mark_mode(node)
        if marked is not None:
            mode = marked
            text = node.input().node()
            node.destroy()
            if not text.output().uses():
                text.destroy()
            continue
        inputs = list(node.inputs())
        outputs_grad = (
            mode
            and node.kind() not in DETACHING_OPERATORS
            and any(v in requires_grad for v in inputs)
            and any(_carries(o) for o in node.outputs())
        )
        # an in-place op under no_grad on a tensor that requires grad (``var.clamp_(min=eps)``
        # in gaussian_nll_loss): the tensor still requires grad in eager, with the op outside
        # its graph. Not cut: the engine differentiates through the op (as before cuts
        # existed), which differs from eager only where the op changed a value
        in_place = (
            not mode
            and node.kind().endswith("_")
            and not node.kind().endswith("__")
            and bool(inputs)
            and inputs[0] in requires_grad
        )
        if in_place:
            requires_grad.update(o for o in node.outputs() if _carries(o))
        if not mode and any(v in requires_grad for v in inputs):
            # an op that handed back its input tensor itself under no_grad (``h.to(h.dtype)``,
            # ``h.float()`` of a float32 ``h``, ``h.contiguous()`` of a contiguous one): eager's
            # result *is* ``h`` and still requires grad, and the tracer now gives ``h``'s later
            # reads this output. The tracer records the tensor's own flag on it; under no_grad
            # only such a returned input has it set. Without this, a read of ``h`` after the
            # block was cut (a wrong gradient, or none at all)
            requires_grad.update(o for o in node.outputs() if _is_float(o) and _requires_grad(o))
        if outputs_grad:
            requires_grad.update(o for o in node.outputs() if _carries(o))
            for i, v in enumerate(inputs):
                if v not in trainable or v in requires_grad or not _is_float(v):
                    continue
                cut = cuts.get(v)
                if cut is None:
                    made = graph.create(STOP_GRADIENT, [v], 1)
                    made.insertBefore(node)
                    made.output().setType(v.type())
                    cut = cuts[v] = made.output()
                node.replaceInput(i, cut)
        if node.kind() not in VALUE_FREE_OPERATORS and any(v in trainable for v in inputs):
            trainable.update(o for o in node.outputs() if _carries(o))
    if _marks_in_blocks(graph.nodes()):
        raise RuntimeError(
            "ORTModule cannot tell where the traced forward switched grad mode "
            "(torch.no_grad / set_grad_enabled inside a scripted or control-flow block); "
            "move the switch out of it"
        )
    return len(cuts)


def _marks_in_blocks(nodes: Any) -> bool:
    """Whether a grad-mode mark sits inside a block of one of ``nodes`` (at any depth)."""
    for node in nodes:
        for block in node.blocks():
            for inner in block.nodes():
                if _mark_mode(inner) is not None or _marks_in_blocks([inner]):
                    return True
    return False


class _Recording(threading.local):
    active: bool = False
    grad_enabled: bool = True


_RECORDING = _Recording()


def _record_switch(set_grad_enabled: Any) -> Any:
    @functools.wraps(set_grad_enabled)
    def switch(mode: bool) -> Any:
        state = torch._C._get_tracing_state() if _RECORDING.active else None
        if state is not None:
            # a node with a side effect, so that the tracer's clean-up keeps it in place;
            # cut_gradients reads and removes it
            graph = state.graph()
            text = graph.insertConstant(f"{_MARK}{int(bool(mode))}")  # type: ignore[attr-defined]
            graph.insertNode(graph.create("prim::Print", [text], 0))
        return set_grad_enabled(mode)

    return switch


class _GradSwitchGate:
    """Who may see ``torch._C._set_grad_enabled`` as what: TorchScript traces need the recorder
    (:func:`_record_switch`) in its place; torch.export needs PyTorch's own function there, as
    its pre-dispatch tracer compares the function it intercepts against that attribute by
    identity (``func is torch._C._set_grad_enabled``), and with the recorder in place it neither
    switched grad mode nor kept the no-grad region: the engine then differentiated through a
    ``torch.no_grad()`` block (twice eager's gradient) once any TorchScript export had run in
    the process. The recorder is installed only while TorchScript traces run, and the two kinds
    of export wait for each other."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._counts = {"record": 0, "plain": 0}
        self._original = torch._C._set_grad_enabled
        self._recorder = _record_switch(self._original)

    @contextlib.contextmanager
    def entered(self, group: str) -> Iterator[None]:
        other = "plain" if group == "record" else "record"
        with self._condition:
            while self._counts[other]:
                self._condition.wait()
            self._counts[group] += 1
            if group == "record" and self._counts[group] == 1:
                torch._C._set_grad_enabled = self._recorder
        try:
            yield
        finally:
            with self._condition:
                self._counts[group] -= 1
                if group == "record" and self._counts[group] == 0:
                    torch._C._set_grad_enabled = self._original
                self._condition.notify_all()


_GATE = _GradSwitchGate()


@contextlib.contextmanager
def plain_grad_switch() -> Iterator[None]:
    """PyTorch's own ``torch._C._set_grad_enabled`` while the block runs (torch.export's
    trace), after any TorchScript trace recording grad switches has finished."""
    with _GATE.entered("plain"):
        yield


def _cut(graph: torch._C.Graph) -> None:
    if _RECORDING.active:
        cut_gradients(graph, _RECORDING.grad_enabled)


@contextlib.contextmanager
def cutting_gradients() -> Iterator[None]:
    """Cut the gradient where the traced forward detached a value or ran under ``no_grad``."""
    saved = _RECORDING.active, _RECORDING.grad_enabled
    with _GATE.entered("record"):
        _RECORDING.active, _RECORDING.grad_enabled = True, torch.is_grad_enabled()
        try:
            with before_lowering(_cut, "honour detach() and torch.no_grad() inside a forward"):
                yield
        finally:
            _RECORDING.active, _RECORDING.grad_enabled = saved
