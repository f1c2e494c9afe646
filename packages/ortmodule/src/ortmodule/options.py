"""The one options object: defaults, then :class:`DebugOptions`, then ``ORTMODULE_*`` variables.

>>> from ortmodule.options import RuntimeOptions
>>> options = RuntimeOptions.resolve(environ={"ORTMODULE_ONNX_OPSET_VERSION": "15"})
>>> options.onnx_opset_version, options.source("onnx_opset_version"), options.source("cache_dir")
(15, 'environment', 'default')

The runtime declares its own ``ORTMODULE_*`` variables in :data:`RUNTIME_VARIABLES` (name, type,
default, accepted values, the package that honours it, a one-line description, an example);
each installed component declares the variables it acts on in its own package
(``Component(options=...)``, :mod:`ortmodule_exporter.option`). :func:`variables` is the merge,
and everything here works from it: parsing, ``DebugOptions`` fields, the warnings, and
``docs/options.md`` (a test keeps the doc equal to the merge). A component's variable is a field
of :class:`RuntimeOptions` like the runtime's own. :func:`inactive_variables` names the variables
set to a value that nothing installed acts on (the runtime logs one WARNING for each).
"""

from __future__ import annotations

import difflib
import enum
import os
import shlex
import warnings
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

from ortmodule_exporter.errors import InvalidOptionError
from ortmodule_exporter.option import (
    PREFIX,
    Option,
    auto_or_count,
    choice,
    flag_names,
    flags,
    folder,
    format_value,
    int_in,
    lower_choice,
    switch,
)

from .bundle import COMPONENT_VARIABLES
from .debug_options import DebugOptions, LogLevel

__all__ = [
    "PREFIX",
    "RUNTIME_VARIABLES",
    "EnvVar",
    "FallbackPolicy",
    "InvalidOptionError",
    "RuntimeOptions",
    "SkipCheck",
    "flag_names",
    "format_value",
    "inactive_variables",
    "unknown_variables",
    "needs_component",
    "variables",
    "variables_markdown",
]

#: the declaration of one variable (kept under its old name)
EnvVar = Option

# kept equal to ortmodule_exporter.export.MIN_OPSET/MAX_OPSET/DEFAULT_OPSET (a test checks it);
# not imported so that reading options does not import the exporter's torch/onnx machinery
MIN_OPSET, MAX_OPSET, DEFAULT_OPSET = 14, 20, 17


class FallbackPolicy(enum.IntFlag):
    """Which failures let training continue in PyTorch (``ORTMODULE_FALLBACK_POLICY``).

    One bit per policy, so policies combine with ``|``."""

    FALLBACK_DISABLE = 1 << 0
    FALLBACK_FORCE_TORCH_FORWARD = 1 << 1
    FALLBACK_FORCE_TORCH_BACKWARD = 1 << 2
    FALLBACK_UNSUPPORTED_DEVICE = 1 << 3
    FALLBACK_UNSUPPORTED_DATA = 1 << 4
    FALLBACK_UNSUPPORTED_TORCH_MODEL = 1 << 5
    FALLBACK_UNSUPPORTED_ONNX_MODEL = 1 << 6
    FALLBACK_BAD_INITIALIZATION = 1 << 7


class SkipCheck(enum.IntFlag):
    """Which per-call consistency checks to skip once the graph is built (``ORTMODULE_SKIPCHECK_POLICY``)."""

    SKIP_CHECK_DISABLED = 1 << 0
    SKIP_CHECK_DEVICE = 1 << 1
    SKIP_CHECK_BUILD_GRADIENT = 1 << 2
    SKIP_CHECK_EXECUTION_AGENT = 1 << 3


DEFAULT_FALLBACK_POLICY = (
    FallbackPolicy.FALLBACK_UNSUPPORTED_DEVICE
    | FallbackPolicy.FALLBACK_UNSUPPORTED_DATA
    | FallbackPolicy.FALLBACK_UNSUPPORTED_TORCH_MODEL
    | FallbackPolicy.FALLBACK_UNSUPPORTED_ONNX_MODEL
)


def _log_level(text: str) -> LogLevel:
    try:
        return LogLevel[text.upper()]
    except KeyError:
        raise ValueError("not a log level") from None


# -- the table ----------------------------------------------------------------------------------

_RUNTIME = "ortmodule"
_EXPORTER = "ortmodule-exporter"
_switch = switch

