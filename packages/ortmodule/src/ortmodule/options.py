"""The one options object: defaults, then :class:`DebugOptions`, then ``ORTMODULE_*`` variables.

>>> from ortmodule.options import RuntimeOptions
>>> options = RuntimeOptions.resolve(environ={"ORTMODULE_ONNX_OPSET_VERSION": "15"})
>>> options.onnx_opset_version, options.source("onnx_opset_version"), options.source("cache_dir")
(15, 'environment', 'default')

Every ``ORTMODULE_*`` variable is declared once in :data:`VARIABLES` (name, type, default,
accepted values, the package that honours it, a one-line description, an example) and parsed
here only; ``docs/options.md`` is generated from the same table and a test keeps the two equal.
Variables for features that live in other packages (memory optimizer, Triton, tuning, ZeRO
stage 3) are validated here and handed on as fields; :func:`inactive_variables` names those set
to a value that nothing installed acts on (the runtime logs one WARNING for each).
"""

from __future__ import annotations

import difflib
import enum
import os
import shlex
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, TypeVar

from ortmodule_exporter.errors import InvalidOptionError

from .debug_options import DebugOptions, LogLevel

__all__ = [
    "PREFIX",
    "VARIABLES",
    "EnvVar",
    "FallbackPolicy",
    "InvalidOptionError",
    "RuntimeOptions",
    "SkipCheck",
    "format_value",
    "inactive_variables",
    "unknown_variables",
    "variables_markdown",
]

PREFIX = "ORTMODULE_"
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

_F = TypeVar("_F", bound=enum.IntFlag)


def flag_names(value: enum.IntFlag) -> str:
    """``A|B`` for a combination of flags (``Flag.name`` is None for combinations on Python 3.10)."""
    return "|".join(m.name for m in type(value) if m.name and m in value and m.value) or "0"


# -- parsers: text -> value, raising ValueError with the reason -------------------------------

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bool(text: str) -> bool:
    low = text.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError("not a switch")


def _int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError("not an integer") from None
        if value < lo or (hi is not None and value > hi):
            raise ValueError("out of range")
        return value

    return parse


def _auto_or_count(text: str) -> str:
    """``AUTO`` or a thread count >= 0, kept as text (``"AUTO"``, ``"2"``)."""
    if text.upper() == "AUTO":
        return "AUTO"
    return str(_int_in(0)(text))


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.upper() not in choices:
            raise ValueError("not one of the choices")
        return text.upper()

    return parse


def _lower_choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.lower() not in choices:
            raise ValueError("not one of the choices")
        return text.lower()

    return parse


def _flags(kind: type[_F], alone: _F) -> Callable[[str], _F]:
    """``A|B|C`` -> a combination of ``kind``; ``alone`` may not be combined with other flags."""

    def parse(text: str) -> _F:
        names = [part.strip().upper() for part in text.split("|")]
        result = kind(0)
        for name in names:
            member = kind.__members__.get(name)
            if member is None:
                raise ValueError(f"{name or '(empty)'!r} is not a {kind.__name__} flag")
            result |= member
        if alone in result and result != alone:
            raise ValueError(f"{alone.name} cannot be combined with other flags")
        return result

    return parse


def _log_level(text: str) -> LogLevel:
    try:
        return LogLevel[text.upper()]
    except KeyError:
        raise ValueError("not a log level") from None


def _folder(text: str) -> str:
    path = os.path.expanduser(text)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path} exists and is not a folder")
    return path


def _existing_file(text: str) -> str:
    path = os.path.expanduser(text)
    if not os.path.isfile(path):
        raise ValueError(f"no file at {os.path.abspath(path)}")
    return path


def _path(text: str) -> str:
    return os.path.expanduser(text)


# -- the table ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnvVar:
    """One ``ORTMODULE_*`` variable: how to parse it and how to document it."""

    name: str
    type: str
    default: Any
    parse: Callable[[str], Any]
    accepted: str
    honoured_by: str
    doc: str
    example: str

    @property
    def field(self) -> str:
        """The :class:`RuntimeOptions` field: the name lower-cased without ``ORTMODULE_``."""
        return self.name[len(PREFIX) :].lower()

    def convert(self, text: str) -> Any:
        """Parse ``text``; an :class:`InvalidOptionError` names the variable, value and choices."""
        try:
            return self.parse(text.strip())
        except ValueError as err:
            raise InvalidOptionError(
                f"{self.name}={text!r} is invalid ({err}); accepted: {self.accepted}. "
                f"For example: export {self.name}={shlex.quote(self.example)}, or unset it for the default "
                f"({format_value(self.default)})."
            ) from None


