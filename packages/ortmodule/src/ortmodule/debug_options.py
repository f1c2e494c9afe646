"""What a developer asks for when debugging one ORTModule: log level and ONNX dumps.

>>> from ortmodule.debug_options import DebugOptions, LogLevel
>>> DebugOptions(log_level=LogLevel.INFO, save_onnx=True, onnx_prefix="my_model").log_level
<LogLevel.INFO: 2>

``ORTMODULE_LOG_LEVEL`` wins over ``log_level`` here, and ``ORTMODULE_SAVE_ONNX_PATH`` names the
folder the models go to (the current working directory when unset); both are read by
:meth:`ortmodule.options.RuntimeOptions.resolve`, never here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

from ortmodule_exporter.errors import InvalidOptionError

__all__ = ["DebugOptions", "LogLevel"]

#: the fields the runtime checks itself; the others set a component's variable
_RUNTIME_FIELDS = ("log_level", "save_onnx", "onnx_prefix", "aten_dropout", "exporter")
#: a declared option's type -> the Python type its DebugOptions field takes
_KINDS: dict[str, type] = {"int": int, "bool": bool, "str": str, "path": str}


class LogLevel(enum.IntEnum):
    """ORTModule's log levels, most talkative first (see ``docs/options.md`` for what each shows)."""

    VERBOSE = 0
    DEVINFO = 1
    INFO = 2
    WARNING = 3
    ERROR = 4
    FATAL = 5

    @classmethod
    def parse(cls, value: object, source: str = "log_level") -> LogLevel:
        """A LogLevel from a LogLevel, its name (any case) or its number; ``source`` names the option."""
        if isinstance(value, cls):
            return value
        accepted = ", ".join(level.name for level in cls)
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                pass
        raise InvalidOptionError(
            f"{source}={value!r} is not a log level; use one of {accepted} (LogLevel.<NAME>)."
        )


@dataclass(frozen=True)
class DebugOptions:
    """Per-model debugging options passed as ``ORTModule(model, DebugOptions(...))``.

    ``save_onnx=True`` writes every graph ORTModule builds into ``ORTMODULE_SAVE_ONNX_PATH``
    (default: the current working directory) as
    ``<onnx_prefix>_<training|inference>_v<N>_<stage>.onnx``, so it needs ``onnx_prefix``. ``N``
    numbers the graphs (the next number free in the folder, so a re-export or a later run never
    overwrites earlier files); the stages are ``1_exported`` (what torch.onnx wrote),
    ``2_pre_gradient`` (after the engine's graph optimisations, training graphs only),
    ``3_gradient`` or ``3_built`` (the forward+backward or inference graph the engine built) and
    ``4_execution`` (after the session's optimisations: the model the engine runs).
    """

    log_level: LogLevel = LogLevel.WARNING
    save_onnx: bool = False
    onnx_prefix: str = ""
    # Fields for components' variables: the component's declaration names the field
    # (Option.debug_field), checks the value and maps it to its variable; the variable, when set,
    # wins. They stay here so that ORTModule(model, DebugOptions(...)) keeps one signature.
    #: ``ORTMODULE_MEMORY_OPT_LEVEL`` from code (0, 1 or 2), declared by ortmodule-memory
    memory_opt_level: int | None = None
    #: ``ORTMODULE_MEMORY_OPT_CONFIG`` from code: the JSON file of recompute plans
    memory_opt_config: str | None = None
    #: ``ORTMODULE_ATEN_DROPOUT`` from code: dropout on PyTorch's kernel, eager's masks
    aten_dropout: bool | None = None
    #: ``ORTMODULE_EXPORTER`` from code: ``"torchscript"`` or ``"torch_export"``
    exporter: str | None = None

    def __post_init__(self) -> None:
        # frozen: normalise through object.__setattr__ so "INFO" and 2 become LogLevel.INFO
        object.__setattr__(
            self, "log_level", LogLevel.parse(self.log_level, "DebugOptions.log_level")
        )
        if not isinstance(self.save_onnx, bool):
            raise InvalidOptionError(
                f"DebugOptions.save_onnx={self.save_onnx!r} must be True or False."
            )
        if not isinstance(self.onnx_prefix, str):
            raise InvalidOptionError(
                f"DebugOptions.onnx_prefix={self.onnx_prefix!r} must be a string (the file name prefix)."
            )
        if self.save_onnx and not self.onnx_prefix:
            raise InvalidOptionError(
                "DebugOptions(save_onnx=True) needs onnx_prefix, the prefix of the saved file names: "
                "DebugOptions(save_onnx=True, onnx_prefix='my_model'). Set ORTMODULE_SAVE_ONNX_PATH "
                "to choose the folder (default: the current working directory)."
            )
        if self.aten_dropout is not None and not isinstance(self.aten_dropout, bool):
            raise InvalidOptionError(
                f"DebugOptions.aten_dropout={self.aten_dropout!r} must be True (dropout on "
                "PyTorch's kernel, eager's masks), False (the engine's Dropout) or None (unset)."
            )
        if self.exporter is not None and (
            not isinstance(self.exporter, str)
            or self.exporter.lower() not in ("torchscript", "torch_export")
        ):
            raise InvalidOptionError(
                f"DebugOptions.exporter={self.exporter!r} must be 'torchscript' (the default), "
                "'torch_export' or None (unset)."
            )
        if any(sep in self.onnx_prefix for sep in ("/", "\\")):
            raise InvalidOptionError(
                f"DebugOptions.onnx_prefix={self.onnx_prefix!r} must be a file name prefix without a "
                "path separator; choose the folder with ORTMODULE_SAVE_ONNX_PATH."
            )
        self._check_component_fields()

    def _check_component_fields(self) -> None:
        """A field given for a component's variable is checked by that variable's declaration
        (the component owns its values); a field no installed component declares is left to
        :meth:`RuntimeOptions.resolve`, which warns that it has no effect."""
        given = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in _RUNTIME_FIELDS and getattr(self, f.name) is not None
        }
        if not given:
            return
        # the declarations load with the components (torch, the exporter): only when needed
        from ortmodule_exporter.components import declared_options

        for option, _component in declared_options():
            if option.debug_field not in given:
                continue
            value = given[option.debug_field]
            kind = _KINDS.get(option.type, object)
            reason = None
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                reason = f"not of type {kind.__name__}"
            elif option.type != "path":  # a file is looked for when the options are resolved
                try:
                    option.parse(str(value))
                except ValueError as err:
                    reason = str(err)
            if reason is not None:
                raise InvalidOptionError(
                    f"DebugOptions({option.debug_field}={value!r}) is invalid ({reason}); "
                    f"accepted: {option.accepted}"
                )