RUNTIME_VARIABLES: tuple[Option, ...] = (
    EnvVar(
        "ORTMODULE_ONNX_OPSET_VERSION",
        "int",
        DEFAULT_OPSET,
        int_in(MIN_OPSET, MAX_OPSET),
        f"an integer from {MIN_OPSET} to {MAX_OPSET}",
        _EXPORTER,
        "ONNX opset the model is exported with; pin it to stay on a validated opset.",
        "15",
    ),
    EnvVar(
        "ORTMODULE_EXPORTER",
        "str",
        "torchscript",
        lower_choice("torchscript", "torch_export"),
        "torchscript or torch_export (any case)",
        _EXPORTER,
        "Which frontend writes the ONNX graph: torchscript, PyTorch's TorchScript exporter "
        "(torch.onnx.export dynamo=False); torch_export (experimental: trains fewer "
        "programs than the default, docs/frontends.md; warns once; needs onnxscript), "
        "torch.export (non-strict, every input dim dynamic) lowered by the dynamo ONNX "
        "translator, at opset 18 or ORTMODULE_ONNX_OPSET_VERSION if higher: a branch on a "
        "tensor's value is an export error instead of a guard, in-place writes are "
        "functionalized, no shape is baked in; operators without a translation or an "
        "engine gradient, torch.library custom operators and custom autograd.Functions (as "
        "PythonOps) run in PyTorch; the kernel choice and the opt-in ATen routes work as on "
        "torchscript "
        "(docs/architecture.md, The torch_export frontend).",
        "torch_export",
        debug_field="exporter",
    ),
    EnvVar(
        "ORTMODULE_FALLBACK_POLICY",
        "FallbackPolicy",
        DEFAULT_FALLBACK_POLICY,
        flags(FallbackPolicy, FallbackPolicy.FALLBACK_DISABLE),
        "FallbackPolicy flag names joined with |; FALLBACK_DISABLE stands alone",
        _RUNTIME,
        "Which failures let training continue in PyTorch; FALLBACK_DISABLE makes every failure an error.",
        "FALLBACK_DISABLE",
    ),
    _switch(
        "ORTMODULE_FALLBACK_RETRY",
        False,
        _RUNTIME,
        "After a fallback, try the engine again on the next call instead of staying in PyTorch.",
    ),
    EnvVar(
        "ORTMODULE_LOG_LEVEL",
        "LogLevel",
        LogLevel.WARNING,
        _log_level,
        ", ".join(level.name for level in LogLevel) + " (any case)",
        _RUNTIME,
        "ORTModule log level; wins over DebugOptions(log_level=...).",
        "INFO",
    ),
    EnvVar(
        "ORTMODULE_SAVE_ONNX_PATH",
        "path",
        None,
        folder,
        "a folder (created when missing)",
        _EXPORTER,
        "Folder for the models saved by DebugOptions(save_onnx=True); unset: the current working directory.",
        "/tmp/onnx_models",
    ),
    _switch(
        "ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT",
        False,
        _EXPORTER,
        "Allow exporting torch.utils.checkpoint regions as PythonOp (PyTorch then computes them).",
    ),
    _switch(
        "ORTMODULE_ENABLE_CUSTOM_AUTOGRAD",
        True,
        _EXPORTER,
        "Export torch.autograd.Function subclasses as PythonOp; 0 exports their forward inline.",
    ),
    _switch(
        "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER",
        True,
        _RUNTIME,
        "Engine graph transformers that save compute; 0 keeps exactly the eager computation.",
    ),
    _switch(
        "ORTMODULE_ENABLE_SPARSE_OPTIMIZER",
        True,
        _RUNTIME,
        "Input-sparsity optimizations (label and embedding padding); the switch over both below.",
    ),
    _switch(
        "ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER",
        True,
        _RUNTIME,
        "Compute a cross-entropy loss, and the layers feeding it, on the counted labels only "
        "(not ignore_index) when under 90% of the first batch's labels count; training graphs. "
        "On CPU, every token-wise layer only the loss reads (a masked LM's head, the last "
        "feed-forward block) runs on the labelled tokens (labelled rows; refused, with the reason "
        "logged, where that cannot be shown); else the engine shrinks the vocabulary projection.",
    ),
    _switch(
        "ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER",
        False,
        _RUNTIME,
        "Run token-wise layers (projections, feed-forward, LayerNorm) on the tokens the attention "
        "mask keeps when under 90% of the first batch's tokens are kept; training graphs, exact "
        "(refused, with the reason logged, where that cannot be shown).",
    ),
    _switch(
        "ORTMODULE_PRINT_INPUT_DENSITY",
        False,
        _RUNTIME,
        "Log each step's label density (labels not ignore_index) and embedding density "
        "(indices not padding_idx) at WARNING.",
    ),
    EnvVar(
        "ORTMODULE_CACHE_DIR",
        "path",
        None,
        folder,
        "a folder (created when missing); unset disables the cache",
        _EXPORTER,
        "Cache exported models here and reuse them in later runs.",
        "/tmp/ortmodule_cache",
    ),
    _switch(
        "ORTMODULE_USE_EFFICIENT_ATTENTION",
        False,
        _EXPORTER,
        "Fuse attention patterns and run them with PyTorch's efficient_attention ATen kernel.",
    ),
    _switch(
        "ORTMODULE_ATEN_SDPA_FALLBACK",
        False,
        _EXPORTER,
        "Export scaled_dot_product_attention as an ATen op that PyTorch runs, not decomposed.",
    ),
    _switch(
        "ORTMODULE_ATEN_DROPOUT",
        False,
        _EXPORTER,
        "Run training-mode dropout (nn.Dropout, F.dropout, Dropout2d/3d, "
        "scaled_dot_product_attention's dropout_p) with PyTorch's kernel (native_dropout as an "
        "ATen op): masks drawn by PyTorch's generator as eager draws them, so losses and "
        "gradients equal eager's with dropout on; slower (1.2x a GPT step measured). 0 runs the "
        "engine's Dropout, seeded from PyTorch's generator each step: reproducible, other masks "
        "than eager's.",
        debug_field="aten_dropout",
    ),
    _switch(
        "ORTMODULE_FUSED_ATTENTION",
        True,
        _EXPORTER,
        "Run scaled_dot_product_attention with PyTorch's fused kernels, forward and backward "
        "(as ORTMODULE_ATEN_SDPA_FALLBACK=1; a mask that needs a gradient stays decomposed); "
        "on CPU the kernel reads the heads' token-major tensors as eager does, without the "
        "Transposes around it; 0 lets the engine run attention as separate operators. Left at "
        "its default, it is off while ORTMODULE_MEMORY_OPT_CONFIG's plans (which may name the "
        "decomposed attention's nodes) or ORTMODULE_USE_TRITON are on: both need the engine's "
        "own nodes. It stays on at ORTMODULE_MEMORY_OPT_LEVEL 1 and 2: the fused node keeps "
        "only its output and logsumexp, less than the decomposed attention the levels leave "
        "stashed.",
    ),
    EnvVar(
        "ORTMODULE_KERNEL_CHOICE",
        "str",
        "AUTO",
        choice("AUTO", "ENGINE", "TORCH"),
        "AUTO, ENGINE or TORCH (any case)",
        _EXPORTER,
        "Per-operator kernel choice for GELU, ReLU (forward and backward timed apart), "
        "convolution (not transposed, input needing a "
        "gradient), 2-d max pooling, LayerNorm (weight and bias trained), embedding "
        "lookups (padding_idx included), cross-entropy on class indices (not where label sparsity "
        "shrinks it) and, in the built gradient graph, bias gradients (float32 sums over the "
        "batch's leading axes), the engine's GELU gradients (FastGeluGrad, GeluGrad) and "
        "float32 matrix products by a 2-d operand (Gemm, MatMul, FusedMatMul; forward and "
        "backward, timed at 1024 rows where the graph does not fix them, every dim capped at "
        "1024): "
        "AUTO times the engine's kernels against PyTorch's (run as "
        "ATen nodes, PyTorch at ORTMODULE_TORCH_THREADS_IN_ENGINE threads) once per process and "
        "operator, dtype and size class (the sizes traced at export; a bias gradient's width; "
        "a product's shape) and uses the faster; "
        "ENGINE or TORCH force one. Unless ENGINE, a lookup table's float32 gradient summed "
        "with its other gradients (a tied LM head's) is also added in one pass over the table "
        "(not timed: one pass where the engine's GatherGrad and Sum make three), and under "
        "AUTO such a table's lookup is the engine's, untimed (the route would decide only the "
        "forward's copy of the looked-up rows); where the loss and the output head's products "
        "run on PyTorch, the loss's gradient and the head's two gradient products are one node "
        "that works a block of classes at a time (the logits' gradient never exists whole). "
        "Left at its default while recompute or "
        "ORTMODULE_USE_TRITON "
        "is on, it decides the cross-entropy loss, the engine's GELU gradients and the "
        "backward half's products, and every "
        "other operator stays on the engine's kernels (the engine recomputes and fuses only "
        "its own nodes; nothing recomputes the loss, and recompute repeats forward nodes, not "
        "gradients: GPT-2 124M at level 1, step 8.13 -> 7.04 s); set to AUTO explicitly, it "
        "routes as without recompute, and the products it routes are kept rather than "
        "recomputed (GPT-2 124M at level 1: 3.10 s a step and 3009 MiB against 4.00 s and "
        "2921 MiB, docs/memory.md).",
        "ENGINE",
    ),
    _switch(
        "ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT",
        True,
        _EXPORTER,
        "Deep-copy the module before export so export cannot change it; 0 saves the copy's memory.",
    ),
    EnvVar(
        "ORTMODULE_TORCH_THREADS_IN_ENGINE",
        "str",
        "AUTO",
        auto_or_count,
        "AUTO (any case) or an integer >= 0",
        _RUNTIME,
        "PyTorch's intra-op threads while the engine runs a graph that holds PyTorch-run nodes "
        "(ATen nodes, custom autograd Functions); 0 keeps PyTorch's setting. At 1 those nodes run "
        "single-threaded and PyTorch's OpenMP workers, which spin-wait after each parallel region, "
        "leave the cores to the engine's own threads (GPT-style decoder on 2 cores: 1.44x -> "
        "1.10x eager's step time); fused attention, GELU and the cross-entropy route then run "
        "in pieces, one per thread PyTorch had, on ORTModule's own helper threads that sleep "
        "between nodes "
        "(bitwise the one-call result). Where the PyTorch-run nodes dominate the step, PyTorch's "
        "own count is faster (a CNN: 1.25-1.30x -> 1.02x). AUTO measures it per graph: after "
        "2 warm-up steps, 1 and PyTorch's count take turns for 5 steps each and the lower "
        "median engine time per step stays (1 under torch.use_deterministic_algorithms: a choice "
        "made by timing could differ between runs); the kernel choice times PyTorch's side at "
        "1 thread then.",
        "1",
    ),
    EnvVar(
        "ORTMODULE_CONV_ALGO_SEARCH",
        "str",
        "HEURISTIC",
        choice("HEURISTIC", "EXHAUSTIVE", "DEFAULT"),
        "HEURISTIC, EXHAUSTIVE or DEFAULT (any case)",
        _RUNTIME,
        "cuDNN convolution algorithm search of the CUDA execution provider.",
        "EXHAUSTIVE",
    ),
    EnvVar(
        "ORTMODULE_CPU_MEM_ARENA",
        "str",
        "AUTO",
        choice("AUTO", "1", "0"),
        "AUTO (any case), 1 or 0",
        _RUNTIME,
        "The CPU engine's memory arena. 1: the engine keeps what a step allocated for the next "
        "step (faster steps; the resident set stays at the engine's peak between steps, and "
        "PyTorch's optimizer step allocates on top of it). 0: the engine allocates without an "
        "arena and a run's memory goes back when it is freed (GPT-2 124M on 2 cores: steps "
        "peak 3434-3477 against 3692-3735 MiB, steps 6-8 % slower). AUTO: the arena, "
        "except where a component asks for the memory back (recompute, "
        "ORTMODULE_MEMORY_OPT_LEVEL/CONFIG, and DeepSpeed ZeRO stages 1-3) or the kernel "
        "choice gave the graph's matrix products to PyTorch in a module of 64 MiB of "
        "parameters or more, whose product outputs are then most of a step's memory (GPT-2 "
        "124M on a 2-core Xeon: steps peak 3173 against 3982 MiB with the arena, step 3.70 "
        "against 3.57 s; a smaller one keeps the arena: the toy GPT stepped at 1.22x eager "
        "with it, 1.32x without). Without the "
        "arena, the C heap's free pages also go back to the system after each backward. "
        "No effect on CUDA, whose memory PyTorch's caching allocator manages.",
        "0",
    ),
    EnvVar(
        "ORTMODULE_SKIPCHECK_POLICY",
        "SkipCheck",
        SkipCheck.SKIP_CHECK_DISABLED,
        flags(SkipCheck, SkipCheck.SKIP_CHECK_DISABLED),
        "SkipCheck flag names joined with |; SKIP_CHECK_DISABLED stands alone",
        _RUNTIME,
        "Per-call checks to skip after the first step (device, gradient build, execution agent).",
        "SKIP_CHECK_DEVICE|SKIP_CHECK_BUILD_GRADIENT",
    ),
)