_SWITCH = "1 or 0 (also true/false, yes/no, on/off)"
_RUNTIME = "ortmodule"
_EXPORTER = "ortmodule-exporter"
_MEMORY = "ortmodule-memory"
_TRITON = "ortmodule-triton"


def _switch(name: str, default: bool, honoured_by: str, doc: str) -> EnvVar:
    return EnvVar(name, "bool", default, _bool, _SWITCH, honoured_by, doc, "0" if default else "1")


VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(
        "ORTMODULE_ONNX_OPSET_VERSION",
        "int",
        DEFAULT_OPSET,
        _int_in(MIN_OPSET, MAX_OPSET),
        f"an integer from {MIN_OPSET} to {MAX_OPSET}",
        _EXPORTER,
        "ONNX opset the model is exported with; pin it to stay on a validated opset.",
        "15",
    ),
    EnvVar(
        "ORTMODULE_EXPORTER",
        "str",
        "torchscript",
        _lower_choice("torchscript", "torch_export"),
        "torchscript or torch_export (any case)",
        _EXPORTER,
        "Which frontend writes the ONNX graph: torchscript, PyTorch's TorchScript exporter "
        "(torch.onnx.export dynamo=False); torch_export (experimental; needs onnxscript), "
        "torch.export (non-strict, every input dim dynamic) lowered by the dynamo ONNX "
        "translator, at opset 18 or ORTMODULE_ONNX_OPSET_VERSION if higher: a branch on a "
        "tensor's value is an export error instead of a guard, in-place writes are "
        "functionalized, no shape is baked in. Not yet with custom autograd.Functions "
        "(an export error) or the ATen routes and the kernel choice (an error when set) "
        "(docs/architecture.md, The torch_export frontend).",
        "torch_export",
    ),
    EnvVar(
        "ORTMODULE_FALLBACK_POLICY",
        "FallbackPolicy",
        DEFAULT_FALLBACK_POLICY,
        _flags(FallbackPolicy, FallbackPolicy.FALLBACK_DISABLE),
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
        _folder,
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
    _switch(
        "ORTMODULE_PRINT_MEMORY_STATS",
        False,
        _MEMORY,
        "Print memory statistics before and after forward and backward of each step.",
    ),
    EnvVar(
        "ORTMODULE_CACHE_DIR",
        "path",
        None,
        _folder,
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
    ),
    _switch(
        "ORTMODULE_FUSED_ATTENTION",
        True,
        _EXPORTER,
        "Run scaled_dot_product_attention with PyTorch's fused kernels, forward and backward "
        "(as ORTMODULE_ATEN_SDPA_FALLBACK=1; a mask that needs a gradient stays decomposed); "
        "on CPU the kernel reads the heads' token-major tensors as eager does, without the "
        "Transposes around it; 0 lets the engine run attention as separate operators. Left at its default, it is off "
        "while recompute (ORTMODULE_MEMORY_OPT_LEVEL/CONFIG) or ORTMODULE_USE_TRITON is on: "
        "both need the engine's own nodes.",
    ),
    EnvVar(
        "ORTMODULE_KERNEL_CHOICE",
        "str",
        "AUTO",
        _choice("AUTO", "ENGINE", "TORCH"),
        "AUTO, ENGINE or TORCH (any case)",
        _EXPORTER,
        "Per-operator kernel choice for GELU, ReLU (forward and backward timed apart), "
        "convolution (not transposed, input needing a "
        "gradient), 2-d max pooling, LayerNorm (weight and bias trained), embedding "
        "lookups (padding_idx included), cross-entropy on class indices (not where label sparsity "
        "shrinks it) and, in the built gradient graph, bias gradients (float32 sums over the "
        "batch's leading axes): AUTO times the engine's kernels against PyTorch's (run as "
        "ATen nodes, PyTorch at ORTMODULE_TORCH_THREADS_IN_ENGINE threads) once per process and "
        "operator, dtype and size class (the sizes traced at export; a bias gradient's width) "
        "and uses the faster; "
        "ENGINE or TORCH force one. Left at its default, it is ENGINE while recompute or "
        "ORTMODULE_USE_TRITON is on (the engine recomputes and fuses only its own nodes).",
        "ENGINE",
    ),
    _switch(
        "ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT",
        True,
        _EXPORTER,
        "Deep-copy the module before export so export cannot change it; 0 saves the copy's memory.",
    ),
    EnvVar(
        "ORTMODULE_MEMORY_OPT_LEVEL",
        "int",
        0,
        _int_in(0, 2),
        "0 (plans in ORTMODULE_MEMORY_OPT_CONFIG), 1 (recompute every transformer layer), "
        "2 (layers, compromised subgraphs included)",
        _MEMORY,
        "Recompute level that trades compute for activation memory.",
        "1",
    ),
    EnvVar(
        "ORTMODULE_MEMORY_OPT_CONFIG",
        "path",
        None,
        _existing_file,
        "an existing JSON file of recompute plans",
        _MEMORY,
        "Recompute plans applied at ORTMODULE_MEMORY_OPT_LEVEL=0.",
        "mem_opt.json",
    ),
    _switch(
        "ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT",
        False,
        _MEMORY,
        "Hand each gradient to its parameter as soon as it is computed, freeing it early.",
    ),
    _switch(
        "ORTMODULE_ENABLE_ZERO_STAGE3",
        False,
        "ortmodule-zero",
        "Gather DeepSpeed ZeRO stage 3 partitioned parameters for the engine, release them after.",
    ),
    EnvVar(
        "ORTMODULE_TORCH_THREADS_IN_ENGINE",
        "str",
        "AUTO",
        _auto_or_count,
        "AUTO (any case) or an integer >= 0",
        _RUNTIME,
        "PyTorch's intra-op threads while the engine runs a graph that holds PyTorch-run nodes "
        "(ATen nodes, custom autograd Functions); 0 keeps PyTorch's setting. At 1 those nodes run "
        "single-threaded and PyTorch's OpenMP workers, which spin-wait after each parallel region, "
        "leave the cores to the engine's own threads (GPT-style decoder on 2 cores: 1.44x -> "
        "1.10x eager's step time); fused attention and GELU nodes then run in pieces, one per "
        "thread PyTorch had, on ORTModule's own helper threads that sleep between nodes "
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
        _choice("HEURISTIC", "EXHAUSTIVE", "DEFAULT"),
        "HEURISTIC, EXHAUSTIVE or DEFAULT (any case)",
        _RUNTIME,
        "cuDNN convolution algorithm search of the CUDA execution provider.",
        "EXHAUSTIVE",
    ),
    EnvVar(
        "ORTMODULE_SKIPCHECK_POLICY",
        "SkipCheck",
        SkipCheck.SKIP_CHECK_DISABLED,
        _flags(SkipCheck, SkipCheck.SKIP_CHECK_DISABLED),
        "SkipCheck flag names joined with |; SKIP_CHECK_DISABLED stands alone",
        _RUNTIME,
        "Per-call checks to skip after the first step (device, gradient build, execution agent).",
        "SKIP_CHECK_DEVICE|SKIP_CHECK_BUILD_GRADIENT",
    ),
    _switch(
        "ORTMODULE_USE_TRITON",
        False,
        _TRITON,
        "Run supported ONNX subgraphs with generated Triton kernels.",
    ),
    EnvVar(
        "ORTMODULE_TRITON_CONFIG_FILE",
        "path",
        None,
        _existing_file,
        "an existing JSON file (ops, initializer, min_nodes)",
        _TRITON,
        "Which ops Triton may take and how; unset: every supported op.",
        "triton_config.json",
    ),
    _switch(
        "ORTMODULE_TRITON_DEBUG",
        False,
        _TRITON,
        "Save the subgraphs and generated Triton code under ./triton_debug.",
    ),
    _switch(
        "ORTMODULE_ENABLE_TUNING",
        False,
        _TRITON,
        "Tune ops that have several implementations online on the target device.",
    ),
    EnvVar(
        "ORTMODULE_MAX_TUNING_DURATION_MS",
        "int",
        None,
        _int_in(1),
        "a positive integer (milliseconds)",
        _TRITON,
        "Upper bound on online tuning time per op; unset: the engine's default.",
        "9999",
    ),
    EnvVar(
        "ORTMODULE_TUNING_RESULTS_PATH",
        "path",
        None,
        _path,
        "a path",
        _TRITON,
        "Where tuning results are saved (tuning on) or loaded from (tuning off).",
        "/tmp/tuning_results",
    ),
    _switch(
        "ORTMODULE_USE_FLASH_ATTENTION",
        False,
        _TRITON,
        "Fuse attention and run Flash Attention's Triton kernel; needs ORTMODULE_USE_TRITON=1.",
    ),
)

