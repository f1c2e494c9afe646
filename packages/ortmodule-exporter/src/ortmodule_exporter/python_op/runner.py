"""Run a Function's ``forward`` and ``backward`` when the engine meets its PythonOp nodes.

The engine calls two native callbacks, a forward runner for ``PythonOp`` and a backward runner
for ``PythonOpGrad``. Ours are ``ctypes`` callbacks (nothing compiled): they turn the engine's
DLPack tensors into torch tensors without copies, call the user's code in PyTorch and hand the
results back the same way.

>>> from ortmodule_exporter.python_op import runner as python_op_runner
>>> python_op_runner.install()           # once per process; ORTModule does it for you
>>> python_op_runner.live_contexts()     # forward calls still waiting for their backward
0

The context a Function sees is a :class:`torch.autograd.function.FunctionCtx` with the usual
API: ``save_for_backward``/``saved_tensors``, ``needs_input_grad``, ``mark_dirty``,
``mark_non_differentiable``, ``set_materialize_grads`` and any attribute the Function sets.
It lives from the forward call until its backward has run, then it is released.

A Function that raises inside the engine: the engine only sees a failed node, so the exception
is kept and :func:`user_errors` raises it (with the user's traceback and a note naming the
Function) in place of the engine's error (see :mod:`ortmodule_exporter.callback_errors`).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.function import Function, FunctionCtx, _SingleLevelFunction

from .. import dlpack_bridge as bridge
from ..callback_errors import remember, take_pending_error, user_errors
from ..engine_binding import _C
from .registry import REGISTRY, FunctionEntry, _EngineStub

__all__ = [
    "RELEASE_EVERY",
    "RunContexts",
    "engine_context_releases",
    "install",
    "installed",
    "kept_by_run",
    "kernel_count",
    "live_contexts",
    "protective_copies",
    "release_abandoned_contexts",
    "release_engine_contexts",
    "in_engine",
    "take_pending_error",
    "user_errors",
]

logger = logging.getLogger("ortmodule.exporter")

# std::vector<PyObject*> runner(const char* func_name, void* callback,
#     const std::vector<int64_t>& requires_grad_flags, const std::vector<int64_t>& tensor_type_flags,
#     bool is_training_mode, const std::vector<int64_t>& inplace_map, const char* kernel_invoke_id,
#     bool safe_run_mode, const std::vector<PyObject*>& args)
# The by-value vector travels through a hidden first pointer (see dlpack_bridge), returned again.
_RUNNER = ctypes.CFUNCTYPE(
    ctypes.c_void_p,  # the result vector's address, returned as the ABI requires
    ctypes.c_void_p,  # where to construct the result vector
    ctypes.c_char_p,  # func_name
    ctypes.c_void_p,  # callback (the engine's copy of the Function; unused, see registry._EngineStub)
    ctypes.c_void_p,  # requires_grad_flags
    ctypes.c_void_p,  # tensor_type_flags
    ctypes.c_bool,  # is_training_mode
    ctypes.c_void_p,  # inplace_map
    ctypes.c_char_p,  # kernel_invoke_id
    ctypes.c_bool,  # safe_run_mode
    ctypes.c_void_p,  # args
)


# -- the context ----------------------------------------------------------------------------------


class _TensorMeta:
    """What backward needs to know of a forward tensor (a plain class: made on every call)."""

    __slots__ = ("device", "dtype", "non_differentiable", "requires_grad", "shape")

    def __init__(
        self, tensor: torch.Tensor, requires_grad: bool = False, non_differentiable: bool = False
    ) -> None:
        self.shape = tensor.shape
        self.dtype = tensor.dtype
        self.device = tensor.device
        self.requires_grad = requires_grad
        self.non_differentiable = non_differentiable

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)


@dataclass
class _CallState:
    entry: FunctionEntry
    #: per forward argument: the tensor's metadata, None for a non-tensor (or None) argument
    inputs: list[_TensorMeta | None]
    #: per forward output: the tensor's metadata, None for a non-tensor output
    outputs: list[_TensorMeta | None] = field(default_factory=list)
    released: bool = False


class _Context(FunctionCtx):
    """The ``ctx`` of one forward call run by the engine (what ``Function.apply`` would create)."""

    def __init__(self, state: _CallState, needs_input_grad: tuple[bool, ...]) -> None:
        self._ortmodule_call = state
        self.needs_input_grad = needs_input_grad
        self.materialize_grads = True
        self.to_save: tuple[Any, ...] = ()
        self.dirty_tensors: tuple[Any, ...] = ()
        self.non_differentiable: tuple[Any, ...] = ()

    @property
    def saved_tensors(self) -> tuple[Any, ...]:
        if self._ortmodule_call.released:
            raise RuntimeError(
                f"{self._ortmodule_call.entry.name}: the saved tensors were released after its "
                "backward ran; backward runs once per forward."
            )
        return tuple(self.to_save)

    saved_variables = saved_tensors

    def __repr__(self) -> str:
        return f"<ORTModule PythonOp context of {self._ortmodule_call.entry.name}>"


#: contexts whose forward ran and whose backward has not: id -> context
_LIVE: dict[int, _Context] = {}
#: reentrant: a RunContexts dropped by the garbage collector inside a locked block takes it too
_LIVE_LOCK = threading.RLock()
#: the RunContexts of the engine forward running in this thread
_RUN = threading.local()
#: forwards whose contexts were dropped without a backward since the engine's pool was emptied
_ABANDONED = [0]


class RunContexts:
    """The contexts the PythonOp calls of one engine forward kept for their backward.

    The forward's state holds it. Dropped without a backward (a loss never backpropagated, an
    exception between forward and backward), it takes its contexts out of the pending ones, as
    autograd frees a Function's saved tensors with its graph; the engine's pool, which holds
    them too, is emptied at the next forward where none is pending
    (:func:`release_abandoned_contexts`). Before, each such forward kept its Functions' saved
    tensors for the life of the process.
    """

    __slots__ = ("kept",)

    def __init__(self) -> None:
        self.kept: list[_Context] = []

    def __del__(self) -> None:
        dropped = False
        with _LIVE_LOCK:
            for ctx in self.kept:
                if _LIVE.get(id(ctx)) is ctx:
                    del _LIVE[id(ctx)]
                    dropped = True
            if dropped:
                _ABANDONED[0] += 1
        # the contexts go now, not when this object's memory does: without this line the
        # saved tensors of a dropped forward outlived the engine pool's release in the test
        self.kept = []


@contextmanager
def kept_by_run() -> Iterator[RunContexts]:
    """Collect the contexts one engine forward in this thread keeps (``with kept_by_run() as
    kept: run_forward(...)``)."""
    previous = getattr(_RUN, "current", None)
    _RUN.current = kept = RunContexts()
    try:
        yield kept
    finally:
        _RUN.current = previous


def release_abandoned_contexts() -> bool:
    """Empty the engine's pool of the contexts of forwards dropped without a backward, where
    none is pending now (call it outside engine runs); whether it did."""
    if not _ABANDONED[0]:
        return False
    released = release_engine_contexts()
    if released:
        _ABANDONED[0] = 0
    return released


def live_contexts() -> int:
    """How many forward calls still hold a context for their backward."""
    with _LIVE_LOCK:
        return len(_LIVE)


# -- per-kernel facts learnt on the first call ------------------------------------------------------


@dataclass
class _KernelState:
    seen: bool = False
    #: argument positions to copy before forward because the Function writes them in place or
    #: keeps them for backward
    clone: frozenset[int] = frozenset()


_KERNELS: OrderedDict[bytes, _KernelState] = OrderedDict()
_MAX_KERNELS = 4096


def _kernel(invoke_id: bytes) -> _KernelState:
    state = _KERNELS.get(invoke_id)
    if state is None:
        state = _KERNELS[invoke_id] = _KernelState()
        while len(_KERNELS) > _MAX_KERNELS:
            _KERNELS.popitem(last=False)
    return state


def kernel_count() -> int:
    return len(_KERNELS)


# -- tensors the context keeps for backward ------------------------------------------------------------

#: The engine does not know that PyTorch still holds some of its buffers after a PythonOp ran:
#: its planner lets an elementwise node write its result into its input's buffer once nothing
#: else in the graph reads that input. So memory the Function keeps for backward (saved tensors,
#: tensors set as ``ctx`` attributes, views of either) must never be a buffer the engine owns:
#: an argument the Function keeps is copied before forward (learnt on the first call, which
#: copies every argument), and an output it keeps (or one aliasing an engine buffer or an
#: earlier output) is handed to the engine as a copy. Nothing else is copied.
_PROTECTIVE_COPIES = [0]
_CTX_FIELDS = frozenset(
    {
        "_ortmodule_call",
        "needs_input_grad",
        "materialize_grads",
        "to_save",
        "dirty_tensors",
        "non_differentiable",
    }
)


def protective_copies() -> int:
    """How many tensors the runners copied so far to keep a Function's saved tensors intact."""
    return _PROTECTIVE_COPIES[0]