#: runtime variables nothing in this build acts on: variable -> why
NO_EFFECT_IN_THIS_BUILD: Mapping[str, str] = MappingProxyType(
    {
        "ORTMODULE_SKIPCHECK_POLICY": "ORTModule runs its per-call checks (device, gradient "
        "build) on every call; skipping them is not built",
    }
)
RUNTIME_VARIABLES = tuple(
    replace(var, honoured_by="nothing in this build (a warning says so)")
    if var.name in NO_EFFECT_IN_THIS_BUILD
    else var
    for var in RUNTIME_VARIABLES
)
#: the fields of :class:`RuntimeOptions` that no variable sets
_DEBUG_FIELDS = ("log_level", "save_onnx", "onnx_prefix")

DEFAULT, DEBUG_OPTIONS, ENVIRONMENT = "default", "DebugOptions", "environment"


@dataclass(frozen=True)
class _Merged:
    """The runtime's variables and those the installed components declare, in table order."""

    variables: tuple[Option, ...]
    #: component variable -> the component (distribution) that declares it
    owners: Mapping[str, str]

    @property
    def by_name(self) -> dict[str, Option]:
        return {var.name: var for var in self.variables}


def _merged() -> _Merged:
    # the components' declarations load with them (torch, the exporter), so only when asked for
    from ortmodule_exporter.components import declared_options

    core = {var.name for var in RUNTIME_VARIABLES}
    added: list[Option] = []
    owners: dict[str, str] = {}
    for option, component in declared_options():
        if option.name in core or not option.name.startswith(PREFIX):
            warnings.warn(
                f"{component} declares {option.name}, which is "
                + ("the runtime's own" if option.name in core else f"not an {PREFIX}* name")
                + "; the declaration is ignored",
                UserWarning,
                stacklevel=3,
            )
            continue
        added.append(replace(option, honoured_by=f"{component} when installed (else a warning)"))
        owners[option.name] = component
    return _Merged(RUNTIME_VARIABLES + tuple(added), MappingProxyType(owners))