# Every variable is parsed and validated here, so a typo fails early; what acts on it depends on
# what is installed. The runtime and the exporter act on the others themselves.
#: variables that an installed component acts on: variable -> the distribution that does
NEEDS_COMPONENT: Mapping[str, str] = MappingProxyType(
    {
        **dict.fromkeys(
            (
                "ORTMODULE_PRINT_MEMORY_STATS",
                "ORTMODULE_MEMORY_OPT_LEVEL",
                "ORTMODULE_MEMORY_OPT_CONFIG",
                "ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT",
            ),
            _MEMORY,
        ),
        **dict.fromkeys(
            (
                "ORTMODULE_USE_TRITON",
                "ORTMODULE_TRITON_CONFIG_FILE",
                "ORTMODULE_TRITON_DEBUG",
                "ORTMODULE_ENABLE_TUNING",
                "ORTMODULE_MAX_TUNING_DURATION_MS",
                "ORTMODULE_TUNING_RESULTS_PATH",
                "ORTMODULE_USE_FLASH_ATTENTION",
            ),
            _TRITON,
        ),
        "ORTMODULE_ENABLE_ZERO_STAGE3": "ortmodule-zero",
    }
)
#: variables nothing in this build acts on (unless a component declares it): variable -> why
NO_EFFECT_IN_THIS_BUILD: Mapping[str, str] = MappingProxyType(
    {
        "ORTMODULE_SKIPCHECK_POLICY": "ORTModule runs its per-call checks (device, gradient "
        "build) on every call; skipping them is not built",
    }
)
VARIABLES = tuple(
    replace(var, honoured_by=f"{NEEDS_COMPONENT[var.name]} when installed (else a warning)")
    if var.name in NEEDS_COMPONENT
    else replace(var, honoured_by="nothing in this build (a warning says so)")
    if var.name in NO_EFFECT_IN_THIS_BUILD
    else var
    for var in VARIABLES
)

