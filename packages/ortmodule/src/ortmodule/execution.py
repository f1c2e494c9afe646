"""One training step through the engine: feeds, the autograd bridge, outputs.

``GraphRunner`` owns the graph transition manager for one wrapped module. Each call flattens the
inputs, asks the manager for the graph of the current key (building it when the key is new), and
runs it: in training through :class:`EngineFunction`, a ``torch.autograd.Function`` whose
forward runs the engine's forward half and whose backward runs the backward half, handing every
gradient back to autograd so ``param.grad`` accumulates exactly as in eager.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import re
import tempfile
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import onnx
import torch

from ortmodule_exporter import (
    BatchContext,
    EngineBuildError,
    ExportCache,
    ExportConfig,
    ExportedModel,
    GraphKey,
    GraphTransitionManager,
    Guard,
    GuardError,
    SaveOptions,
    export,
    parameter_signature,
    run_batch_passes,
    run_post_export_passes,
    trace_state,
)
from ortmodule_exporter.components import (
    SessionContext,
    SessionContribution,
    SessionInfo,
    StepContext,
    StepPhases,
    has_session_contributors,
    session_contribution,
    step_hooks,
    step_phases,
)
from ortmodule_exporter.engine import (
    BuiltGraph,
    GraphConfig,
    InferenceSession,
    SessionConfig,
    TrainingSession,
    build_graph,
)
from ortmodule_exporter.export import bind_arguments, forward_signature
from ortmodule_exporter.passes.matmul_routes import routes_products
from ortmodule_exporter.sparsity.config import SparsityConfig
from ortmodule_pytree import FlattenMemo, unflatten

from .compiled_graph import (
    BufferUpdate,
    CompiledGraph,
    apply_buffer_updates,
    kept_variances,
)
from .engine_function import engine_apply, runs_torch
from .log import PhaseTimer, log_initialisation_summary

logger = logging.getLogger("ortmodule")

# dtypes the engine trains with CPU kernels; others are refused before the engine sees them
SUPPORTED_PARAM_DTYPES = {
    "cpu": (torch.float32, torch.float64, torch.bfloat16, torch.float16),
    "cuda": (torch.float32, torch.float16, torch.bfloat16, torch.float64),
}


#: graphs one key may build for the values of its guards before ORTModule stops (a value
#: that keeps changing would otherwise export at every step)
GUARDED_GRAPHS_PER_KEY = 8


class UnsupportedDeviceError(RuntimeError):
    """The module or its inputs live on a device ORTModule does not run on."""


class UnsupportedDataError(TypeError):
    """An input or parameter has a type or dtype the engine cannot take."""


def _owner(module: torch.nn.Module, qualified: str) -> tuple[torch.nn.Module, str]:
    *path, attr = qualified.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    return owner, attr


@dataclass(frozen=True)
class RunnerConfig:
    """What the runner needs from the options (filled by ORTModule from RuntimeOptions)."""

    opset: int = 17
    #: what changes the exported graph; None: the exporter's process-wide switches
    export_config: ExportConfig | None = None
    static_shapes: bool = False
    deepcopy: bool = True
    cache_dir: str | None = None
    save: SaveOptions | None = None
    enable_compute_optimizer: bool = True
    print_input_density: bool = False
    #: compute optimizer, sparse optimizer and label sparse optimizer all on
    label_sparsity: bool = True
    #: compute optimizer, sparse optimizer and embedding sparse optimizer all on
    padding_elimination: bool = False
    engine_log_severity: int = 3
    exporter_verbose: bool = False
    conv_algo_search: str = "HEURISTIC"
    #: ``ORTMODULE_CPU_MEM_ARENA``: "1" / "0" force the CPU engine's arena on / off; "AUTO" keeps
    #: it unless a session contributor asks for the memory back (``release_cpu_memory``)
    cpu_mem_arena: str = "AUTO"
    #: PyTorch's intra-op threads while the engine runs PyTorch-run nodes (0: leave as is)
    torch_threads_in_engine: int = 0
    use_memory_efficient_gradient: bool = False
    #: ``ORTMODULE_*`` variable -> parsed value, for post-export passes and components
    pass_options: tuple[tuple[str, Any], ...] = ()
    transformer_options: tuple[tuple[str, Any], ...] = ()


#: the engine build settings a ``GraphConfig`` takes from the runner's options as they are:
#: (GraphConfig field, RunnerConfig field)
_GRAPH_FIELDS_FROM_OPTIONS = (
    ("enable_compute_optimizer", "enable_compute_optimizer"),
    ("print_input_density", "print_input_density"),
    ("use_memory_efficient_gradient", "use_memory_efficient_gradient"),
    ("log_severity", "engine_log_severity"),
    ("transformer_options", "transformer_options"),
)


#: under ``ORTMODULE_CPU_MEM_ARENA=AUTO``, a graph whose matrix products run on PyTorch and whose
#: module holds at least this many bytes of parameters gets a session without the arena
PRODUCTS_ARENA_OFF_BYTES = 64 << 20


def _cpu_arena(
    setting: str,
    contribution: SessionContribution | None,
    products_on_torch: bool = False,
    parameter_bytes: int = 0,
) -> bool:
    """Whether a CPU session allocates from the engine's arena: ``ORTMODULE_CPU_MEM_ARENA``,
    and under ``AUTO`` the arena unless a contributor (recompute, ZeRO-3) asks for the memory,
    or the graph's matrix products run on PyTorch (``passes/matmul_routes.py``) in a module of
    :data:`PRODUCTS_ARENA_OFF_BYTES` of parameters or more. Then most of a step's large
    tensors are PyTorch's, and an arena kept at the peak of the engine's own share held it
    resident beside them: GPT-2 124M (475 MiB of parameters) on the 2-core Xeon, steps peak
    3982 MiB with the arena and 3173 MiB without, step 3.57 and 3.70 s. A small model keeps it:
    the toy GPT of the benchmarks (13 MiB) stepped at 1.22x eager with the arena and 1.32x
    without, where the engine's own buffers were fetched and faulted in again every step."""
    if setting in ("1", "0"):
        return setting == "1"
    if products_on_torch and parameter_bytes >= PRODUCTS_ARENA_OFF_BYTES:
        return False
    return not (contribution is not None and contribution.release_cpu_memory)


