"""torch.nn.Module + one set of inputs -> an ONNX model the training engine can differentiate.

The export runs PyTorch's TorchScript exporter (``dynamo=False``) in training mode without
constant folding. Graph inputs are the user's flattened tensors, named from their pytree paths,
followed by every parameter and buffer the graph reads (so the engine can train them); graph
outputs are the flattened outputs, named ``output.<path>``.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import io
import logging
import os
import re
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import onnx
import torch

from ortmodule_pytree import Schema, flatten, unflatten

from .. import onnx_graph, python_op
from ..aten import empty_tensors, kernel_choice
from ..aten import routes as aten_routes
from ..aten.untrainable import untrainable_ops_routed
from ..errors import ExportError, UnsupportedOutputError
from ..op_location import locate_operator
from ..symbolics.registry import symbolic_table, symbolics_applied
from ..symbolics.traced_state import tracing_state_of
from .bool_scalars import bool_scalars_as_numbers
from .cache import ExportCache
from .calls import (
    ParameterWrites,
    bind_arguments,
    call_bound,
    module_path,
    writable_buffers,
)
from .config import DEFAULT_OPSET, ExportConfig
from .gradient_cuts import cutting_gradients
from .guards import Guard, converted_tensors, guard_output_name, recording_conversions
from .model import BUFFER_WRITE_PREFIX, INPUT_WRITE_PREFIX, ExportedModel, SaveOptions
from .shape_guards import split_shape_guards
from .shape_inference_values import large_values_hidden
from .strided_views import strided_views_traced
from .tensor_data import data_as_detach
from .torch_export import TORCH_EXPORT_MIN_OPSET, TorchExportFlat, export_program
from .torch_export_fixes import cut_gradients_of_outputs
from .trace_activations import ActivationsDropped
from .traced_sizes import remove_size_barriers, sizes_kept_dynamic

logger = logging.getLogger("ortmodule.exporter")

# The TorchScript exporter in torch 2.13 writes opsets 9..20; the engine's gradient builders
# are complete from 14 on.
MIN_OPSET, MAX_OPSET = 14, 20

_WRAPPED = "_ortmodule_wrapped"


def check_opset(opset: int, source: str = "opset") -> int:
    """Validate an opset number; ``source`` names where it came from for the message."""
    if not isinstance(opset, int) or isinstance(opset, bool):
        raise ExportError(f"{source} must be an integer, got {opset!r}")
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ExportError(
            f"{source}={opset} is outside the supported range {MIN_OPSET}..{MAX_OPSET}; "
            f"use {DEFAULT_OPSET} (the default) unless you need a newer operator."
        )
    return opset


class _FlatModule(torch.nn.Module):
    """Takes flat tensors, calls the wrapped module with the user's structure, returns flat.

    After the user's outputs it returns what the trace would otherwise lose (see
    :meth:`extra_outputs`): the new values of inputs and buffers the forward wrote in place, and
    each tensor the forward turned into a Python value (a guard).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        input_schema: Schema,
        activations: ActivationsDropped | None = None,
    ) -> None:
        super().__init__()
        setattr(self, _WRAPPED, module)
        self._input_schema = input_schema
        #: saved-tensor hooks the forward runs under (the trace's: see trace_activations)
        self.activations = activations
        self.output_schema: Schema | None = None
        self.output_error: TypeError | None = None
        #: the forward left a buffer in a state the runtime cannot carry
        self.state_error: ExportError | None = None
        self.traced_outputs: tuple[torch.Tensor, ...] = ()
        #: flat input positions the forward wrote in place
        self.written_inputs: list[int] = []
        #: buffers (qualified names) the forward wrote in place
        self.written_buffers: list[str] = []
        #: tensor -> Python conversions, in trace order
        self.guards: list[Guard] = []

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        arguments = unflatten(list(flat), self._input_schema)
        module = getattr(self, _WRAPPED)
        buffers = writable_buffers(module)
        input_versions = [t._version for t in flat]
        buffer_versions = {name: b._version for name, b in buffers.items()}
        params = ParameterWrites(module)
        with (
            self.activations.applied() if self.activations else contextlib.nullcontext(),
            recording_conversions() as guards,
        ):
            out = call_bound(module, arguments)
            converted = converted_tensors()
        try:
            tensors, schema = flatten(out, prefix="output")
        except TypeError as err:
            self.output_error = err
            raise
        self.output_schema = schema
        self.traced_outputs = tuple(t.detach() for t in tensors)
        self.written_inputs = [i for i, t in enumerate(flat) if t._version != input_versions[i]]
        # a buffer is written in place (its version moves) or given a new tensor
        # (``self.x_min = self.x_min + low``, I-BERT's QuantAct): either way its value after
        # the forward is a graph output the runtime puts into the buffer on every call
        after = writable_buffers(module)
        self.written_buffers = [
            n
            for n, b in buffers.items()
            if after.get(n) is not b or b._version != buffer_versions[n]
        ]
        try:
            for name in self.written_buffers:
                _check_new_buffer_value(module, name, buffers[name], after.get(name))
            params.refuse()
        except ExportError as err:
            self.state_error = err
            raise
        self.guards = list(guards)
        written = [flat[i] for i in self.written_inputs] + [after[n] for n in self.written_buffers]
        return (*tensors, *written, *converted)

    def extra_output_names(self) -> list[str]:
        """Names of the outputs after the user's, in order (see :func:`_name_extra_outputs`)."""
        names = self._input_schema.names
        return [
            *(f"{INPUT_WRITE_PREFIX}{names[i]}" for i in self.written_inputs),
            *(f"{BUFFER_WRITE_PREFIX}{n}" for n in self.written_buffers),
            *(guard_output_name(i) for i in range(len(self.guards))),
        ]