_BY_NAME: Mapping[str, EnvVar] = {var.name: var for var in VARIABLES}
_DEBUG_FIELDS = ("log_level", "save_onnx", "onnx_prefix")
#: DebugOptions fields that set an ORTMODULE_* variable's value when given (None: not given);
#: validated by the variable's own parser, and the environment still wins
_DEBUG_VARIABLES = {
    "memory_opt_level": "ORTMODULE_MEMORY_OPT_LEVEL",
    "memory_opt_config": "ORTMODULE_MEMORY_OPT_CONFIG",
    "aten_dropout": "ORTMODULE_ATEN_DROPOUT",
    "exporter": "ORTMODULE_EXPORTER",
}

DEFAULT, DEBUG_OPTIONS, ENVIRONMENT = "default", "DebugOptions", "environment"


def format_value(value: Any) -> str:
    """How a value is written in docs and reports: switches as 1/0, flags as ``A|B``."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, enum.IntFlag):
        return flag_names(value)
    if isinstance(value, enum.Enum):
        return value.name
    return str(value)


def unknown_variables(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """``ORTMODULE_*`` names in ``environ`` that no option reads, each with a close known name."""
    found = []
    for name in sorted(environ):
        if name.startswith(PREFIX) and name not in _BY_NAME:
            # compare without the shared prefix, which would make every name look close
            tails = [known[len(PREFIX) :] for known in _BY_NAME]
            close = difflib.get_close_matches(name[len(PREFIX) :], tails, n=1)
            found.append((name, PREFIX + close[0] if close else None))
    return found


def _warn_unknown(environ: Mapping[str, str]) -> None:
    for name, close in unknown_variables(environ):
        hint = f"; did you mean {close}?" if close else ""
        warnings.warn(
            f"{name} is not an ORTModule option and is ignored{hint}", UserWarning, stacklevel=3
        )


@dataclass(frozen=True)
class RuntimeOptions:
    """Every option ORTModule and its components read, with where each value came from.

    Build it with :meth:`resolve`; ``source(field)`` says ``"default"``, ``"DebugOptions"`` or
    ``"environment"``.
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
    print_memory_stats: bool
    cache_dir: str | None
    use_efficient_attention: bool
    aten_sdpa_fallback: bool
    aten_dropout: bool
    fused_attention: bool
    kernel_choice: str
    deepcopy_before_model_export: bool
    memory_opt_level: int
    memory_opt_config: str | None
    enable_mem_efficient_grad_mgmt: bool
    enable_zero_stage3: bool
    torch_threads_in_engine: str
    conv_algo_search: str
    skipcheck_policy: SkipCheck
    use_triton: bool
    triton_config_file: str | None
    triton_debug: bool
    enable_tuning: bool
    max_tuning_duration_ms: int | None
    tuning_results_path: str | None
    use_flash_attention: bool
    sources: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def resolve(
        cls, debug_options: DebugOptions | None = None, environ: Mapping[str, str] = os.environ
    ) -> RuntimeOptions:
        """Defaults, then ``debug_options``, then ``ORTMODULE_*`` variables in ``environ``.

        An empty variable counts as unset. Raises :class:`InvalidOptionError` naming the
        variable, its value and the accepted values; warns about unknown ``ORTMODULE_*`` names.
        """
        values: dict[str, Any] = {var.field: var.default for var in VARIABLES}
        sources = dict.fromkeys(values, DEFAULT)
        base = debug_options if debug_options is not None else DebugOptions()
        for name in _DEBUG_FIELDS:
            values[name] = getattr(base, name)
            sources[name] = DEBUG_OPTIONS if debug_options is not None else DEFAULT
        for name, variable in _DEBUG_VARIABLES.items():
            given = getattr(base, name)
            if given is not None:
                var = _BY_NAME[variable]
                try:
                    values[var.field] = var.parse(str(given))
                except ValueError as err:
                    raise InvalidOptionError(
                        f"DebugOptions({name}={given!r}) is invalid ({err}); accepted: {var.accepted}"
                    ) from None
                sources[var.field] = DEBUG_OPTIONS
        for var in VARIABLES:
            text = environ.get(var.name, "")
            if text.strip():
                values[var.field] = var.convert(text)
                sources[var.field] = ENVIRONMENT
        if values["use_flash_attention"] and not values["use_triton"]:
            raise InvalidOptionError(
                "ORTMODULE_USE_FLASH_ATTENTION=1 needs ORTMODULE_USE_TRITON=1 (the kernel is "
                "Triton's); set both, or unset ORTMODULE_USE_FLASH_ATTENTION."
            )
        _warn_unknown(environ)
        return cls(**values, sources=MappingProxyType(sources))

    @classmethod
    def defaults(cls) -> RuntimeOptions:
        """The options with no DebugOptions and no environment variables."""
        return cls.resolve(None, environ={})

    def source(self, name: str) -> str:
        """Where field ``name`` came from: ``"default"``, ``"DebugOptions"`` or ``"environment"``."""
        try:
            return self.sources[name]
        except KeyError:
            known = ", ".join(f.name for f in fields(self) if f.name != "sources")
            raise KeyError(f"RuntimeOptions has no field {name!r}; fields: {known}") from None

    def settings(self) -> list[tuple[str, str, str]]:
        """``(variable, value as text, source)`` for every ``ORTMODULE_*`` variable, table order."""
        return [
            (var.name, format_value(getattr(self, var.field)), self.source(var.field))
            for var in VARIABLES
        ]