def variables() -> tuple[Option, ...]:
    """Every ``ORTMODULE_*`` variable: the runtime's, then each installed component's."""
    return _merged().variables


def needs_component() -> Mapping[str, str]:
    """Variable -> the component distribution that acts on it: what the installed components
    declare, and what the bundled ones would (:data:`ortmodule.bundle.COMPONENT_VARIABLES`)."""
    return MappingProxyType({**COMPONENT_VARIABLES, **_merged().owners})


def __getattr__(name: str) -> Any:
    # module attributes that depend on what is installed: computed when read
    if name == "VARIABLES":
        return variables()
    if name == "NEEDS_COMPONENT":
        return needs_component()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def unknown_variables(
    environ: Mapping[str, str], known: Collection[str] | None = None
) -> list[tuple[str, str | None]]:
    """``ORTMODULE_*`` names in ``environ`` that no option reads, each with a close known name.

    A variable of a bundled component that is not installed is known (it gets its own warning).
    """
    if known is None:
        known = {var.name for var in variables()} | set(COMPONENT_VARIABLES)
    found = []
    for name in sorted(environ):
        if name.startswith(PREFIX) and name not in known:
            # compare without the shared prefix, which would make every name look close
            tails = [option[len(PREFIX) :] for option in known]
            close = difflib.get_close_matches(name[len(PREFIX) :], tails, n=1)
            found.append((name, PREFIX + close[0] if close else None))
    return found