class _Binder:
    """``bind_arguments`` for the usual signature (plain parameters, no ``*args``/``**kwargs``)
    without ``inspect.Signature.bind`` on every step.

    Gives the same ordered dict ``Signature.bind(...).arguments`` would: the arguments passed, in
    the signature's order, defaults left out. Anything else (a missing or unknown argument, a
    signature with variadic or keyword-only parameters) goes to ``bind_arguments``, which also
    produces its errors.
    """

    __slots__ = ("module", "signature", "names", "required", "plain")

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.signature = forward_signature(module)
        params = list(self.signature.parameters.values()) if self.signature is not None else []
        plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY)
        self.plain = self.signature is not None and all(p.kind in plain for p in params)
        self.names = tuple(p.name for p in params)
        self.required = sum(p.default is inspect.Parameter.empty for p in params)
        if self.plain and any(
            p.default is inspect.Parameter.empty for p in params[self.required :]
        ):
            self.plain = False  # a required parameter after a defaulted one: leave it to inspect

    def __call__(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        names = self.names
        n = len(args)
        if self.plain and n <= len(names):
            if not kwargs:
                if n >= self.required:
                    return dict(zip(names, args, strict=False))  # fewer args than names
            else:
                bound = dict(zip(names, args, strict=False))
                for name in names[n:]:
                    if name in kwargs:
                        bound[name] = kwargs[name]
                # every keyword matched a parameter not given by position, none required missing
                if len(bound) == n + len(kwargs) and all(
                    name in bound for name in names[n : self.required]
                ):
                    return bound
        return bind_arguments(self.module, args, kwargs, self.signature)


class GraphRunner:
    """Runs one wrapped module through the engine; one per ORTModule."""

    def __init__(
        self,
        module: torch.nn.Module,
        config: RunnerConfig,
        quiet: Callable[[], Any] | None = None,
    ) -> None:
        self.module = module
        self.config = config
        self.transitions: GraphTransitionManager[CompiledGraph] = GraphTransitionManager()
        self.cache = ExportCache(config.cache_dir) if config.cache_dir else None
        self.exports = 0
        self._quiet = quiet
        self.last_times: PhaseTimer | None = None
        self._signature: Any = None
        #: attribute writes made through the wrapper (name -> value token): part of the key
        self.module_state: dict[str, Any] = {}
        self._binder: _Binder | None = None
        self._flatten = FlattenMemo(prefix="input", static_shapes=config.static_shapes)
        #: the previous call's (input schema, other key parts, graph)
        self._last: tuple[Any, tuple[Any, ...], CompiledGraph] | None = None
        self.step = StepContext(module, dict(config.pass_options))
        self._phases: StepPhases | None = None
        #: per mode: the first key of a guarded family and every graph built for it
        self._families: dict[tuple[bool, bool], tuple[GraphKey, list[CompiledGraph]]] = {}

    # -- the key ---------------------------------------------------------------------------
    def _device(self) -> torch.device:
        for tensor in (*self.module.parameters(), *self.module.buffers()):
            return tensor.device
        return torch.device("cpu")

    def _key(
        self,
        schema: Any,
        training_graph: bool,
        device: torch.device,
        params: tuple[Any, ...],
        state: tuple[tuple[str, Any], ...],
        traced: tuple[Any, ...],
    ) -> GraphKey:
        return GraphKey(
            input_schema=schema,
            training=self.module.training,
            build_gradient=training_graph,
            device=str(device),
            params=params,
            options=(("opset", self.config.opset), ("module_state", state)),
            state=traced,
        )

    def _graph(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        flat: list[torch.Tensor],
        schema: Any,
        training_graph: bool,
        device: torch.device,
        params: tuple[Any, ...],
    ) -> CompiledGraph:
        """The graph for this call: the previous call's when nothing in its key changed.

        The previous call's key parts are kept, so a step with the same input schema (the very
        object: ``FlattenMemo`` hands it back) skips building and comparing a ``GraphKey``; the
        transition manager stays the judge (its current graph for the mode must still be it).
        """
        state = tuple(sorted(self.module_state.items())) if self.module_state else ()
        training = self.module.training
        traced = trace_state()
        parts = (training, training_graph, device, params, state, traced)
        last = self._last
        if last is not None and last[0] is schema and last[1] == parts:
            graph = last[2]
            if self.transitions.current(training, training_graph) is graph:
                return graph
        key = self._key(schema, training_graph, device, params, state, traced)
        current = self.transitions.current(training, training_graph)
        if current is not None and current.key.without_guards() == key:
            graph = current  # the graph a guard chose last time, for the same key
        else:
            graph = self.transitions.get(
                key, lambda: self._compile(key, args, kwargs, flat, device)
            )
        self._last = (schema, parts, graph)
        return graph

    # -- one call ----------------------------------------------------------------------------
    def __call__(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        phases = self._phases = step_phases(self.step, self._phases)
        for hook in phases.pre_forward:
            hook.pre_forward(self.step)
        binder = self._binder
        if binder is None:
            binder = self._binder = _Binder(self.module)
        arguments = binder(args, kwargs)
        try:
            flat, schema = self._flatten(arguments)
        except TypeError as err:
            raise UnsupportedDataError(str(err)) from err
        named = list(self.module.named_parameters())
        device = named[0][1].device if named else self._device()
        self._check_inputs(flat, device)
        params = parameter_signature(named)  # (name, shape, dtype, requires_grad) each
        wants_grad = torch.is_grad_enabled() and (
            any(p[3] for p in params) or any(t.requires_grad for t in flat)
        )
        training_graph = self.module.training and wants_grad
        graph = self._graph(args, kwargs, flat, schema, training_graph, device, params)
        if graph.shape_guards:
            graph = self._shape_checked(graph, args, kwargs, flat, device)
        try:
            outputs, kept = self._run(graph, flat, phases, training_graph)
        except RuntimeError as err:
            if not graph.guards:
                raise
            graph, outputs, kept = self._after_failed_run(
                graph, err, args, kwargs, flat, device, phases, training_graph
            )
        if graph.guards:
            graph, outputs, kept = self._guarded(
                graph, outputs, kept, args, kwargs, flat, device, phases, training_graph
            )
        if graph.buffer_updates:
            apply_buffer_updates(graph.buffer_updates, outputs, kept)
        if graph.input_writes:
            with torch.no_grad():
                for index, position in graph.input_writes:
                    flat[position].copy_(outputs[index])
        for hook in phases.post_forward:
            hook.post_forward(self.step, outputs)
        exported = graph.built.exported
        return unflatten(
            exported.restore_outputs(outputs[: graph.output_count]), exported.output_schema
        )

    def _run(
        self,
        graph: CompiledGraph,
        flat: Sequence[torch.Tensor],
        phases: StepPhases,
        training_graph: bool,
    ) -> tuple[Any, list[torch.Tensor]]:
        feeds = self._gather(graph, flat)
        kept = kept_variances(graph.buffer_updates) if graph.buffer_updates else []
        if training_graph:
            return engine_apply(graph, phases, feeds), kept
        assert isinstance(graph.session, InferenceSession)
        return graph.session.forward(feeds), kept

    def _guarded(
        self,
        graph: CompiledGraph,
        outputs: Any,
        kept: list[torch.Tensor],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        flat: list[torch.Tensor],
        device: torch.device,
        phases: StepPhases,
        training_graph: bool,
    ) -> tuple[CompiledGraph, Any, list[torch.Tensor]]:
        """Check the graph's guards on this run; while one fails, run the graph built for the
        new values (building it when there is none) instead, and hand back the run that holds.

        A run whose guard failed is dropped before anything reaches the user: its outputs and its
        autograd node. It wrote no buffer: the engine writes into copies of the written buffers
        (``_bind``), and the buffers are set only after the guards hold.
        """
        for _ in range(GUARDED_GRAPHS_PER_KEY + 1):
            failed = graph.failed_guard(outputs)
            if failed is None:
                return graph, outputs, kept
            index, guard = graph.guards[failed]

            def fits(other: CompiledGraph, ran: CompiledGraph = graph, out: Any = outputs) -> bool:
                return other.guards_hold_for(ran, out) and other.fits_shapes(flat)

            graph = self._graph_for_guards(
                graph,
                guard,
                outputs[index],
                fits,
                args,
                kwargs,
                flat,
                device,
            )
            outputs, kept = self._run(graph, flat, phases, training_graph)
        raise GuardError(  # pragma: no cover - each pass above builds or finds a new graph
            f"ORTModule: no graph of {type(self.module).__qualname__} holds for this input"
        )

    def _after_failed_run(
        self,
        graph: CompiledGraph,
        err: RuntimeError,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        flat: list[torch.Tensor],
        device: torch.device,
        phases: StepPhases,
        training_graph: bool,
    ) -> tuple[CompiledGraph, Any, list[torch.Tensor]]:
        """The run of ``graph`` failed: a value it checks only after its run changed so that
        the run itself failed (a size taken from an intermediate and baked in, as CLIP's
        ``torch.arange(len(logits))`` labels on a smaller last batch). Run each graph built
        earlier for this key instead, keeping the first that runs and whose guards hold (a
        batch size that comes back finds its graph); else export for this call."""
        family = self._families.get((graph.key.training, graph.key.build_gradient))
        others = family[1] if family is not None and family[0] == graph.key.without_guards() else []
        failure = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        change = f"the run failed before its guards were checked ({failure[:200]})"
        for other in reversed(others):
            if other is graph or not other.fits_shapes(flat):
                continue
            try:
                outputs, kept = self._run(other, flat, phases, training_graph)
            except RuntimeError:
                outputs = None
            if outputs is not None and other.failed_guard(outputs) is None:
                self.transitions.switch(other.key, other, change)
                self._last = None
                return other, outputs, kept
        graph = self._graph_for_guards(
            graph,
            graph.guards[0][1],
            None,
            lambda other: False,
            args,
            kwargs,
            flat,
            device,
            failure=change,
        )
        outputs, kept = self._run(graph, flat, phases, training_graph)
        return graph, outputs, kept

    def _shape_checked(
        self,
        graph: CompiledGraph,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        flat: list[torch.Tensor],
        device: torch.device,
    ) -> CompiledGraph:
        """``graph``, or while one of its size guards fails for these inputs' shapes, the
        graph built for the new sizes (before anything runs)."""
        for _ in range(GUARDED_GRAPHS_PER_KEY + 1):
            failed = graph.failed_shape_guard(flat)
            if failed is None:
                return graph
            guard, now = failed
            graph = self._graph_for_guards(
                graph,
                guard.guard,
                now,
                lambda other: other.fits_shapes(flat),
                args,
                kwargs,
                flat,
                device,
            )
        raise GuardError(  # pragma: no cover - each pass above builds or finds a new graph
            f"ORTModule: no graph of {type(self.module).__qualname__} holds for these shapes"
        )

    def _graph_for_guards(
        self,
        graph: CompiledGraph,
        guard: Guard,
        now: torch.Tensor | None,
        fits: Callable[[CompiledGraph], bool],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        flat: list[torch.Tensor],
        device: torch.device,
        failure: str | None = None,
    ) -> CompiledGraph:
        """The graph for the value ``guard`` of ``graph`` has now (``now``): one built earlier
        for the key that ``fits`` this call, else a new export, up to
        :data:`GUARDED_GRAPHS_PER_KEY` per key. ``failure`` says why instead, when the run
        failed before its guards could be read."""
        change = failure or guard.describe(now)
        where = type(self.module).__qualname__
        if failure is None and not guard.discrete:
            raise GuardError(
                f"ORTModule: {where} turns a tensor into a Python number with {change}. The "
                "exported graph keeps the number it saw, and a float that changed will keep "
                "changing. Keep it a tensor (drop the float()/.item() so the graph computes "
                "it), or let ORTModule fall back to PyTorch (ORTMODULE_FALLBACK_POLICY)."
            )
        base = graph.key.without_guards()
        slot = (base.training, base.build_gradient)
        family = self._families.get(slot)
        if family is None or family[0] != base:
            family = (base, [graph])
            self._families[slot] = family
        graphs = family[1]
        for other in graphs:
            if other is not graph and fits(other):
                self.transitions.switch(other.key, other, change)
                self._last = None
                return other
        if len(graphs) >= GUARDED_GRAPHS_PER_KEY:
            raise GuardError(
                f"ORTModule: {where} turns a tensor into a Python value that keeps changing: "
                f"{change}, after {len(graphs)} graphs built for other values. Compute it with "
                "tensor ops (torch.where instead of an if on a tensor), or let ORTModule fall "
                "back to PyTorch (ORTMODULE_FALLBACK_POLICY)."
            )
        if len(graphs) == 2:
            logger.warning(
                "%s: %s; a third graph is built for it. Each new value costs an export; from "
                "%d graphs on, ORTModule stops. Compute it with tensor ops where you can.",
                where,
                change,
                GUARDED_GRAPHS_PER_KEY,
            )
        key = dataclasses.replace(base, guards=(f"graph {len(graphs) + 1}", change))
        built = self.transitions.get(key, lambda: self._compile(key, args, kwargs, flat, device))
        graphs.append(built)
        self._last = None
        return built

    def _check_inputs(self, flat: Sequence[torch.Tensor], device: torch.device) -> None:
        if device.type not in ("cpu", "cuda"):
            raise UnsupportedDeviceError(
                f"ORTModule runs on cpu and cuda, the module is on {device}"
            )
        for t in flat:
            if t.device != device:
                raise UnsupportedDeviceError(
                    f"an input is on {t.device} but the module is on {device}; move them to one device"
                )
            if t.is_sparse or t.is_complex():
                raise UnsupportedDataError(
                    f"the engine takes dense real tensors, got {t.dtype} layout {t.layout}"
                )

    def _gather(self, graph: CompiledGraph, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        feeds = []
        for kind, where in graph.feeds:
            if kind == "input":
                feeds.append(flat[where])
            elif kind == "written input":
                feeds.append(flat[where].clone())
            elif kind == "extra":
                extra, device = where
                feeds.append(extra.make(device))
            else:
                owner, attr, table = where
                # the module's own parameter/buffer dict: what nn.Module.__getattr__ would
                # search, without its Python frame (one per parameter per step)
                tensor = table.get(attr) if table is not None else None
                tensor = tensor if tensor is not None else getattr(owner, attr)
                feeds.append(tensor.clone() if kind == "written buffer" else tensor)
        return feeds

    def _silenced(self) -> Any:
        return self._quiet() if self._quiet else _Null()

    # -- a new key: export, passes, build, session ---------------------------------------------
    def _compile(
        self,
        key: GraphKey,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        flat: Sequence[torch.Tensor],
        device: torch.device,
    ) -> CompiledGraph:
        """One graph, stage by stage: export -> post-export passes -> batch passes (they see
        this batch) -> gradient build -> session -> bindings of the module's tensors."""
        times = PhaseTimer()
        _check_param_dtypes(self.module, device)
        cfg = self.config
        # each graph saves under its own version: a re-export keeps the earlier files
        save = cfg.save.next_version(self.module.training) if cfg.save else None
        with times.phase("export"), self._silenced(), contextlib.ExitStack() as around:
            for hook in step_hooks():
                around.enter_context(hook.exporting(self.step))
            exported = self._export(key, args, kwargs, save)
            run_post_export_passes(exported, dict(cfg.pass_options))
            self._batch_passes(exported, key, flat)
        if exported.from_cache:
            logger.info("export skipped: loaded from the export cache %s", cfg.cache_dir)
        else:
            self.exports += 1
        with times.phase("graph build"), self._silenced():
            built = _build_graph(exported, self._graph_config(exported, key, flat, device, save))
        if self.cache is not None and exported.cache_key:
            # the gradient build's measurements (the engine's GELU gradients) go with the
            # graph, so a warm start does not take them again
            self.cache.store_decisions(exported.cache_key, exported)
        session, context = self._session(exported, built, key, flat, device, save, times)
        compiled = self._bind(key, exported, built, session, context, flat, device, times)
        self.last_times = times
        log_initialisation_summary(times, logger)
        return compiled

    def _export(
        self,
        key: GraphKey,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        save: SaveOptions | None,
    ) -> ExportedModel:
        """Stage 1: the module's ONNX graph (from the export cache when it holds it)."""
        cfg = self.config
        return export(
            self.module,
            args,
            kwargs,
            training=self.module.training,
            opset=cfg.opset,
            config=cfg.export_config,
            static_shapes=cfg.static_shapes,
            deepcopy=cfg.deepcopy,
            # a graph for a guard's new value: the entry (keyed without guard values)
            # holds the graph whose guard just failed, so the cache is left out
            cache=None if key.guards else self.cache,
            save=save,
            verbose=cfg.exporter_verbose,
        )

    def _batch_passes(
        self, exported: ExportedModel, key: GraphKey, flat: Sequence[torch.Tensor]
    ) -> None:
        """Stage 3: the passes that read this batch's values (``run_batch_passes``: padding
        elimination, labelled rows and label sparsity are registered there)."""
        cfg = self.config
        names = list(exported.input_schema.names)
        batch = {name: flat[i] for i, name in enumerate(names)}
        state = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}
        context = BatchContext(
            training=key.build_gradient,
            sparsity=SparsityConfig(
                label=cfg.label_sparsity,
                print_density=cfg.print_input_density,
                padding=cfg.padding_elimination,
            ),
            export_config=cfg.export_config or ExportConfig.from_switches(cfg.opset),
        )
        run_batch_passes(exported, {**state, **batch}, context)

    def _graph_config(
        self,
        exported: ExportedModel,
        key: GraphKey,
        flat: Sequence[torch.Tensor],
        device: torch.device,
        save: SaveOptions | None,
    ) -> GraphConfig:
        """Stage 4's settings: what to differentiate, and the engine's build options."""
        cfg = self.config
        index_of = {n: i for i, n in enumerate(exported.input_schema.names)}
        params = dict(self.module.named_parameters())
        trainable = tuple(
            n for n in exported.param_names if n in params and params[n].requires_grad
        )
        input_grads = tuple(
            n
            for n in exported.user_input_names
            if flat[index_of[n]].requires_grad and flat[index_of[n]].is_floating_point()
        )
        # inputs added by post-export passes (e.g. the gradient trigger of ortmodule-memory)
        input_grads += tuple(n for n, e in exported.extra_inputs.items() if e.requires_grad)
        static = None
        if cfg.static_shapes:
            static = tuple(tuple(flat[index_of[n]].shape) for n in exported.user_input_names)
        return GraphConfig(
            build_gradient=key.build_gradient,
            params_to_train=trainable,
            inputs_require_grad=input_grads,
            broadcast_grad_inputs=tuple(
                n for n in input_grads if n in index_of and 1 in flat[index_of[n]].shape
            ),
            static_input_shapes=static,
            save=save,
            device_type=device.type,
            **{field: getattr(cfg, option) for field, option in _GRAPH_FIELDS_FROM_OPTIONS},
        )

    def _session(
        self,
        exported: ExportedModel,
        built: BuiltGraph,
        key: GraphKey,
        flat: Sequence[torch.Tensor],
        device: torch.device,
        save: SaveOptions | None,
        times: PhaseTimer,
    ) -> tuple[TrainingSession | InferenceSession, SessionContext | None]:
        """Stage 5: the engine session, with what components contribute to it."""
        cfg = self.config
        index_of = {n: i for i, n in enumerate(exported.input_schema.names)}
        context = None
        contribution = None
        if step_hooks() or has_session_contributors():
            context = SessionContext(
                model=onnx.load_from_string(built.model_bytes),
                training=key.build_gradient,
                device=device,
                options=self.step.options,
                input_shapes={name: tuple(flat[i].shape) for name, i in index_of.items()},
                built=built,
            )
            # contributors may create engine sessions of their own (the recompute probe): their
            # engine output is held back like the real session's
            with self._silenced():
                contribution = session_contribution(context)
        products_on_torch = routes_products(built.model_bytes)
        session_config = SessionConfig(
            device=device,
            intra_op_threads=torch.get_num_threads(),
            deterministic=torch.are_deterministic_algorithms_enabled(),
            log_severity=cfg.engine_log_severity,
            conv_algo_search=cfg.conv_algo_search,
            torch_threads=cfg.torch_threads_in_engine
            if runs_torch(exported.model) or products_on_torch
            else 0,
            external_allocator=_torch_allocator(device),
            optimized_model_path=save.file_path("execution", exported.training) if save else None,
            memory_efficient_order=bool(contribution and contribution.memory_efficient_order),
            config_entries=tuple(contribution.config_entries.items()) if contribution else (),
            cpu_arena=_cpu_arena(
                cfg.cpu_mem_arena,
                contribution,
                products_on_torch,
                sum(p.numel() * p.element_size() for p in self.module.parameters()),
            ),
        )
        with times.phase("session creation"), self._silenced():
            session: TrainingSession | InferenceSession = (
                TrainingSession(built, session_config)
                if key.build_gradient
                else InferenceSession(built, session_config)
            )
        return session, context

    def _bind(
        self,
        key: GraphKey,
        exported: ExportedModel,
        built: BuiltGraph,
        session: TrainingSession | InferenceSession,
        context: SessionContext | None,
        flat: Sequence[torch.Tensor],
        device: torch.device,
        times: PhaseTimer,
    ) -> CompiledGraph:
        """Stage 6: where each feed comes from and each output goes (inputs, the module's
        parameters and buffers, written inputs and buffers, guards, gradients)."""
        index_of = {n: i for i, n in enumerate(exported.input_schema.names)}
        extra = dict(exported.extra_inputs)
        # Inputs and buffers the graph writes are fed as copies: the write lands in the user's
        # tensor after the forward, and the engine's backward may read its feed again (a
        # recomputed node does: `self.count += 1; y * self.count` under
        # ORTMODULE_MEMORY_OPT_LEVEL=1 recomputed the sum from the written count, gradients
        # 4/3 to 2 times eager's), and a run dropped for a failed guard leaves them as they were
        written_inputs = set(exported.input_writes.values())
        written_buffers = set(exported.buffer_updates.values())
        feeds: list[tuple[str, Any]] = []
        for name in built.feed_names:
            if name in index_of:
                kind = "written input" if name in written_inputs else "input"
                feeds.append((kind, index_of[name]))
            elif name in extra:
                feeds.append(("extra", (extra[name], device)))
            else:
                owner, attr = _owner(self.module, name)
                table = next((t for t in (owner._parameters, owner._buffers) if attr in t), None)
                kind = "written buffer" if name in written_buffers else "param"
                feeds.append((kind, (owner, attr, table)))
        output_names = list(built.user_output_names)
        n_user = len(exported.user_output_names)
        updates = []
        for out_name, buffer in exported.buffer_updates.items():
            if out_name in output_names:
                owner, attr = _owner(self.module, buffer)
                count_name, momentum = exported.variance_updates.get(out_name, ("", 0.0))
                count_index = output_names.index(count_name) if count_name in output_names else -1
                updates.append(
                    BufferUpdate(output_names.index(out_name), owner, attr, count_index, momentum)
                )
        input_writes = [
            (output_names.index(out_name), index_of[name])
            for out_name, name in exported.input_writes.items()
        ]
        guards = [(output_names.index(out_name), guard) for out_name, guard in exported.guards]
        shape_guards = list(exported.shape_guards)
        shape_inputs = {name: index_of[name] for g in shape_guards for name in sorted(g.inputs)}
        position = {name: j for j, name in enumerate(built.fetch_names)}
        grad_by_input = {target: position[fetch] for fetch, target in built.grad_of.items()}
        grad_index = [grad_by_input.get(name, -1) for name in built.feed_names]
        if context is not None:
            info = SessionInfo(context=context, session=session, built=built)
            # hooks ask the engine about the session (the opportunity table): its native output
            # is held back like the session creation's
            with self._silenced():
                for hook in step_hooks():
                    hook.on_session(self.step, info)
        return CompiledGraph(
            key=key,
            built=built,
            session=session,
            feeds=feeds,
            output_count=n_user,
            buffer_updates=updates,
            input_writes=input_writes,
            guards=guards,
            copied_outputs=_viewed_outputs(built) if key.build_gradient else frozenset(),
            shape_guards=shape_guards,
            shape_inputs=shape_inputs,
            times=times,
            grad_index=grad_index,
            without_grad=built.non_differentiable_outputs | exported.outputs_without_grad,
        )


def _check_param_dtypes(module: torch.nn.Module, device: torch.device) -> None:
    for name, p in (*module.named_parameters(), *module.named_buffers()):
        if p.is_floating_point() and p.dtype not in SUPPORTED_PARAM_DTYPES[device.type]:
            raise UnsupportedDataError(
                f"parameter '{name}' has dtype {p.dtype}, which the engine cannot train on {device.type}; "
                f"use one of {SUPPORTED_PARAM_DTYPES[device.type]}"
            )


#: engine kernels whose output is a view of their input's buffer
_VIEW_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})
#: engine kernels whose output may share its input's buffer: views, and CPU kernels that may
#: run in place (each found to hand back an overwritten output, see :func:`_viewed_outputs`)
_ALIASING_OPS = frozenset(
    {
        *_VIEW_OPS,
        *("Relu", "Tanh", "Sigmoid", "Clip", "Softmax", "LogSoftmax", "Trilu"),
        *("LeakyRelu", "Elu", "Selu", "Softplus", "Softsign", "HardSigmoid", "ThresholdedRelu"),
        # writes into its data input's buffer: the torch_export frontend's in-place writes
        # (``t = tanh(x).clone(); t[..., 0] = 0.25`` returned with ``t * w``)
        *("ScatterElements", "ScatterND", "Scatter"),
    }
)