# -- variables that do nothing here ----------------------------------------------------------


def inactive_variables(
    options: RuntimeOptions, handled: Collection[str] = (), cuda_engine: bool = True
) -> list[tuple[str, str]]:
    """``(variable, message)`` for each variable set to a non-default value that nothing acts on.

    ``handled`` holds the variables that installed components honour
    (``ortmodule_exporter.components.handled_options()``); ``cuda_engine`` says whether the
    installed engine has the CUDA execution provider.

    >>> options = RuntimeOptions.resolve(environ={"ORTMODULE_USE_TRITON": "1"})
    >>> inactive_variables(options)[0][0]
    'ORTMODULE_USE_TRITON'
    >>> inactive_variables(options, handled={"ORTMODULE_USE_TRITON"})
    []
    """
    found = []
    for var in VARIABLES:
        value = getattr(options, var.field)
        if value == var.default or var.name in handled:
            continue
        if var.name in NEEDS_COMPONENT:
            package = NEEDS_COMPONENT[var.name]
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
    return found


# -- documentation ------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def variables_markdown(variables: Iterable[EnvVar] = VARIABLES) -> str:
    """The variables table of ``docs/options.md``, generated from :data:`VARIABLES`."""
    lines = [
        "| Variable | Type | Default | Accepted values | Honoured by | Description | Example |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for var in variables:
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