def _check_new_buffer_value(
    module: torch.nn.Module, name: str, old: torch.Tensor, new: torch.Tensor | None
) -> None:
    """The runtime writes a buffer's new value into the buffer the module has (the engine's
    feed), so a forward that gives a buffer a tensor of another shape, dtype or device, or
    none, is refused rather than silently cut to the old shape."""
    if new is not None and (new.shape, new.dtype, new.device) == (old.shape, old.dtype, old.device):
        return
    got = (
        "None"
        if new is None
        else f"a {new.dtype} tensor of shape {tuple(new.shape)} on {new.device}"
    )
    raise ExportError(
        f"{module_path(module)}: the forward sets buffer {name!r} "
        f"({old.dtype}, shape {tuple(old.shape)} on {old.device}) to {got}. ORTModule keeps "
        "each buffer's shape, dtype and device across calls and writes its new value into it: "
        "give the buffer a tensor of its own shape, dtype and device, or keep the value in a "
        "plain attribute outside the module's buffers.",
        module_path=module_path(module),
    )


def _traced_input(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the trace takes it: detached from the user's autograd graph, and requiring
    grad when the user's does, so that each traced output requires grad exactly when eager's
    does (``ExportedModel.outputs_without_grad``). It is always a copy: the module may write
    into it in place, and the runtime makes that write on every call (the trace must not make
    it a second time on the user's tensor). A copy that requires grad is not a leaf, as the
    user's non-leaf tensor is not."""
    if tensor.requires_grad:
        return tensor.detach().requires_grad_(True).clone()
    return tensor.detach().clone()


def _module_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _available_bytes(device: torch.device) -> int | None:
    if device.type == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@contextmanager
def _preserved_state(module: torch.nn.Module) -> Iterator[None]:
    """Tracing runs forward once; keep the user's buffers (the same tensors, with the same
    values, also where the forward gave a buffer a new tensor) and the RNG streams as they
    were."""
    owned = [
        (sub, attr, b, b.detach().clone())
        for sub in module.modules()
        for attr, b in sub._buffers.items()
        if b is not None
    ]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for sub, attr, b, value in owned:
                sub._buffers[attr] = b
                b.copy_(value)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


#: why the export traces the module itself instead of a deep copy (set by a component around
#: the export, see :func:`traced_in_place`); None: copy as configured
_IN_PLACE_REASON: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "ortmodule_export_in_place", default=None
)


@contextmanager
def traced_in_place(reason: str) -> Iterator[None]:
    """Exports inside this context trace the module itself, not a deep copy of it.

    For a component whose parameters are a temporary full-size view the copy would only
    duplicate: DeepSpeed ZeRO stage 3 gathers every partitioned parameter for the export, so a
    copy held the whole model a second time (+1x the parameters per rank during the export,
    and the freed copy stayed resident in the allocator afterwards). The in-place path keeps
    the user's buffers and RNG streams as they were (:func:`_preserved_state`).
    """
    token = _IN_PLACE_REASON.set(reason)
    try:
        yield
    finally:
        _IN_PLACE_REASON.reset(token)


def copy_for_export(module: torch.nn.Module, enabled: bool = True) -> torch.nn.Module:
    """A deep copy to trace, so export cannot touch the user's weights; skipped with a warning
    when the copy would not fit in the memory available on the module's device, and skipped
    inside :func:`traced_in_place` (a component said why)."""
    if not enabled:
        return module
    reason = _IN_PLACE_REASON.get()
    if reason is not None:
        logger.info("exporting %s without a deep copy: %s", module_path(module), reason)
        return module
    params = list(module.parameters())
    device = params[0].device if params else torch.device("cpu")
    need = _module_bytes(module)
    have = _available_bytes(device)
    if have is not None and need > 0.9 * have:
        warnings.warn(
            f"ORTModule: not copying {module_path(module)} before export: it needs "
            f"{need / 2**20:.0f} MiB and {have / 2**20:.0f} MiB are available on {device}. "
            "The export runs on the module itself; its buffers and RNG state are restored.",
            stacklevel=3,
        )
        return module
    return copy.deepcopy(module)


_OP_PATTERNS = (
    re.compile(r"Exporting the operator '?(?:aten::)?([\w.]+)'?"),
    re.compile(r"aten::([\w.]+)"),
)


def _failed_op(err: BaseException) -> str | None:
    text = str(err)
    for pattern in _OP_PATTERNS:
        m = pattern.search(text)
        if m:
            name = m.group(1)
            return name if name.startswith("aten::") else f"aten::{name}"
    return None


def _dynamic_axes(
    names: Sequence[str], tensors: Sequence[torch.Tensor]
) -> dict[str, dict[int, str]]:
    """Every dim of every input, but those of size 1: they stay a fixed 1 in the graph.

    The engine's gradient builder takes a dynamic dim met by a fixed one (or by another dynamic
    dim) for equal to it, never for a broadcast 1 (``ComputeBroadcastBackwardAxes`` in
    onnxruntime 1.19): an input of shape ``(1, 6)`` added to a ``(2, 6)`` parameter got a
    gradient of shape ``(2, 6)``, and the elementwise gradient after it read past its input
    (``-inf``, ``7e18``). The input schema counts the dims of size 1 (``shape_pattern``), so a
    call with another size there builds its own graph.
    """
    return {
        name: {i: f"{name}_dim{i}" for i, size in enumerate(t.shape) if size != 1}
        for name, t in zip(names, tensors, strict=True)
    }


def export(
    module: torch.nn.Module,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    training: bool,
    opset: int | None = None,
    config: ExportConfig | None = None,
    static_shapes: bool = False,
    deepcopy: bool = True,
    cache: ExportCache | None = None,
    save: SaveOptions | None = None,
    verbose: bool = False,
    cache_extra: str = "",
) -> ExportedModel:
    """Export ``module`` called as ``module(*args, **kwargs)``.

    ``training`` chooses the module's mode during the trace (dropout active, batch statistics).
    Every dim of every input is dynamic unless ``static_shapes``. ``config`` holds the settings
    that change the graph (opset, custom autograd, ATen routes); it is applied for this export
    only and hashed into the cache key. Without one, the process-wide switches as they are now
    are used (``ExportConfig.from_switches``); ``opset`` is a shorthand that must agree with
    ``config.opset`` when both are given. With ``cache``, a hit skips the export: the module runs
    once under ``no_grad`` to give the output structure, which must match the entry's.

    >>> exported = export(torch.nn.Linear(4, 2), (torch.randn(3, 4),), training=True)
    >>> exported.user_input_names, exported.param_names
    (('input.input',), ('weight', 'bias'))
    """
    if config is None:
        config = ExportConfig.from_switches(DEFAULT_OPSET if opset is None else opset)
    elif opset is not None and opset != config.opset:
        raise ExportError(
            f"export(opset={opset}) disagrees with config.opset={config.opset}; pass one of them"
        )
    check_opset(config.opset)
    with config.applied():
        return _export(
            module,
            args,
            kwargs,
            training,
            config,
            static_shapes,
            deepcopy,
            cache,
            save,
            verbose,
            cache_extra,
        )


def _export(
    module: torch.nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    training: bool,
    config: ExportConfig,
    static_shapes: bool,
    deepcopy: bool,
    cache: ExportCache | None,
    save: SaveOptions | None,
    verbose: bool,
    cache_extra: str,
) -> ExportedModel:
    opset = config.opset
    kwargs = dict(kwargs or {})
    arguments = bind_arguments(module, args, kwargs)
    try:
        tensors, input_schema = flatten(arguments, prefix="input", static_shapes=static_shapes)
    except TypeError as err:
        raise ExportError(
            f"ORTModule cannot pass the inputs of {module_path(module)} to the engine: {err}",
            module_path=module_path(module),
        ) from err

    key = None
    if cache is not None:
        # a graph of the measured kernel choice holds this machine's routes: keyed by it
        machine = (
            kernel_choice.machine_fingerprint()
            if kernel_choice.measures(config.kernel_choice)
            else ""
        )
        key = cache.key_for(
            module,
            input_schema,
            training=training,
            opset=opset,
            extra=f"{config.fingerprint()}|{cache_extra}"
            + (f"|machine={machine}" if machine else ""),
        )
        entry = cache.load(key)
        hit = None
        if entry is not None and python_op.model_is_runnable(entry.model):
            # the entry holds no Python objects: the output structure comes from this module
            hit = entry.exported(
                input_schema, _output_schema(module, input_schema, tensors, training)
            )
        # else it names Functions this process has not exported: re-export
        if hit is not None:
            if machine and entry is not None:
                # the measurements the export made: passes after it consult them too
                try:
                    kernel_choice.decisions_from_json(entry.header.get("kernel_choice", []))
                except ValueError as err:
                    logger.info("export cache: kernel-choice decisions not taken (%s)", err)
            hit.config = config
            hit.cache_key = key
            if save is not None:
                _save(hit.model, save, "exported", training)
            return hit

    start = time.perf_counter()
    target = copy_for_export(module, deepcopy)
    flat: _FlatModule | TorchExportFlat
    if config.frontend == "torch_export":
        opset = max(opset, TORCH_EXPORT_MIN_OPSET)
        flat, model = _torch_export(
            module, target, input_schema, tensors, training, opset, static_shapes
        )
    else:
        flat, model = _torchscript_trace(
            module, target, input_schema, tensors, training, config, static_shapes, verbose
        )
    assert flat.output_schema is not None
    exported = _finish(
        model, input_schema, flat.output_schema, training, opset, flat.extra_output_names()
    )
    exported.constant_outputs = _drop_constant_outputs(
        model, flat.traced_outputs, flat.output_schema
    )
    _keep_written_state(exported, flat, tensors, module_path(module))
    _keep_guards(exported, flat.guards, tensors)
    if isinstance(flat, TorchExportFlat):
        # torch.export's assumptions on the input sizes (fixed, bounded, equal dims)
        exported.shape_guards = (*exported.shape_guards, *flat.shape_guards)
        if training:
            cut_gradients_of_outputs(model, _outputs_cut_from_grad(exported, input_schema, tensors))
    exported.config = config
    exported.export_seconds = time.perf_counter() - start
    # the cache holds no tensors: a model with constant outputs is exported again next time,
    # and so is one that writes to its inputs. Guards (their traced values small tensors, a
    # bool or a count) are kept in the entry as plain data; a big one keeps it out (store warns)
    if (
        cache is not None
        and key is not None
        and not exported.constant_outputs
        and not exported.input_writes
    ):
        cache.store(key, exported)
        exported.cache_key = key
    if save is not None:
        _save(exported.model, save, "exported", training)
    logger.info(
        "exported %s (%s) in %.2f s",
        module_path(module),
        "training" if training else "inference",
        exported.export_seconds,
    )
    return exported


def _torchscript_trace(
    module: torch.nn.Module,
    target: torch.nn.Module,
    input_schema: Schema,
    tensors: Sequence[torch.Tensor],
    training: bool,
    config: ExportConfig,
    static_shapes: bool,
    verbose: bool,
) -> tuple[_FlatModule, onnx.ModelProto]:
    """The TorchScript frontend: ``torch.onnx.export(dynamo=False)`` of the flat wrapper, with
    the symbolic table of ``config``. The trace's forward keeps no tensors for a backward
    unless the forward reads them itself (see trace_activations)."""
    trace = functools.partial(
        _torchscript_trace_once,
        module,
        target,
        input_schema,
        tensors,
        training,
        config,
        static_shapes,
        verbose,
    )
    activations = ActivationsDropped()
    traced = None
    try:
        traced = trace(activations)
    except Exception:
        if not activations.read:
            raise
    # a forward that caught the failed read and went on traced another path than eager's
    if traced is not None and not activations.read:
        return traced
    logger.info(
        "%s reads saved tensors in its forward: traced again keeping them", module_path(module)
    )
    return trace(None)


def _torchscript_trace_once(
    module: torch.nn.Module,
    target: torch.nn.Module,
    input_schema: Schema,
    tensors: Sequence[torch.Tensor],
    training: bool,
    config: ExportConfig,
    static_shapes: bool,
    verbose: bool,
    activations: ActivationsDropped | None,
) -> tuple[_FlatModule, onnx.ModelProto]:
    """One trace and lowering; the forward runs under ``activations``' hooks where given."""
    opset = config.opset
    flat = _FlatModule(target, input_schema, activations)
    buf = io.BytesIO()
    names = list(input_schema.names)
    # each submodule keeps its own mode, as in eager: a BatchNorm or Dropout set to eval()
    # inside a module that trains uses its running statistics (TrainingMode.TRAINING would
    # put every submodule in train mode for the trace). Asked for the other mode than the
    # module is in, every submodule is put in that mode.
    mode = torch.onnx.TrainingMode.PRESERVE
    was_training = target.training
    if was_training != training:
        target.train(training)
    # torch.onnx reads the mode of the module it is given: the wrapper's own flag only (train()
    # would set every submodule)
    flat.training = training
    try:
        with (
            _preserved_state(target),
            symbolics_applied(symbolic_table(config), opset),
            cutting_gradients(),
            tracing_state_of(flat),
            untrainable_ops_routed(),
            empty_tensors.example_inputs(tensors),
            kernel_choice.recording_traced_sizes(),
            # after the size recorder: it sees the calls as traced (numbers for bools)
            bool_scalars_as_numbers(),
            data_as_detach(),
            strided_views_traced(),
            python_op.exporting_copy_of(module, target),
            sizes_kept_dynamic(tensors, enabled=not static_shapes),
            large_values_hidden(),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("always")
            torch.onnx.export(
                flat,
                tuple(_traced_input(t) for t in tensors),
                buf,  # type: ignore[arg-type]  # a file object works; the stub says path only
                input_names=names,
                opset_version=opset,
                do_constant_folding=False,
                training=mode,
                dynamic_axes=None if static_shapes else _dynamic_axes(names, tensors),
                export_params=False,
                keep_initializers_as_inputs=True,
                verbose=verbose,
                dynamo=False,
                # the tracer crashes on Functions with non-tensor outputs unless inlining is off
                autograd_inlining=not config.custom_autograd,
                # ops without a symbolic become ATen nodes the engine runs through PyTorch
                operator_export_type=aten_routes.operator_export_type(),
            )
    except Exception as err:
        if flat.state_error is not None:
            raise flat.state_error from err
        if flat.output_error is not None:
            raise UnsupportedOutputError(
                f"{module_path(module)} returned an output ORTModule cannot hand back: "
                f"{flat.output_error}",
                module_path=module_path(module),
            ) from err
        op = _failed_op(err)
        where = f" at operator {op}" if op else ""
        called_in = None
        if op:
            with _preserved_state(target):
                called_in = locate_operator(
                    target, lambda m: call_bound(m, unflatten(list(tensors), input_schema)), op
                )
        if called_in is not None:
            where += f" (called in {called_in or 'its own forward'})"
        raise ExportError(
            f"ORTModule could not export {module_path(module)}{where}: {err}\n"
            "Register a symbolic for the operator with ortmodule_exporter.register_symbolic, "
            "compute that step differently in the module named above, "
            "or let ORTModule fall back to PyTorch (see ORTMODULE_FALLBACK_POLICY).",
            module_path=module_path(module),
            op=op,
            called_in=called_in,
        ) from err
    finally:
        target.train(was_training)
    assert flat.output_schema is not None
    _report_trace_warnings(caught, module_path(module))
    model = onnx.load_from_string(buf.getvalue())
    remove_size_barriers(model)
    return flat, model


_WARNED_EXPERIMENTAL: list[bool] = []


def _warn_experimental_frontend() -> None:
    """Once per process: the torch_export frontend is checked against eager on fewer programs
    than the default, and trains fewer (docs/frontends.md; its wrong results found by those
    runs are fixed, each with a test)."""
    if _WARNED_EXPERIMENTAL:
        return
    _WARNED_EXPERIMENTAL.append(True)
    warnings.warn(
        "ORTModule: ORTMODULE_EXPORTER=torch_export is experimental: it trains fewer programs "
        "than the default exporter and has been checked against eager on fewer "
        "(docs/frontends.md); check its losses and gradients against eager, or unset "
        "ORTMODULE_EXPORTER",
        UserWarning,
        stacklevel=4,
    )


def _torch_export(
    module: torch.nn.Module,
    target: torch.nn.Module,
    input_schema: Schema,
    tensors: Sequence[torch.Tensor],
    training: bool,
    opset: int,
    static_shapes: bool,
) -> tuple[TorchExportFlat, onnx.ModelProto]:
    """The torch_export frontend (``torch_export.export_program``), in the module's mode."""
    _warn_experimental_frontend()
    flat = TorchExportFlat(target, input_schema, _WRAPPED)
    was_training = target.training
    if was_training != training:
        target.train(training)
    try:
        # a custom Function given a module by reference gets the original, not this copy
        with _preserved_state(target), python_op.exporting_copy_of(module, target):
            model = export_program(
                flat,
                [_traced_input(t) for t in tensors],
                list(input_schema.names),
                opset,
                static_shapes,
                module_path(module),
                training=training,
            )
    except Exception as err:
        if flat.output_error is not None:
            raise UnsupportedOutputError(
                f"{module_path(module)} returned an output ORTModule cannot hand back: "
                f"{flat.output_error}",
                module_path=module_path(module),
            ) from err
        raise
    finally:
        target.train(was_training)
    return flat, model


def _output_schema(
    module: torch.nn.Module, input_schema: Schema, tensors: Sequence[torch.Tensor], training: bool
) -> Schema:
    """The output structure of ``module`` on these inputs (the export cache stores no Python
    objects): from one forward on fake tensors when it runs there, else from one forward under
    no_grad. Buffers and RNG streams are left as they were.

    The fake forward computes nothing (a GPT-2 124M forward is seconds of a warm start; its
    fake one is tens of milliseconds). A forward whose output could depend on values (a tensor
    read as a Python number, ``.tolist()``) raises under fake tensors, and so does anything
    else they do not support: then the real forward decides.
    """
    try:
        flat = _forward_once(module, input_schema, tensors, training, fake=True)
    except Exception as err:  # noqa: BLE001 - any failure: the real forward decides
        logger.debug("output structure: the fake forward failed (%s); running it for real", err)
    else:
        # values read or written: only a real forward is sure to agree
        if not (flat.guards or flat.written_buffers or flat.written_inputs):
            return _schema_of(module, flat)
    return _schema_of(module, _forward_once(module, input_schema, tensors, training, fake=False))


def _forward_once(
    module: torch.nn.Module,
    input_schema: Schema,
    tensors: Sequence[torch.Tensor],
    training: bool,
    fake: bool,
) -> _FlatModule:
    """One no_grad forward of ``module`` in ``training`` mode, on fake copies of ``tensors``
    (the parameters and buffers stay real: the mode wraps them per operation) or on the
    tensors; buffers, RNG streams and the module's mode are left as they were."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    flat = _FlatModule(module, input_schema)
    was_training = module.training
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_preserved_state(module))
            stack.enter_context(torch.no_grad())
            module.train(training)
            inputs = [t.detach() for t in tensors]
            if fake:
                stack.enter_context(warnings.catch_warnings())
                warnings.simplefilter("ignore")
                mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
                inputs = [mode.from_tensor(t) for t in inputs]
            flat(*inputs)
    finally:
        module.train(was_training)
    return flat


def _schema_of(module: torch.nn.Module, flat: _FlatModule) -> Schema:
    if flat.output_schema is None:  # pragma: no cover - forward raised instead
        raise ExportError(f"{module_path(module)} returned no output")
    return flat.output_schema


def _finish(
    model: onnx.ModelProto,
    input_schema: Schema,
    output_schema: Schema,
    training: bool,
    opset: int,
    extra_outputs: Sequence[str] = (),
) -> ExportedModel:
    onnx_graph.cap_ir_version(model)
    graph = model.graph
    user_names = set(input_schema.names)
    prefix = _WRAPPED + "."
    user_inputs, params = [], []
    renames: dict[str, str] = {}
    for vi in list(graph.input):
        if vi.name in user_names:
            user_inputs.append(vi.name)
        elif vi.name.startswith(prefix):
            renames[vi.name] = vi.name[len(prefix) :]
            params.append(renames[vi.name])
        else:
            raise ExportError(
                f"exported graph has an input {vi.name!r} that is neither a user input nor a parameter"
            )
    # simultaneous: no parameter's new name (the prefix stripped) is another's old one
    onnx_graph.rename_values(graph, renames)
    onnx_graph.name_outputs(graph, [*output_schema.names, *extra_outputs])
    for vi in graph.output:
        onnx_graph.make_dims_symbolic(vi, vi.name)
    return ExportedModel(
        model=model,
        input_schema=input_schema,
        output_schema=output_schema,
        user_input_names=tuple(user_inputs),
        param_names=tuple(params),
        training=training,
        opset=opset,
    )


def _keep_written_state(
    exported: ExportedModel,
    flat: _FlatModule | TorchExportFlat,
    tensors: Sequence[torch.Tensor],
    where: str,
) -> None:
    """Record the in-place writes the forward made, so the runtime makes them on every call."""
    names = exported.input_schema.names
    for i in flat.written_inputs:
        if tensors[i].requires_grad:
            raise ExportError(
                f"{where} writes in place to its input {names[i]!r}, which requires grad. "
                "ORTModule cannot carry that write into your autograd graph: write to a copy "
                "(x = x.clone() before the in-place op) or pass a tensor that does not require "
                "grad.",
                module_path=where,
            )
        exported.input_writes[f"{INPUT_WRITE_PREFIX}{names[i]}"] = names[i]
    for buffer in flat.written_buffers:
        exported.buffer_updates[f"{BUFFER_WRITE_PREFIX}{buffer}"] = buffer


def _keep_guards(
    exported: ExportedModel, guards: Sequence[Guard], tensors: Sequence[torch.Tensor]
) -> None:
    """The guards whose value depends on a graph input: those computed from input shapes
    alone are checked before the graph runs (``exported.shape_guards``), the others stay graph
    outputs (``exported.guards``). The outputs of the rest (computed from constants and fixed
    sizes, so they never change) are removed."""
    if not guards:
        return
    model = exported.model
    names = [guard_output_name(i) for i in range(len(guards))]
    deps = onnx_graph.output_dependencies(model, names)
    kept = [(n, g) for n, g, d in zip(names, guards, deps, strict=True) if d]
    dropped = {n for n, _, d in zip(names, guards, deps, strict=True) if not d}
    names_in = exported.input_schema.names
    traced = {name: tuple(t.shape) for name, t in zip(names_in, tensors, strict=True)}
    for vi in model.graph.input:  # parameters and buffers: their declared, fixed shapes
        if vi.name not in traced:
            traced[vi.name] = tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
    data, from_shapes = split_shape_guards(model, kept, traced)
    dropped |= {g.output for g in from_shapes}
    outputs = [vi for vi in model.graph.output if vi.name not in dropped]
    del model.graph.output[:]
    model.graph.output.extend(outputs)
    exported.guards = tuple(data)
    exported.shape_guards = tuple(g for g in from_shapes if g.inputs)


# tracer warnings about what the guards check: ``len(t)`` goes through ``__index__``, and a
# ``torch.tensor(...)`` constant holds Python values, which are either constants or came from a
# traced tensor through a guarded conversion
_GUARDED_WARNINGS = (
    "Converting a tensor to a Python",
    "Using len to get tensor shape",
    "torch.tensor results are registered as constants",
)


def _report_trace_warnings(caught: Sequence[warnings.WarningMessage], where: str) -> None:
    """PyTorch's tracer warnings, once per source line, as ORTModule warnings.

    A conversion of a tensor to a Python value is guarded (see ``guards``), so its warning is
    not repeated; the rest (a tensor iterated over, ``torch.tensor`` of traced values made a
    constant, ...) mark a place where the graph may not follow the Python on other inputs.
    """
    seen: set[tuple[str, int]] = set()
    for w in caught:
        if not issubclass(w.category, torch.jit.TracerWarning):
            continue
        text = str(w.message)
        if text.startswith(_GUARDED_WARNINGS):
            continue
        if (w.filename, w.lineno) in seen:
            continue
        seen.add((w.filename, w.lineno))
        logger.warning(
            "the trace of %s may not follow the Python at %s:%d on other inputs: %s",
            where,
            w.filename,
            w.lineno,
            text.splitlines()[0] if text else "",
        )


def _drop_constant_outputs(
    model: onnx.ModelProto, traced: Sequence[torch.Tensor], schema: Schema
) -> dict[int, torch.Tensor]:
    """Remove the graph outputs that depend on no graph input; their values, by index.

    Such an output is a constant (a cache layer's window size kept as a tensor, say): the
    engine folds it into an initializer and then cannot build a gradient graph that has it as
    an output. Its value is the traced one; the torch_export frontend traces fake tensors, so
    there it is computed from the graph (``max(x, 0)`` of a 0-d ``x``: the index is a
    ``Constant`` 0; an empty input's integer outputs, ``frexp``'s exponent, ``solve_ex``'s info).
    """
    graph = model.graph
    names = [vi.name for vi in graph.output]
    specs = schema.tensor_specs
    found = [
        i
        for i, deps in enumerate(onnx_graph.output_dependencies(model, names))
        if not deps and i < max(len(traced), len(specs))
    ]
    computed = onnx_graph.evaluate_constants(model, [names[i] for i in found if i >= len(traced)])
    constants: dict[int, torch.Tensor] = {}
    for i in found:
        if i < len(traced):
            constants[i] = traced[i].clone()
        elif names[i] in computed:
            try:
                value = torch.from_numpy(computed[names[i]].copy())
            except TypeError:  # a type numpy holds and torch does not read (bfloat16)
                continue
            constants[i] = value.to(device=specs[i].device, dtype=specs[i].dtype)
        # else an operator the reference evaluator lacks: it stays an output, which the
        # engine refuses with its own error naming it
    if constants:
        kept = [vi for i, vi in enumerate(graph.output) if i not in constants]
        del graph.output[:]
        graph.output.extend(kept)
    return constants


def _outputs_cut_from_grad(
    exported: ExportedModel, input_schema: Schema, tensors: Sequence[torch.Tensor]
) -> list[str]:
    """The float user outputs that eager computed without grad, though the graph computes them
    from a parameter or an input that requires grad (:func:`cut_gradients_of_outputs`)."""
    names = exported.user_output_names
    without = exported.outputs_without_grad
    specs = [s for i, s in enumerate(exported.output_schema.tensor_specs)
             if i not in exported.constant_outputs]  # fmt: skip
    candidates = [
        n for j, n in enumerate(names) if j in without and specs[j].dtype.is_floating_point
    ]
    if not candidates:
        return []
    trainable = set(exported.param_names) | {
        n for n, t in zip(input_schema.names, tensors, strict=False) if t.requires_grad
    }
    deps = onnx_graph.output_dependencies(exported.model, candidates)
    return [n for n, d in zip(candidates, deps, strict=True) if d & trainable]


def _save(model: onnx.ModelProto, save: SaveOptions, stage: str, training: bool) -> None:
    os.makedirs(save.path, exist_ok=True)
    onnx.save_model(model, save.file_path(stage, training))
