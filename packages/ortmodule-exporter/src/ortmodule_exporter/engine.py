"""The engine boundary: gradient-graph build, sessions, and tensors across by DLPack.

Everything here talks to ONNX Runtime's C++ training API through
``onnxruntime.capi._pybind_state``; onnxruntime is imported on first use, so importing the
exporter does not load the engine.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx
import torch
from torch._C import _from_dlpack
from torch.utils.dlpack import to_dlpack

from . import named_dims, onnx_graph
from .aten import executor as aten_executor
from .aten.executor import ATEN_DOMAIN, UnsupportedAtenOperatorError, aten_operator
from .aten.gradients import install_gradients, stop_gradient_edges
from .aten.kernel_choice import adds_output_grad
from .aten.output_shapes import output_shape_rules
from .aten.parallel import THREADS_AUTO, ThreadTrial, TorchThreadsInEngine
from .aten.topk import TOPK_INDICES
from .callback_errors import user_errors
from .engine_binding import _C, import_onnxruntime
from .engine_random import draws_random, seed_engine, seed_engine_at_build
from .errors import EngineBuildError
from .export.model import ExportedModel, SaveOptions
from .forked import EngineCrashed, run_forked
from .heap import release_free_pages
from .onnx_graph import output_dependencies
from .passes.built_graph import run_built_graph_passes
from .python_op import runner as python_op_runner
from .sparsity import density

logger = logging.getLogger("ortmodule.engine")


# -- the build -------------------------------------------------------------------------------


@dataclass(frozen=True)
class GraphConfig:
    """What the engine needs to build one graph; the runtime fills it from its options."""

    build_gradient: bool
    params_to_train: tuple[str, ...] = ()
    inputs_require_grad: tuple[str, ...] = ()
    enable_compute_optimizer: bool = True
    print_input_density: bool = False
    use_memory_efficient_gradient: bool = False
    log_severity: int = 3  # the engine's scale: 0 verbose .. 4 fatal
    static_input_shapes: tuple[tuple[int, ...], ...] | None = None
    save: SaveOptions | None = None
    #: keys into TrainingGraphTransformerConfiguration (memory optimizer, recompute)
    transformer_options: tuple[tuple[str, Any], ...] = ()
    #: where the built graph runs ("cpu", "cuda"): built-graph passes that time CPU kernels
    #: (passes/row_sums.py) act on CPU graphs only
    device_type: str = "cpu"
    #: inputs that require grad with a dim of size 1 on this call (broadcast candidates): the
    #: graph is then built without named dims (see ``build_graph``)
    broadcast_grad_inputs: tuple[str, ...] = ()
    #: build in a forked child (Linux), so an engine crash is an EngineBuildError (forked.py)
    build_in_child: bool = True


#: a child build that has not answered by then is abandoned and the graph built in-process
_CHILD_BUILD_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class _BuilderOutput:
    """What ``build_graph`` reads from an ``OrtModuleGraphBuilder``, as plain (picklable) data."""

    model_bytes: bytes
    user_output_names: list[str]
    output_grad_indices_non_differentiable: list[int]
    frontier_count: int
    initializer_names_to_train: list[str]
    initializer_grad_names_to_train: list[str]
    user_input_grad_names: dict[str, str]

    @classmethod
    def of(cls, builder: Any, gradient: bool) -> _BuilderOutput:
        info = builder.get_graph_info()
        return cls(
            model_bytes=builder.get_gradient_model() if gradient else builder.get_forward_model(),
            user_output_names=list(info.user_output_names),
            output_grad_indices_non_differentiable=list(
                info.output_grad_indices_non_differentiable
            ),
            frontier_count=len(info.frontier_node_arg_map),
            initializer_names_to_train=list(info.initializer_names_to_train),
            initializer_grad_names_to_train=list(info.initializer_grad_names_to_train),
            user_input_grad_names=dict(info.user_input_grad_names),
        )


@dataclass
class BuiltGraph:
    """A graph the engine has built: the training (gradient) or the inference model."""

    exported: ExportedModel
    config: GraphConfig
    model_bytes: bytes
    feed_names: list[str]
    fetch_names: list[str]
    user_output_names: list[str]
    non_differentiable_outputs: frozenset[int]
    #: backward fetch name -> graph input name it is the gradient of
    grad_of: dict[str, str] = field(default_factory=dict)
    frontier_count: int = 0
    #: per user output, the graph inputs it depends on (gradients of the others are None in eager)
    output_dependencies: list[frozenset[str]] = field(default_factory=list)
    #: user outputs whose gradient may be fed as a 0-d zero when autograd has none (see
    #: :func:`summed_output_grads`)
    summed_output_grads: frozenset[int] = frozenset()

    @property
    def model(self) -> onnx.ModelProto:
        return onnx.load_from_string(self.model_bytes)


def _shaped_aten() -> frozenset[str]:
    """ATen operators whose output shapes symbolic shape inference computes: those with a
    shape rule (:mod:`ortmodule_exporter.aten.output_shapes`), the lookup's own ``embedding``
    (the inference's own rule) and top-k's indices (``named_dims.infer_symbolic_shapes``). For
    any other it would guess each output as its first input's shape and merge the guess with
    the dim it meets in a broadcasting op: wrong for an operator that reduces to a broadcast
    dim (``normalize``'s norm, 1 at run time), whose gradient then came back unreduced."""
    return frozenset({*output_shape_rules(), "embedding", TOPK_INDICES})


def _unshaped_nodes(model: onnx.ModelProto) -> set[str]:
    """Custom nodes whose output shapes symbolic inference would guess (see
    :func:`_shaped_aten`): ATen nodes of other operators, PythonOps."""
    shaped = _shaped_aten()
    unknown = set()
    for node in model.graph.node:
        if node.domain == ATEN_DOMAIN:
            name = str(onnx_graph.attribute(node, "operator", ""))
            if name not in shaped:
                unknown.add(f"ATen {name}")
        elif node.op_type == "PythonOp":
            unknown.add("PythonOp")
    return unknown


def _dims(value: onnx.ValueInfoProto) -> list[str | int] | None:
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return [d.dim_param or d.dim_value for d in tensor.shape.dim]


def model_with_named_dims(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """``model`` with a symbolic dim on every tensor, for the gradient build; None when symbolic
    shape inference fails or would make a graph input's dynamic dim fixed.

    The engine's gradient builder can tell that both operands of an ``Add`` or ``Mul`` have the
    output's shape only from dims with the same name. The exporter names the graph inputs'
    dynamic dims, but ONNX shape inference loses the names behind ATen nodes and behind
    ``Reshape``s whose shape is computed at run time (``view(batch, seq, heads, dim)``), and the
    builder then reduces every such operand's gradient through ``Shape``,
    ``BroadcastGradientArgs`` and a ``ReduceSum`` that copies when nothing is broadcast (85
    ``ReduceSum`` nodes in the tiny Llama's training graph, 1 with named dims). A graph input
    whose dynamic dim the inference would make fixed keeps the graph as exported: the engine
    would then check fed shapes against it. Two inputs' dims made one (a broadcast of equal
    sizes) keep the inputs' exported names and the values' inferred ones.
    """
    unknown = _unshaped_nodes(model)
    if unknown:
        logger.info(
            "building the graph as exported, without named dims: symbolic shape inference would "
            "guess the output shapes of %s",
            ", ".join(sorted(unknown)),
        )
        return None
    try:
        named = named_dims.infer_symbolic_shapes(model)
    except Exception as err:  # noqa: BLE001 - named dims only make the graph faster
        logger.info(
            "symbolic shape inference failed (%s: %s); building the graph as exported",
            type(err).__name__,
            err,
        )
        return None

    changed = [
        (vi, exported)
        for vi, exported in zip(named.graph.input, model.graph.input, strict=True)
        if _dims(vi) != _dims(exported)
    ]
    if any(_fixes_a_dim(vi, exported) for vi, exported in changed):
        logger.info(
            "symbolic shape inference made a dynamic dim of a graph input fixed; building the "
            "graph as exported"
        )
        return None
    # inputs' dims made one (x (b, n) * w (m,): n and m named alike): the inputs keep the names
    # they were exported with, so the engine checks fed shapes against those, and the values
    # below them keep the inferred names, which the builder needs for the gradient of the
    # broadcast (a build of the graph as exported failed there: "GetShape(input_grad)")
    for vi, exported in changed:
        vi.CopyFrom(exported)
    return named


def _fixes_a_dim(inferred: onnx.ValueInfoProto, exported: onnx.ValueInfoProto) -> bool:
    """Whether shape inference changed ``exported``'s dims other than by renaming dynamic ones."""
    before, after = _dims(exported), _dims(inferred)
    if before is None or after is None:
        return before != after
    return len(before) != len(after) or any(
        isinstance(a, int) != isinstance(b, int) or (isinstance(a, int) and a != b)
        for a, b in zip(before, after, strict=True)
    )


def _outputs_kept(named: onnx.ModelProto, builder: Any) -> bool:
    """Every user output of the built gradient graph has the rank and dims the named forward
    graph declares for it.

    Engine workaround: with named dims, the engine's compute optimizer (1.19.2) can move a
    ``Slice`` and ``Reshape`` that feed the loss above the ``MatMul`` whose output is also a
    user output, which then comes back sliced and flattened (the zoo GPT's logits: (60, 128)
    instead of (4, 16, 128)). Such a graph is not used.
    """
    built = onnx.load_from_string(builder.get_gradient_model())
    declared = {
        vi.name: _dims(vi)
        for vi in (*built.graph.value_info, *built.graph.output, *built.graph.input)
    }
    for output in named.graph.output:
        want, got = _dims(output), declared.get(output.name)
        if want is None or got is None:
            continue
        if len(want) != len(got):
            return False
        for a, b in zip(want, got, strict=True):
            if type(a) is type(b) and a and b and a != b:
                return False
    return True


def _build_named(
    named: onnx.ModelProto, run_builder: Callable[[onnx.ModelProto], Any], transformer: Any
) -> Any:
    """The engine's builder for the graph with named dims, or None (build it as exported) when
    the engine refuses it or a user output's shape changes in it (:func:`_outputs_kept`; with
    the compute optimizer on, it is first tried once more without)."""
    with_optimizer = transformer.enable_compute_optimizer
    try:
        builder = run_builder(named)
        if _outputs_kept(named, builder):
            return builder
        if with_optimizer:
            logger.info(
                "the engine's compute optimizer changed a user output's shape on the graph with "
                "named dims; building it without the compute optimizer"
            )
            transformer.enable_compute_optimizer = False
            try:
                builder = run_builder(named)
            finally:
                transformer.enable_compute_optimizer = with_optimizer
            if _outputs_kept(named, builder):
                return builder
        logger.info(
            "a user output's shape changed in the engine's build; building the graph as exported"
        )
    except RuntimeError as err:
        logger.info(
            "the engine could not build this graph with named dims (%s); building it as exported",
            err,
        )
    return None


#: the engine's build errors on an ATen node it can neither differentiate nor type
_UNTYPED_ATEN_MESSAGES = ("gradient builder has not been registered: ATen", "type inference failed")


def _pytorch_operator(node: onnx.NodeProto) -> str:
    """`` (aten::_grouped_mm.default)``: the PyTorch operator an ATen node, or a PythonOp
    running one, calls ("" for other nodes). An ATen node's empty overload is resolved as the
    executor resolves it (by argument count)."""
    attrs = {a.name: a for a in node.attribute}
    if node.domain == ATEN_DOMAIN and "operator" in attrs:
        operator = attrs["operator"].s.decode()
        overload = attrs["overload_name"].s.decode() if "overload_name" in attrs else ""
        if operator.startswith("_ortmodule"):  # one of ours (aten.executor.register_aten_function)
            return f" ({operator}{'.' + overload if overload else ''})"
        try:
            overload = aten_operator(operator, overload, len(node.input)).overload
        except UnsupportedAtenOperatorError:
            pass
        return f" (aten::{operator}.{overload or 'default'})"
    comment = attrs["comment"].s.decode() if "comment" in attrs else ""
    return f" ({comment})" if node.op_type == "PythonOp" and comment.startswith("aten::") else ""


def _aten_stop_edges(node: onnx.NodeProto) -> frozenset[int]:
    """The inputs of an ATen node registered as never differentiated (none for other nodes)."""
    if node.op_type != "ATen" or node.domain != ATEN_DOMAIN:
        return frozenset()
    return stop_gradient_edges(
        onnx_graph.attribute(node, "operator", ""), onnx_graph.attribute(node, "overload_name", "")
    )


def build_graph(exported: ExportedModel, config: GraphConfig) -> BuiltGraph:
    """Run ``OrtModuleGraphBuilder`` on an exported model.

    With ``config.build_gradient`` the result is the gradient model: forward feeds are the graph
    inputs, forward fetches the user outputs, backward fetches the gradients of
    ``inputs_require_grad`` then ``params_to_train``.
    """
    C = _C()
    if config.build_gradient:
        # the ATen nodes' gradient definitions (routed operators, kernel choices): given to the
        # engine here too, for builds that do not come through ORTModule (idempotent)
        install_gradients()
    builder_config = C.OrtModuleGraphBuilderConfiguration()
    builder_config.initializer_names = list(exported.param_names)
    # The engine refuses a name no output's gradient reaches ("Cannot compute the partial
    # derivative for 'w' as it's unreachable from the output node(s)"): a weight that only
    # picks TopK's indices, as a sparse-attention indexer does. Eager leaves its grad None; so
    # does the runtime for a name the graph gives no gradient.
    reached = (
        onnx_graph.differentiable_inputs(
            exported.model,
            [*config.params_to_train, *config.inputs_require_grad],
            _aten_stop_edges,
        )
        if config.build_gradient
        else set()
    )
    builder_config.initializer_names_to_train = [n for n in config.params_to_train if n in reached]
    builder_config.input_names_require_grad = [
        n for n in config.inputs_require_grad if n in reached
    ]
    builder_config.build_gradient_graph = config.build_gradient
    builder_config.enable_caching = False
    builder_config.loglevel = (
        C.Severity(config.log_severity) if hasattr(C, "Severity") else config.log_severity
    )
    builder_config.use_memory_efficient_gradient = config.use_memory_efficient_gradient

    transformer = C.TrainingGraphTransformerConfiguration()
    transformer.propagate_cast_ops_config = C.PropagateCastOpsConfiguration()
    transformer.enable_compute_optimizer = config.enable_compute_optimizer
    transformer.print_input_density = config.print_input_density
    for key, value in config.transformer_options:
        setattr(transformer, key, value)
    if config.save is not None:
        os.makedirs(config.save.path, exist_ok=True)
        transformer.optimized_pre_grad_filepath = config.save.file_path(
            "pre_gradient", exported.training
        )

    def run_builder(model: onnx.ModelProto) -> Any:
        builder = C.OrtModuleGraphBuilder()
        builder.initialize(model.SerializeToString(), builder_config)
        if config.static_input_shapes is not None:
            builder.build(transformer, [list(s) for s in config.static_input_shapes])
        else:
            builder.build(transformer)
        return builder

    onnx_graph.name_unnamed_nodes(exported.model.graph)
    named = None
    if config.build_gradient and config.broadcast_grad_inputs:
        # symbolic shape inference takes a dynamic dim broadcast against another for equal to it
        # (it cannot know the dim is 1 on this call), and the builder then drops the reduction
        # of that input's gradient: x (2, 1) requiring grad, gelu(tanh(x)).expand(-1, 2), had
        # x.grad wrong (found by the differential fuzzer). Such a graph is built as exported.
        # (Exporting those dims as fixed 1 instead made the builder fail on Mul's gradient,
        # whose operand shape it then needs and does not have.)
        logger.info(
            "building the graph as exported, without named dims: inputs that require grad "
            "have a dim of size 1 (%s)",
            ", ".join(config.broadcast_grad_inputs),
        )
    elif config.build_gradient:
        named = model_with_named_dims(exported.model)

    def build() -> _BuilderOutput:
        try:
            builder = None if named is None else _build_named(named, run_builder, transformer)
            if builder is None:
                builder = run_builder(exported.model)
        except RuntimeError as err:
            if not config.enable_compute_optimizer:
                raise
            # The compute optimizer has shape-inference gaps (UpStreamGather on a sliced dynamic
            # dim, e.g. logits[:, :-1]); the graph is correct without it, only slower.
            logger.info(
                "the engine's compute optimizer failed on this graph (%s); building without it", err
            )
            transformer.enable_compute_optimizer = False
            model = exported.model
            if density.density_flags(model):
                # nothing acts on a label-density flag now: drop the ones that do not print
                model = onnx.ModelProto()
                model.CopyFrom(exported.model)
                density.strip_density_flags(model, keep_printing=True)
            builder = run_builder(model)
        return _BuilderOutput.of(builder, config.build_gradient)

    what = "gradient" if config.build_gradient else "inference"
    try:
        # Some graphs make the engine's build segfault or abort instead of failing (issue #42);
        # in a child process that is an error here, and the fallback policy decides.
        info = run_forked(build, _CHILD_BUILD_TIMEOUT_S) if config.build_in_child else build()
    except EngineCrashed as crash:
        raise EngineBuildError(
            f"{crash} while building the {what} graph (in a child process, so this one lives "
            "on). The module runs in PyTorch where the fallback policy allows it "
            "(FALLBACK_UNSUPPORTED_ONNX_MODEL); please report the model, "
            "DebugOptions(save_onnx=True) saves its exported graph"
        ) from crash
    except Exception as err:
        where = onnx_graph.node_location(str(err), exported.model.graph, _pytorch_operator)
        hint = ""
        if "(aten::" in where and any(m in str(err) for m in _UNTYPED_ATEN_MESSAGES):
            hint = (
                "\nThe engine has neither a gradient nor output types for that PyTorch operator; "
                "the ATen pass makes such a node a PythonOp when it knows its output types "
                "(recorded at export, else found by running the operator on the meta device). "
                "Give it a gradient with ortmodule_exporter.aten.gradients.register_aten_gradient, "
                "or report the model (DebugOptions(save_onnx=True) saves the exported graph)."
            )
        raise EngineBuildError(
            f"the engine could not build the {what} graph{where}: {err}{hint}"
        ) from err
    # under the export's settings: a pass may make a kernel choice (passes/row_sums.py)
    with exported.config.applied():
        model_bytes = run_built_graph_passes(info.model_bytes, config)
    model = onnx.load_from_string(model_bytes)
    if config.save is not None:
        stage = "gradient" if config.build_gradient else "built"
        onnx.save_model(model, config.save.file_path(stage, exported.training))
    feed_names = [vi.name for vi in model.graph.input]
    fetch_names = [vi.name for vi in model.graph.output]
    grad_of: dict[str, str] = {}
    if config.build_gradient:
        by_grad = dict(
            zip(info.initializer_grad_names_to_train, info.initializer_names_to_train, strict=True)
        )
        by_grad.update({g: n for n, g in info.user_input_grad_names.items()})
        grad_of = {name: by_grad[name] for name in fetch_names if name in by_grad}
    return BuiltGraph(
        exported=exported,
        config=config,
        model_bytes=model_bytes,
        feed_names=feed_names,
        fetch_names=fetch_names,
        user_output_names=list(info.user_output_names),
        non_differentiable_outputs=frozenset(info.output_grad_indices_non_differentiable),
        grad_of=grad_of,
        frontier_count=info.frontier_count,
        output_dependencies=output_dependencies(exported.model, list(info.user_output_names)),
        summed_output_grads=summed_output_grads(model) if config.build_gradient else frozenset(),
    )


#: ONNX operators that broadcast every input to the output's shape
_BROADCAST_SUMS = frozenset({"Sum", "Add"})


def summed_output_grads(model: onnx.ModelProto) -> frozenset[int]:
    """The user outputs whose gradient the backward half only adds to another gradient.

    An output the graph also reads itself (the logits a causal LM's loss is computed from)
    gets its gradient inside the graph, and the engine's builder adds the gradient autograd
    hands in to that one with a broadcasting ``Sum``. Where autograd has no gradient for such
    an output (the user did not use the logits), a 0-d zero gives the same sum as a full-shape
    one, without allocating and reading a tensor of the output's size (206 MB for GPT-2's
    logits at batch 4 x 256). The builder says so itself: ``YieldOp``'s ``full_shape_outputs``
    lists the outputs that need the full shape, and its kernel checks only those. This also
    checks every reader of each other gradient in the final graph (after the built-graph
    passes) and keeps the full shape where one is not a ``Sum``/``Add`` (or a loss gradient
    that adds it itself, ``passes/output_grad_sums.py``: ``adds_output_grad``).
    """
    yield_node = next((n for n in model.graph.node if n.op_type == "YieldOp"), None)
    if yield_node is None:
        return frozenset()
    full = onnx_graph.attribute(yield_node, "full_shape_outputs")
    if full is None:
        return frozenset()
    non_diff = set(onnx_graph.attribute(yield_node, "non_differentiable_outputs", []))
    differentiable = [i for i in range(len(yield_node.input)) if i not in non_diff]
    _, readers = onnx_graph.producers_and_consumers(model.graph)
    graph_outputs = {vi.name for vi in model.graph.output}
    return frozenset(
        i
        # one YieldOp output per differentiable input (the engine's kernel enforces it)
        for i, grad in zip(differentiable, yield_node.output, strict=True)
        if i not in full
        and grad not in graph_outputs
        and readers.get(grad)
        and all(
            (n.op_type in _BROADCAST_SUMS and n.domain in ("", "ai.onnx")) or adds_output_grad(n)
            for n in readers[grad]
        )
    )


# -- sessions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionConfig:
    """How to create the engine session; the runtime fills it from its options."""

    device: torch.device = torch.device("cpu")
    intra_op_threads: int = 0
    deterministic: bool = False
    log_severity: int = 3
    memory_efficient_order: bool = False
    conv_algo_search: str = "HEURISTIC"
    external_allocator: tuple[int, int, int] | None = None  # alloc, free, empty_cache addresses
    optimized_model_path: str | None = None
    extra_provider_options: tuple[tuple[str, str], ...] = ()
    #: ``add_session_config_entry`` pairs from component session contributors
    config_entries: tuple[tuple[str, str], ...] = ()
    #: PyTorch's intra-op threads while a run is in the engine (0: PyTorch's setting stays;
    #: ``THREADS_AUTO``: 1 or PyTorch's count, whichever the graph's first steps ran faster at)
    torch_threads: int = 0
    #: False: on CPU the engine allocates without an arena (:func:`_plain_cpu_allocator`), so a
    #: run's memory goes back when it is freed; less resident memory between steps, and slower
    #: steps (6-22 % at a d512 GPT, benchmarks/results/2026-11-27-session-memory-amd-epyc-2c.md)
    cpu_arena: bool = True


def _providers(cfg: SessionConfig) -> tuple[list[str], list[dict[str, str]]]:
    if cfg.device.type == "cuda":
        opts = {
            "device_id": str(cfg.device.index or 0),
            "cudnn_conv_algo_search": cfg.conv_algo_search,
            "cudnn_conv_use_max_workspace": "1",
        }
        if cfg.external_allocator is not None:
            alloc, free, empty = cfg.external_allocator
            opts.update(
                gpu_external_alloc=str(alloc),
                gpu_external_free=str(free),
                gpu_external_empty_cache=str(empty),
            )
        opts.update(dict(cfg.extra_provider_options))
        return ["CUDAExecutionProvider", "CPUExecutionProvider"], [opts, {}]
    if cfg.device.type != "cpu":
        raise EngineBuildError(f"ORTModule runs on cpu and cuda devices, not {cfg.device}")
    return ["CPUExecutionProvider"], [{}]


#: whether this process registered the engine's shared CPU allocator (:func:`_plain_cpu_allocator`)
_cpu_allocator_registered = False


def _plain_cpu_allocator(onnxruntime: Any) -> bool:
    """Register, once a process, a CPU allocator without an arena in the engine's environment;
    sessions that set ``session.use_env_allocators`` then allocate from it. False where the
    engine refuses it.

    Workaround (onnxruntime-training 1.19.2): the training agent's partial runs allocate
    every intermediate and output from a BFC arena even with ``enable_cpu_mem_arena`` off
    (``BFCArena::Extend`` under ``ExecutionFrame::AllocateAsPerAllocationPlan``), and the arena
    keeps its regions, rounded up to powers of two, for the session's life: the peak of what a
    step held in the engine, 224 MiB of 128/64/32 MiB blocks for a 45M-parameter GPT at batch
    4 x 128 (1.3x the parameters' bytes; eager PyTorch hands those blocks back). The
    environment's allocator replaces the session's own, so nothing is kept between runs.
    Sessions without the config entry keep their own arena.
    """
    global _cpu_allocator_registered
    if _cpu_allocator_registered:
        return True
    info = onnxruntime.OrtMemoryInfo(
        "Cpu", onnxruntime.OrtAllocatorType.ORT_DEVICE_ALLOCATOR, 0, onnxruntime.OrtMemType.DEFAULT
    )
    try:
        onnxruntime.create_and_register_allocator(info, None)
    except Exception as err:  # one registered already (by the user): sessions keep their own
        logger.info("the engine's CPU allocator stays the session's: %s", err)
        return False
    _cpu_allocator_registered = True
    return True


def _session(model_bytes: bytes, cfg: SessionConfig) -> Any:
    onnxruntime = import_onnxruntime()
    if ATEN_DOMAIN.encode() in model_bytes:
        # the graph (or its opset list) names ATen nodes: the engine runs them through our
        # executor, registered here too for sessions made outside ORTModule (idempotent)
        aten_executor.install()

    so = onnxruntime.SessionOptions()
    # the partial-graph runs of training hand memory back and forth; patterns do not apply
    so.enable_mem_pattern = False
    so.enable_mem_reuse = False
    so.use_deterministic_compute = cfg.deterministic
    so.log_severity_level = cfg.log_severity
    so.intra_op_num_threads = cfg.intra_op_threads
    so.execution_order = (
        onnxruntime.ExecutionOrder.MEMORY_EFFICIENT
        if cfg.memory_efficient_order
        else onnxruntime.ExecutionOrder.DEFAULT
    )
    so.add_session_config_entry("session.disable_prepacking", "1")
    if cfg.device.type == "cpu":
        # Engine workers spin after each run; between runs PyTorch (autograd, the optimizer)
        # needs the same cores, and spinning starved it (AdamW 330-450 ms -> ~20 ms without).
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if not cfg.cpu_arena:
            so.enable_cpu_mem_arena = False
            if _plain_cpu_allocator(onnxruntime):
                so.add_session_config_entry("session.use_env_allocators", "1")
    for key, value in cfg.config_entries:
        so.add_session_config_entry(key, value)
    if cfg.optimized_model_path:
        so.optimized_model_filepath = cfg.optimized_model_path
    providers, provider_options = _providers(cfg)
    try:
        return onnxruntime.InferenceSession(
            model_bytes, so, providers=providers, provider_options=provider_options
        )
    except Exception as err:
        hint = ""
        if "NOT_IMPLEMENTED" in str(err):
            hint = (
                f"\nThe {cfg.device.type} engine has no kernel for this operator at these dtypes "
                "(float64 is partly covered on CPU; bfloat16 and float16 operators run PyTorch's "
                "kernels): train in float32 or under torch.autocast, or use the CUDA engine "
                "(ortmodule[cuda])."
            )
        raise EngineBuildError(f"the engine could not create a session: {err}{hint}") from err


def _ort_device(device: torch.device) -> Any:
    C = _C()
    if device.type == "cuda":
        return C.OrtDevice(C.OrtDevice.cuda(), C.OrtDevice.default_memory(), device.index or 0)
    return C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the engine's DLPack import takes it: no autograd, row-major strides."""
    if tensor.requires_grad:  # DLPack refuses tensors that require grad
        tensor = tensor.detach()
    if tensor.numel() == 0:
        # an empty tensor counts as contiguous for torch whatever its strides (the gradient of
        # an empty output is expanded, strides 0), and the engine rejects such strides
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _feeds(tensors: Sequence[torch.Tensor]) -> Any:
    """``tensors`` as the engine's ``OrtValueVector``, by DLPack (no copy where dense)."""
    vec = _C().OrtValueVector()
    vec.reserve(len(tensors))
    push = vec.push_back
    # every step passes here once per input and parameter: _dense's checks, inlined
    for t in tensors:
        if t.requires_grad:
            t = t.detach()
        if not t.is_contiguous() or not t.numel():
            t = _dense(t)
        if t.dtype is torch.bool:
            # DLPack has no bool in torch's exporter; the engine re-labels the uint8 buffer
            push(to_dlpack(t.view(torch.uint8)), True)
        else:
            push(to_dlpack(t), False)
    return vec


def _to_torch(vec: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = vec.to_dlpacks(_from_dlpack)
    for i in vec.bool_tensor_indices():
        out[i] = out[i].to(torch.bool)
    return out


def _thread_setting(
    cfg: SessionConfig, label: str
) -> tuple[TorchThreadsInEngine, ThreadTrial | None]:
    """The in-engine thread setting a session starts with, and its trial under ``auto``. No
    trial where PyTorch has one thread (both candidates are the same then) or where
    deterministic algorithms are on: the thread count changes how PyTorch's kernels sum, and a
    choice made by timing could differ from one run to the next."""
    if cfg.torch_threads != THREADS_AUTO:
        return TorchThreadsInEngine(cfg.torch_threads), None
    if torch.get_num_threads() < 2 or cfg.deterministic:
        return TorchThreadsInEngine(1), None
    trial = ThreadTrial(label)
    return trial.candidates[0], trial


def _run(threads: TorchThreadsInEngine, call: Callable[..., Any], *args: Any) -> None:
    """One engine call: a callback's exception replaces the engine's error, and PyTorch's
    thread count is set for it where the graph has PyTorch-run nodes (elsewhere the context
    is left out: it sits on every step's path and would set nothing)."""
    if threads.threads:
        with python_op_runner.in_engine(), user_errors(), threads:
            call(*args)
    else:
        with python_op_runner.in_engine(), user_errors():
            call(*args)


class _ThreadedRuns:
    """Engine calls at the session's in-engine thread setting, measured while a
    :class:`ThreadTrial` is choosing it (``ORTMODULE_TORCH_THREADS_IN_ENGINE=auto``)."""

    _threads: TorchThreadsInEngine
    _trial: ThreadTrial | None

    def _first_run(self, call: Callable[..., Any], *args: Any) -> None:
        """A step's first run (its forward): the step's setting is picked here, and its
        backward keeps it."""
        trial = self._trial
        if trial is None:
            _run(self._threads, call, *args)
            return
        self._threads = trial.next()
        if trial.chosen is not None:
            self._trial = None
        _timed_run(trial, self._threads, call, *args)

    def _later_run(self, call: Callable[..., Any], *args: Any) -> None:
        trial = self._trial
        if trial is None:
            _run(self._threads, call, *args)
        else:
            _timed_run(trial, self._threads, call, *args)


def _timed_run(
    trial: ThreadTrial, threads: TorchThreadsInEngine, call: Callable[..., Any], *args: Any
) -> None:
    """:func:`_run`, its wall time handed to the trial."""
    start = time.perf_counter()
    _run(threads, call, *args)
    trial.add(time.perf_counter() - start)


def _releases_heap_after_backward(cfg: SessionConfig) -> bool:
    """A CPU session without the arena: the heap pages its backward freed go back after it
    (:mod:`ortmodule_exporter.heap`)."""
    return cfg.device.type == "cpu" and not cfg.cpu_arena


class TrainingSession(_ThreadedRuns):
    """Forward and backward halves of a gradient graph through the engine's ``TrainingAgent``."""

    def __init__(self, built: BuiltGraph, cfg: SessionConfig) -> None:
        C = _C()
        self.built = built
        seed_engine_at_build()
        self._session = _session(built.model_bytes, cfg)
        self._threads, self._trial = _thread_setting(cfg, "training graph")
        self._release_after_backward = _releases_heap_after_backward(cfg)
        #: the device whose PyTorch generator seeds each run, or None: the graph draws nothing
        self._seed_device = cfg.device if draws_random(built.exported.model) else None
        device = _ort_device(cfg.device)
        n_fw = len(built.user_output_names) + built.frontier_count
        self._agent = C.TrainingAgent(
            self._session._sess,
            built.feed_names,
            [device] * n_fw,
            built.fetch_names,
            [device] * len(built.fetch_names),
            cfg.device.index or 0,
        )

    @property
    def agent(self) -> Any:
        """The engine's ``TrainingAgent`` (components read statistics from it)."""
        return self._agent

    def forward(self, feeds: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], ForwardState]:
        C = _C()
        if self._seed_device is not None:
            seed_engine(self._seed_device)
        # outside any run: the engine's pool may let go of forwards dropped without a backward
        python_op_runner.release_abandoned_contexts()
        state = C.PartialGraphExecutionState()
        outputs = C.OrtValueVector()
        with python_op_runner.kept_by_run() as kept:
            self._first_run(self._agent.run_forward, _feeds(feeds), outputs, state, None)
        return _to_torch(outputs), ForwardState(state, kept)

    def backward(
        self, grad_outputs: Sequence[torch.Tensor], state: ForwardState
    ) -> list[torch.Tensor]:
        outputs = _C().OrtValueVector()
        self._later_run(self._agent.run_backward, _feeds(grad_outputs), outputs, state.engine)
        if self._release_after_backward:
            # workaround: glibc keeps the freed activations resident in its heap
            # (heap.py); under ZeRO-2 at 106M parameters the step's peak 3411 -> 3253 MiB
            release_free_pages()
        return _to_torch(outputs)


@dataclass(frozen=True)
class ForwardState:
    """What a training forward hands its backward: the engine's partial execution state and
    the PythonOp contexts the run kept (freed with this object where no backward runs)."""

    engine: Any
    python_op_contexts: python_op_runner.RunContexts


class InferenceSession(_ThreadedRuns):
    """The inference graph, run with IO binding so inputs and outputs cross by DLPack."""

    def __init__(self, built: BuiltGraph, cfg: SessionConfig) -> None:
        self.built = built
        seed_engine_at_build()
        self._session = _session(built.model_bytes, cfg)
        self._device = cfg.device
        self._threads, self._trial = _thread_setting(cfg, "inference graph")
        self._seed_device = cfg.device if draws_random(built.exported.model) else None

    def forward(self, feeds: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        C = _C()
        if self._seed_device is not None:
            seed_engine(self._seed_device)
        binding = self._session.io_binding()._iobinding
        for name, tensor in zip(self.built.feed_names, feeds, strict=True):
            tensor = _dense(tensor)
            is_bool = tensor.dtype == torch.bool
            value = C.OrtValue.from_dlpack(
                to_dlpack(tensor.view(torch.uint8) if is_bool else tensor), is_bool
            )
            binding.bind_ortvalue_input(name, value)
        device = _ort_device(self._device)
        for name in self.built.fetch_names:
            binding.bind_output(name, device)
        self._first_run(self._session._sess.run_with_iobinding, binding, None)
        return _to_torch(binding.get_outputs())