def _storage(tensor: torch.Tensor) -> int | None:
    if tensor.numel() == 0:
        return None
    return int(tensor.untyped_storage().data_ptr())


def _add_storages(value: Any, into: set[int]) -> None:
    if isinstance(value, torch.Tensor):
        storage = _storage(value)
        if storage is not None:
            into.add(storage)
    elif isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, (torch.Tensor, tuple, list)):
                _add_storages(item, into)


def _kept_storages(ctx: _Context) -> set[int]:
    """The storages of every tensor ``ctx`` keeps for backward (saved or set as attributes)."""
    kept: set[int] = set()
    _add_storages(tuple(ctx.to_save), kept)
    for name, value in vars(ctx).items():
        if name not in _CTX_FIELDS:
            _add_storages(value, kept)
    return kept


# -- forward ----------------------------------------------------------------------------------------


def _calls_setup_context(cls: type) -> bool:
    return (
        getattr(cls, "setup_context", _SingleLevelFunction.setup_context)
        is not _SingleLevelFunction.setup_context
    )


def _backward_fn(cls: Any) -> Any:
    backward, vjp = cls.backward, cls.vjp
    if backward is not Function.backward and vjp is not Function.vjp:
        raise RuntimeError(
            f"{cls.__qualname__} implements both backward and vjp; implement one of them"
        )
    return vjp if vjp is not Function.vjp else backward