def _viewed_outputs(built: BuiltGraph) -> frozenset[int]:
    """Forward outputs the engine may compute in the buffer of a value of its own: a view
    (``Reshape``, ``Unsqueeze``, ... of an intermediate) or a kernel that may run in place.

    Engine bug (1.19.2): the memory planner frees such a buffer after its last reader in the
    graph, though the output that shares it is handed to PyTorch at the end of the forward,
    and gives it to a backward value: ``kept = op(x * 2)`` returned beside a loss that reads it
    held a gradient after ``backward()`` for ``unsqueeze``, ``reshape``, ``flatten``, ``relu``,
    ``tanh``, ``sigmoid``, ``clamp``, ``softmax``, ``log_softmax``, ``leaky_relu`` and ``tril``
    (found by the differential fuzzer; ``neg``, ``exp``, ``abs``, ``gelu``, ``elu``, ``+``,
    ``*`` and ``where`` were right), and on the torch_export frontend for an indexed write
    (``ScatterElements``; fuzz seed 45140: values of 1e32 after ``backward()``). Such an
    output is copied before it is handed back. One computed from a graph input alone (a
    parameter, the user's tensor) is not: that buffer is never the engine's to reuse.
    """
    model = built.model
    producer = {o: n for n in model.graph.node for o in n.output if o}
    inputs = {vi.name for vi in model.graph.input}
    found = set()
    for index, name in enumerate(built.user_output_names):
        if _shares_an_engine_buffer(name, producer, inputs):
            found.add(index)
    return frozenset(found)


