"""The ``ORTMODULE_*`` variables of the Triton component: declared here, parsed by the runtime.

The runtime parses these declarations (``Component(options=OPTIONS)``) and hands post-export
passes the parsed values (``ORTMODULE_*`` name -> value); :meth:`TritonOptions.resolve` only
reads them. A variable missing there (the pass used without the runtime) is parsed from the
environment with the same declaration, and a text value (a pass called by hand) likewise.

>>> TritonOptions.resolve({}, {"ORTMODULE_USE_TRITON": "1"}).use_triton
True
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ortmodule_exporter.errors import InvalidOptionError
from ortmodule_exporter.option import Option, existing_file, int_in, path, switch

from .errors import TritonConfigError

__all__ = ["OPTIONS", "OPTION_NAMES", "TritonOptions"]

DIST = "ortmodule-triton"

USE_TRITON = switch(
    "ORTMODULE_USE_TRITON",
    False,
    DIST,
    "Run supported ONNX subgraphs with generated Triton kernels.",
    # Triton fuses the engine's own nodes (flash attention's matcher needs them too)
    keeps_engine_nodes="ORTMODULE_USE_TRITON",
)
TRITON_CONFIG_FILE = Option(
    "ORTMODULE_TRITON_CONFIG_FILE",
    "path",
    None,
    existing_file,
    "an existing JSON file (ops, initializer, min_nodes)",
    DIST,
    "Which ops Triton may take and how; unset: every supported op.",
    "triton_config.json",
)
TRITON_DEBUG = switch(
    "ORTMODULE_TRITON_DEBUG",
    False,
    DIST,
    "Save the subgraphs and generated Triton code under ./triton_debug.",
)
ENABLE_TUNING = switch(
    "ORTMODULE_ENABLE_TUNING",
    False,
    DIST,
    "Tune ops that have several implementations online on the target device.",
)
MAX_TUNING_DURATION_MS = Option(
    "ORTMODULE_MAX_TUNING_DURATION_MS",
    "int",
    None,
    int_in(1),
    "a positive integer (milliseconds)",
    DIST,
    "Upper bound on online tuning time per op; unset: the engine's default.",
    "9999",
)
TUNING_RESULTS_PATH = Option(
    "ORTMODULE_TUNING_RESULTS_PATH",
    "path",
    None,
    path,
    "a path",
    DIST,
    "Where tuning results are saved (tuning on) or loaded from (tuning off).",
    "/tmp/tuning_results",
)
USE_FLASH_ATTENTION = switch(
    "ORTMODULE_USE_FLASH_ATTENTION",
    False,
    DIST,
    "Fuse attention and run Flash Attention's Triton kernel; needs ORTMODULE_USE_TRITON=1.",
    requires=("ORTMODULE_USE_TRITON", "the kernel is Triton's"),
)

#: in the order docs/options.md lists them
OPTIONS = (
    USE_TRITON,
    TRITON_CONFIG_FILE,
    TRITON_DEBUG,
    ENABLE_TUNING,
    MAX_TUNING_DURATION_MS,
    TUNING_RESULTS_PATH,
    USE_FLASH_ATTENTION,
)
OPTION_NAMES = tuple(option.name for option in OPTIONS)


def _value(option: Option, options: Mapping[str, Any], environ: Mapping[str, str]) -> Any:
    """The parsed value: the runtime's when given, else the environment's, else the default."""
    given = options.get(option.name)
    if given is None:
        text = environ.get(option.name, "")
        given = text if text.strip() else None
    if given is None:
        return option.default
    if isinstance(given, str) and option.type != "path":
        try:
            return option.convert(given)
        except InvalidOptionError as err:
            raise TritonConfigError(str(err)) from None
    return given


@dataclass(frozen=True)
class TritonOptions:
    use_triton: bool = False
    config_file: Path | None = None
    enable_tuning: bool = False
    max_tuning_duration_ms: int | None = None
    tuning_results_path: Path | None = None
    use_flash_attention: bool = False
    debug: bool = False

    @classmethod
    def resolve(
        cls, options: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> TritonOptions:
        """Options from the runtime's mapping, else the environment; raises
        :class:`TritonConfigError` naming the variable and what it accepts."""
        options = options or {}
        env = os.environ if environ is None else environ
        config = _value(TRITON_CONFIG_FILE, options, env)
        config_path = Path(config) if config is not None else None
        if config_path is not None and not config_path.is_file():
            raise TritonConfigError(
                f"ORTMODULE_TRITON_CONFIG_FILE={str(config)!r}: no such file; give the path of a "
                "JSON fusion config (see the user guide's Triton section) or unset it"
            )
        results = _value(TUNING_RESULTS_PATH, options, env)
        found = cls(
            use_triton=bool(_value(USE_TRITON, options, env)),
            config_file=config_path,
            enable_tuning=bool(_value(ENABLE_TUNING, options, env)),
            max_tuning_duration_ms=_value(MAX_TUNING_DURATION_MS, options, env),
            tuning_results_path=Path(results) if results is not None else None,
            use_flash_attention=bool(_value(USE_FLASH_ATTENTION, options, env)),
            debug=bool(_value(TRITON_DEBUG, options, env)),
        )
        if found.use_flash_attention and not found.use_triton:
            raise TritonConfigError(
                "ORTMODULE_USE_FLASH_ATTENTION=1 needs ORTMODULE_USE_TRITON=1; set both or unset "
                "ORTMODULE_USE_FLASH_ATTENTION"
            )
        return found