def run_forward(
    func_name: str,
    requires_grad: Sequence[int],
    tensor_flags: Sequence[int],
    training: bool,
    invoke_id: bytes,
    raw_args: Sequence[Any],
) -> list[Any]:
    """The forward of one PythonOp call: ``[ctx or None, output capsule or None, ...]``."""
    entry = REGISTRY.lookup(func_name)
    cls: Any = entry.cls
    kernel = _kernel(invoke_id)
    args: list[Any] = []
    fed: dict[int, torch.Tensor] = {}
    cloned: set[int] = set()
    needs: list[bool] = []
    for position, (obj, is_tensor) in enumerate(zip(raw_args, tensor_flags, strict=True)):
        if not is_tensor or obj is None:
            args.append(obj)
            needs.append(False)
            continue
        tensor = bridge.tensor_from_capsule(obj)
        if position in entry.bool_inputs and tensor.dtype == torch.uint8:
            tensor = tensor.view(torch.bool)
        # the engine's buffer may feed other nodes, or be reused once the node ran: a Function
        # that writes an argument in place or keeps it for backward gets a copy (every argument
        # on the first call, then the ones it wrote or kept)
        if not kernel.seen or position in kernel.clone:
            tensor = tensor.clone()
            cloned.add(position)
            if kernel.seen:
                _PROTECTIVE_COPIES[0] += 1
        wants = bool(
            training
            and requires_grad[position]
            and (tensor.is_floating_point() or tensor.is_complex())
        )
        if wants:
            tensor.requires_grad_(True)
        fed[position] = tensor
        args.append(tensor)
        needs.append(wants)
    versions = {position: t._version for position, t in fed.items()}
    keep = training and any(needs)

    state = _CallState(entry, [])
    if keep:
        state.inputs = [
            _TensorMeta(fed[i], requires_grad=needs[i]) if i in fed else None
            for i in range(len(args))
        ]
    ctx = _Context(state, tuple(needs))
    with torch.no_grad():
        if _calls_setup_context(cls):
            result = cls.forward(*args)
            cls.setup_context(ctx, tuple(args), result)
        else:
            result = cls.forward(ctx, *args)

    written = {position for position, t in fed.items() if t._version != versions[position]}
    if ctx.dirty_tensors:
        dirty = {id(t) for t in ctx.dirty_tensors}
        written |= {position for position, t in fed.items() if id(t) in dirty}
    if written - cloned:
        raise RuntimeError(
            f"{entry.name}.forward wrote argument(s) {sorted(written - cloned)} in place on this "
            "call but not on its first call, so the engine's buffer was changed. A Function run "
            "by ORTModule must write the same arguments in place (mark_dirty) on every call."
        )
    kept = _kept_storages(ctx) if keep else set()
    saved = {position for position, t in fed.items() if _storage(t) in kept}
    if saved - cloned:
        raise RuntimeError(
            f"{entry.name}.forward kept argument(s) {sorted(saved - cloned)} for backward on "
            "this call but not on its first call; the engine may reuse their buffers before "
            "backward runs. A Function run by ORTModule must save the same arguments on every call."
        )
    if not kernel.seen:
        kernel.clone = frozenset(written | saved)
        kernel.seen = True

    outputs = result if isinstance(result, tuple) else (result,)
    non_differentiable = (
        {id(t) for t in ctx.non_differentiable} if ctx.non_differentiable else set()
    )
    taken = kept | {
        storage
        for position, t in fed.items()
        if position not in cloned and (storage := _storage(t)) is not None
    }
    returned: list[Any] = []
    for out in outputs:
        if not isinstance(out, torch.Tensor):
            state.outputs.append(None)
            returned.append(None)
            continue
        if keep:
            state.outputs.append(_TensorMeta(out, non_differentiable=id(out) in non_differentiable))
        value = out.detach()
        storage = _storage(value)
        if storage is not None and storage in taken:
            # the engine may write this output's buffer in place (an elementwise consumer reuses
            # it): it must not be memory that backward reads or that another engine value owns
            value = value.clone()
            _PROTECTIVE_COPIES[0] += 1
        elif storage is not None:
            taken.add(storage)
        if value.dtype == torch.bool:  # the engine imports bool as uint8 (declared so at export)
            value = value.view(torch.uint8)
        if not value.numel():
            # PyTorch calls any empty tensor contiguous, the engine checks its strides
            value = torch.empty(value.shape, dtype=value.dtype, device=value.device)
        elif not value.is_contiguous():
            value = value.contiguous()
        returned.append(bridge.tensor_to_capsule(value))

    if keep:
        with _LIVE_LOCK:
            _LIVE[id(ctx)] = ctx
        run = getattr(_RUN, "current", None)
        if run is not None:
            run.kept.append(ctx)
    else:
        _contextless_call()
    return [ctx if keep else None, *returned]