def _shares_an_engine_buffer(
    name: str, producer: Mapping[str, onnx.NodeProto], inputs: Collection[str]
) -> bool:
    """Whether graph output ``name`` may share its buffer with another value of the engine's:
    up through views, an in-place-capable kernel reading an intermediate (it may write into
    that buffer) or making a value the views read; not a view of a graph input, nor a kernel
    reading a graph input whose result is the output itself (the engine never writes into a
    graph input, so that result has a buffer of its own)."""
    value, node = name, producer.get(name)
    while node is not None and node.op_type in _ALIASING_OPS:
        source = node.input[0]
        if node.op_type not in _VIEW_OPS:
            return source not in inputs or value != name
        if source in inputs:
            return False
        value, node = source, producer.get(source)
    return value != name


_FOLDED_GUARD = re.compile(r"(guard\.\d+): couldn't find the producer node")


def _build_graph(exported: ExportedModel, config: GraphConfig) -> BuiltGraph:
    """``build_graph``, without the guard outputs the engine folded into constants.

    The engine's optimizer folds a value it can compute from fixed sizes into an initializer,
    and its gradient builder then refuses a graph output no node produces. Such a guard can
    never change, so it is dropped. The builder names one such output per failed build; at the
    first, the forward graph the engine optimized before its gradient builder failed shows them
    all, so a model with a folded guard per layer builds three times, not once per layer (the
    zoo GPT at d 1024 and 13 layers at ORTMODULE_LOG_LEVEL=INFO: graph build 31 s before).
    """
    probed = False
    while True:
        try:
            return build_graph(exported, config)
        except EngineBuildError as err:
            found = _FOLDED_GUARD.search(str(err))
            names = {name for name, _ in exported.guards}
            if found is None or found.group(1) not in names:
                raise
            folded = {found.group(1)}
            if not probed:
                probed = True
                folded |= _folded_outputs(exported, config) & names
            logger.debug("guards %s are constants in the built graph: dropped", sorted(folded))
            exported.guards = tuple((n, g) for n, g in exported.guards if n not in folded)
            kept = [vi for vi in exported.model.graph.output if vi.name not in folded]
            del exported.model.graph.output[:]
            exported.model.graph.output.extend(kept)