def _warn_unknown(environ: Mapping[str, str], known: Collection[str]) -> None:
    for name, close in unknown_variables(environ, known):
        hint = f"; did you mean {close}?" if close else ""
        warnings.warn(
            f"{name} is not an ORTModule option and is ignored{hint}", UserWarning, stacklevel=3
        )


_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class RuntimeOptions:
    """Every option ORTModule and its components read, with where each value came from.

    Build it with :meth:`resolve`; ``source(field)`` says ``"default"``, ``"DebugOptions"`` or
    ``"environment"``. The installed components' variables are fields too
    (``options.memory_opt_level`` with ortmodule-memory installed), held in ``components``.
    """

    log_level: LogLevel
    save_onnx: bool
    onnx_prefix: str
    save_onnx_path: str | None
    onnx_opset_version: int
    exporter: str
    fallback_policy: FallbackPolicy
    fallback_retry: bool
    allow_autograd_checkpoint: bool
    enable_custom_autograd: bool
    enable_compute_optimizer: bool
    enable_sparse_optimizer: bool
    enable_label_sparse_optimizer: bool
    enable_embedding_sparse_optimizer: bool
    print_input_density: bool
    cache_dir: str | None
    use_efficient_attention: bool
    aten_sdpa_fallback: bool
    aten_dropout: bool
    fused_attention: bool
    kernel_choice: str
    deepcopy_before_model_export: bool
    torch_threads_in_engine: str
    conv_algo_search: str
    cpu_mem_arena: str
    skipcheck_policy: SkipCheck
    #: ``(field, value)`` of every variable an installed component declares
    components: tuple[tuple[str, Any], ...] = ()
    #: ``(what the user set, value as text)`` for what no installed component declares: a
    #: bundled component's variable, a ``DebugOptions`` field (``"DebugOptions.<field>"``)
    unclaimed: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    sources: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    def __getattr__(self, name: str) -> Any:
        # only called for names that are not dataclass fields: a component's variable
        if not name.startswith("_") and name not in ("components", "unclaimed", "sources"):
            for known, value in self.components:
                if known == name:
                    return value
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def resolve(
        cls, debug_options: DebugOptions | None = None, environ: Mapping[str, str] = os.environ
    ) -> RuntimeOptions:
        """Defaults, then ``debug_options``, then ``ORTMODULE_*`` variables in ``environ``.

        An empty variable counts as unset. Raises :class:`InvalidOptionError` naming the
        variable, its value and the accepted values; warns about unknown ``ORTMODULE_*`` names.
        """
        merged = _merged()
        by_name = merged.by_name
        values: dict[str, Any] = {var.field: var.default for var in merged.variables}
        sources = dict.fromkeys(values, DEFAULT)
        base = debug_options if debug_options is not None else DebugOptions()
        for name in _DEBUG_FIELDS:
            values[name] = getattr(base, name)
            sources[name] = DEBUG_OPTIONS if debug_options is not None else DEFAULT
        unclaimed: list[tuple[str, str]] = []
        claimed = {var.debug_field: var for var in merged.variables if var.debug_field}
        for f in fields(base):
            given = getattr(base, f.name)
            if f.name in _DEBUG_FIELDS or given is None:
                continue
            var = claimed.get(f.name)
            if var is None:  # a field for a component that is not installed
                unclaimed.append((f"DebugOptions.{f.name}", format_value(given)))
                continue
            try:
                values[var.field] = var.parse(str(given))
            except ValueError as err:
                raise InvalidOptionError(
                    f"DebugOptions({f.name}={given!r}) is invalid ({err}); accepted: {var.accepted}"
                ) from None
            sources[var.field] = DEBUG_OPTIONS
        for var in merged.variables:
            text = environ.get(var.name, "")
            if text.strip():
                values[var.field] = var.convert(text)
                sources[var.field] = ENVIRONMENT
        for var in merged.variables:
            if var.requires is not None and values[var.field]:
                other, why = var.requires
                needed = by_name.get(other)
                if needed is None or not values[needed.field]:
                    raise InvalidOptionError(
                        f"{var.name}=1 needs {other}=1 ({why}); set both, or unset {var.name}."
                    )
        for name in sorted(COMPONENT_VARIABLES):
            text = environ.get(name, "").strip()
            if name not in by_name and text:
                unclaimed.append((name, text))
        _warn_unknown(environ, set(by_name) | set(COMPONENT_VARIABLES))
        core = {f.name for f in fields(cls)}
        return cls(
            **{k: v for k, v in values.items() if k in core},
            components=tuple((k, v) for k, v in values.items() if k not in core),
            unclaimed=tuple(unclaimed),
            sources=MappingProxyType(sources),
        )

    @classmethod
    def defaults(cls) -> RuntimeOptions:
        """The options with no DebugOptions and no environment variables."""
        return cls.resolve(None, environ={})

    def source(self, name: str) -> str:
        """Where field ``name`` came from: ``"default"``, ``"DebugOptions"`` or ``"environment"``."""
        try:
            return self.sources[name]
        except KeyError:
            known = ", ".join(sorted(self.sources))
            raise KeyError(f"RuntimeOptions has no field {name!r}; fields: {known}") from None

    def settings(self) -> list[tuple[str, str, str]]:
        """``(variable, value as text, source)`` for every ``ORTMODULE_*`` variable, table order."""
        return [
            (var.name, format_value(getattr(self, var.field)), self.source(var.field))
            for var in variables()
            if var.field in self.sources
        ]

    def values(self) -> tuple[tuple[str, Any], ...]:
        """``(variable, parsed value)`` for every variable: what passes and components read."""
        return tuple(
            (var.name, getattr(self, var.field)) for var in variables() if var.field in self.sources
        )