# -- the engine's entries for calls without a context ------------------------------------------------

#: The engine files every PythonOp call's context under a new id and drops it only when the
#: PythonOpGrad node runs; calls that need no backward (eval, no_grad) leave an entry holding
#: None behind (~100 bytes each). Every this many such calls, when no forward is waiting for its
#: backward and no other thread is inside an engine call, the entries are dropped.
RELEASE_EVERY = 8192
_CONTEXTLESS = [0]
_RELEASES = [0]


def _contextless_call() -> None:
    _CONTEXTLESS[0] += 1
    if _CONTEXTLESS[0] >= RELEASE_EVERY:
        release_engine_contexts()


#: engine calls under way, in every thread (:func:`in_engine`)
_IN_ENGINE = [0]
#: how deep this thread is in engine calls (a PythonOp's call runs inside its thread's)
_IN_ENGINE_HERE = threading.local()


@contextmanager
def in_engine() -> Iterator[None]:
    """Around each engine call: while another thread is inside one, the engine's context pool
    is not emptied (a PythonOp there may have filed a context the pool still holds)."""
    with _LIVE_LOCK:
        _IN_ENGINE[0] += 1
    _IN_ENGINE_HERE.depth = getattr(_IN_ENGINE_HERE, "depth", 0) + 1
    try:
        yield
    finally:
        _IN_ENGINE_HERE.depth -= 1
        with _LIVE_LOCK:
            _IN_ENGINE[0] -= 1