def _folded_outputs(exported: ExportedModel, config: GraphConfig) -> set[str]:
    """The graph outputs no node produces in the forward graph the engine optimized for its
    gradient build (it writes that graph before the gradient builder runs); empty when it wrote
    none. Built without the compute optimizer, as the failed build's last attempt, which wrote
    the file there too, was: its earlier attempts need not run again."""
    with tempfile.TemporaryDirectory(prefix="ortmodule-folded-") as folder:
        save = SaveOptions(folder)
        probe = dataclasses.replace(config, save=save, enable_compute_optimizer=False)
        with contextlib.suppress(EngineBuildError):
            build_graph(exported, probe)
        path = save.file_path("pre_gradient", exported.training)
        if not os.path.exists(path):
            return set()
        graph = onnx.load(path, load_external_data=False).graph
    produced = {o for n in graph.node for o in n.output}
    return {vi.name for vi in graph.output if vi.name not in produced}


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _torch_allocator(device: torch.device) -> tuple[int, int, int] | None:
    """Addresses of alloc/free/empty_cache callbacks into PyTorch's caching allocator.

    Made with ctypes, so nothing is compiled: the engine then allocates CUDA memory from the
    same pool as PyTorch instead of holding a second arena.
    """
    if device.type != "cuda":
        return None
    from . import cuda_allocator

    return cuda_allocator.addresses()