def keeps_engine_nodes(options: RuntimeOptions, attention: bool = False) -> str:
    """What, among the options set, wants the engine's own nodes in the graph ("" when nothing
    does): the declarations with ``keeps_engine_nodes`` whose value is on, joined with "and".
    ``attention``: only those that want the attention decomposed too (not
    ``fused_attention_stays``)."""
    wanted: list[str] = []
    for var in variables():
        if attention and var.fused_attention_stays:
            continue
        if var.keeps_engine_nodes and var.field in options.sources:
            if getattr(options, var.field) and var.keeps_engine_nodes not in wanted:
                wanted.append(var.keeps_engine_nodes)
    return " and ".join(wanted)


# -- variables that do nothing here ----------------------------------------------------------


def inactive_variables(
    options: RuntimeOptions, handled: Collection[str] = (), cuda_engine: bool = True
) -> list[tuple[str, str]]:
    """``(variable, message)`` for each variable set to a non-default value that nothing acts on.

    ``handled`` holds the variables that registered components honour
    (``ortmodule_exporter.components.handled_options()``); ``cuda_engine`` says whether the
    installed engine has the CUDA execution provider.

    >>> options = RuntimeOptions.resolve(environ={"ORTMODULE_USE_TRITON": "1"})
    >>> inactive_variables(options)[0][0]
    'ORTMODULE_USE_TRITON'
    >>> inactive_variables(options, handled={"ORTMODULE_USE_TRITON"})
    []
    """
    merged = _merged()
    found = []
    for var in merged.variables:
        if var.field not in options.sources:
            continue
        value = getattr(options, var.field)
        if value == var.default or var.name in handled:
            continue
        if var.name in merged.owners:
            package = merged.owners[var.name]
            reason = f"no installed component honours it; install {package} (pip install {package})"
        elif var.name in NO_EFFECT_IN_THIS_BUILD:
            reason = NO_EFFECT_IN_THIS_BUILD[var.name]
        elif var.name == "ORTMODULE_CONV_ALGO_SEARCH" and not cuda_engine:
            reason = (
                "it chooses cuDNN convolution algorithms of the CUDA engine, and the installed "
                "engine is the CPU build (onnxruntime-training-cpu)"
            )
        elif var.name == "ORTMODULE_SAVE_ONNX_PATH" and not options.save_onnx:
            reason = "models are saved only with DebugOptions(save_onnx=True, onnx_prefix=...)"
        else:
            continue
        found.append((var.name, f"{var.name}={format_value(value)} has no effect: {reason}."))
    for name, text in options.unclaimed:
        if text.lower() in _OFF or name in handled:  # off is every such variable's default
            continue
        if name in COMPONENT_VARIABLES:
            package = COMPONENT_VARIABLES[name]
            reason = f"no installed component honours it; install {package} (pip install {package})"
        else:
            reason = "no installed component declares it; install the component it is for"
        found.append((name, f"{name}={text} has no effect: {reason}."))
    return found


# -- documentation ------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def variables_markdown(variables: Iterable[Option] | None = None) -> str:
    """The variables table of ``docs/options.md``: the runtime's variables and every installed
    component's (:func:`variables`)."""
    lines = [
        "| Variable | Type | Default | Accepted values | Honoured by | Description | Example |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for var in _variables_or_merged(variables):
        cells = (
            f"`{var.name}`",
            var.type,
            f"`{format_value(var.default)}`",
            var.accepted,
            var.honoured_by,
            var.doc,
            f"`export {var.name}={shlex.quote(var.example)}`",
        )
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _variables_or_merged(given: Iterable[Option] | None) -> Iterable[Option]:
    return variables() if given is None else given