def release_engine_contexts() -> bool:
    """Drop the engine's context entries when none is pending and no other thread is inside
    an engine call; returns whether it did. Threads that never enter the engine (a progress
    bar's monitor, a data loader's) do not hold it back: counting every live thread, as
    before, kept a dropped forward's saved tensors for good once one such thread lived."""
    with _LIVE_LOCK:
        if _LIVE or _IN_ENGINE[0] - getattr(_IN_ENGINE_HERE, "depth", 0):
            return False
        C = _C()
        C.unregister_python_functions()  # drops the contexts and the function pool together
        for name in REGISTRY.names():
            C.register_torch_autograd_function(name, _EngineStub)
        _CONTEXTLESS[0] = 0
        _RELEASES[0] += 1
    return True


def engine_context_releases() -> int:
    return _RELEASES[0]


# -- backward ---------------------------------------------------------------------------------------


def _fit(grad: torch.Tensor, meta: _TensorMeta, name: str, position: int) -> torch.Tensor:
    if grad.shape != meta.shape:
        try:
            grad = grad.sum_to_size(meta.shape)
        except RuntimeError:
            raise RuntimeError(
                f"{name}.backward returned a gradient of shape {tuple(grad.shape)} for argument "
                f"{position}, whose shape is {tuple(meta.shape)}"
            ) from None
    if grad.dtype != meta.dtype:
        grad = grad.to(meta.dtype)
    grad = grad.detach()
    return grad if grad.is_contiguous() else grad.contiguous()


def run_backward(func_name: str, raw_args: Sequence[Any]) -> list[Any]:
    """The backward of one PythonOp call: one capsule or None per forward argument."""
    ctx = raw_args[0]
    entry = REGISTRY.lookup(func_name)
    with _LIVE_LOCK:
        live = _LIVE.pop(id(ctx), None) if isinstance(ctx, _Context) else None
    if not isinstance(ctx, _Context) or live is not ctx:
        raise RuntimeError(f"{entry.name}: backward ran without a pending forward (or ran twice)")
    state: _CallState = ctx._ortmodule_call
    if len(raw_args) - 1 != len(state.outputs):
        raise RuntimeError(
            f"{entry.name}: the engine passed {len(raw_args) - 1} output gradients for "
            f"{len(state.outputs)} outputs"
        )
    grads: list[Any] = []
    for obj, meta in zip(raw_args[1:], state.outputs, strict=True):
        if meta is None:
            grads.append(None)
            continue
        grad = None if obj is None or meta.non_differentiable else bridge.tensor_from_capsule(obj)
        if grad is None and ctx.materialize_grads:
            grad = meta.zeros()
        grads.append(grad)

    backward = _backward_fn(entry.cls)
    try:
        with torch.no_grad():
            if getattr(entry.cls, "boxed_grads_call", False):
                result = backward(ctx, list(grads))
            else:
                result = backward(ctx, *grads)
    finally:
        state.released = True
        ctx.to_save = ()
    del grads
    result = result if isinstance(result, tuple) else (result,)
    count = len(state.inputs)
    if len(result) < count or any(r is not None for r in result[count:]):
        raise RuntimeError(
            f"{entry.name}.backward returned {len(result)} gradients; it must return one per "
            f"forward argument ({count})"
        )
    returned: list[Any] = []
    for position, (grad, meta) in enumerate(zip(result[:count], state.inputs, strict=True)):
        if meta is None:
            if isinstance(grad, torch.Tensor):
                raise RuntimeError(
                    f"{entry.name}.backward returned a gradient for argument {position}, which is not a tensor"
                )
            returned.append(None)
            continue
        if grad is None:
            # the engine adds this gradient into others: give it zeros rather than nothing
            returned.append(bridge.tensor_to_capsule(meta.zeros()) if meta.requires_grad else None)
            continue
        returned.append(bridge.tensor_to_capsule(_fit(grad, meta, entry.name, position)))
    return returned


# -- the native callbacks ---------------------------------------------------------------------------


def _name(raw: bytes | None) -> str:
    return (raw or b"").decode("utf-8", "replace")


def _serve(
    result: int, func_name: bytes, args: int, phase: str, run: Callable[[str, list[Any]], list[Any]]
) -> int:
    """One engine callback: read the arguments, ``run(name, objects)``, write what it returns.

    An exception never unwinds through the engine: it is remembered (re-raised to the user when
    the engine call fails) and an empty result makes the engine fail the node cleanly.
    """
    name = _name(func_name)
    try:
        objects = [
            bridge.object_from_pointer(p) if p else None for p in bridge.read_pointer_vector(args)
        ]
        values = run(name, objects)
        del objects
    except BaseException as err:  # noqa: BLE001 - must not unwind through the engine
        remember(
            err,
            f"raised in {name}.{phase}, a torch.autograd.Function that ONNX Runtime ran as a PythonOp",
        )
        values = []
    bridge.write_object_vector(result, values)
    return result


def _forward_entry(
    result: int,
    func_name: bytes,
    _callback: int,
    requires_grad: int,
    tensor_flags: int,
    training: bool,
    _inplace: int,
    invoke_id: bytes,
    _safe: bool,
    args: int,
) -> int:
    def run(name: str, objects: list[Any]) -> list[Any]:
        return run_forward(
            name,
            bridge.read_int64_vector(requires_grad),
            bridge.read_int64_vector(tensor_flags),
            bool(training),
            invoke_id or b"",
            objects,
        )

    return _serve(result, func_name, args, "forward", run)


def _backward_entry(
    result: int,
    func_name: bytes,
    _callback: int,
    _requires_grad: int,
    _tensor_flags: int,
    _training: bool,
    _inplace: int,
    _invoke_id: bytes,
    _safe: bool,
    args: int,
) -> int:
    return _serve(result, func_name, args, "backward", run_backward)


# the engine keeps only the addresses: these objects must live as long as the process
_FORWARD_CALLBACK = _RUNNER(_forward_entry)
_BACKWARD_CALLBACK = _RUNNER(_backward_entry)
_INSTALLED = False
_INSTALL_LOCK = threading.Lock()


def _address(callback: Any) -> int:
    return int(ctypes.cast(callback, ctypes.c_void_p).value or 0)


def install() -> None:
    """Register the forward and backward runners with the engine (idempotent)."""
    global _INSTALLED
    with _INSTALL_LOCK:
        if _INSTALLED:
            return

        C = _C()
        C.register_forward_runner(_address(_FORWARD_CALLBACK))
        C.register_backward_runner(_address(_BACKWARD_CALLBACK))
        atexit.register(_release_engine_references)
        _INSTALLED = True


def installed() -> bool:
    return _INSTALLED


def _release_engine_references() -> None:
    # The engine's pools hold Python objects; they must be dropped while the interpreter still
    # runs (their C++ destructors would otherwise take the GIL during shutdown).
    with _LIVE_LOCK:
        _LIVE.clear()
    try:
        _C().unregister_python_functions()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass
