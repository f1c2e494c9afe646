"""The ``ORTMODULE_*`` variables of the Triton component, parsed and validated.

The runtime hands post-export passes the resolved options (``ORTMODULE_*`` name -> parsed value);
a variable missing there (the pass used without the runtime) is read from the environment.

>>> TritonOptions.resolve({}, {"ORTMODULE_USE_TRITON": "1"}).use_triton
True
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import TritonConfigError

__all__ = ["OPTION_NAMES", "TritonOptions"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

OPTION_NAMES = (
    "ORTMODULE_USE_TRITON",
    "ORTMODULE_TRITON_CONFIG_FILE",
    "ORTMODULE_ENABLE_TUNING",
    "ORTMODULE_MAX_TUNING_DURATION_MS",
    "ORTMODULE_TUNING_RESULTS_PATH",
    "ORTMODULE_USE_FLASH_ATTENTION",
    "ORTMODULE_TRITON_DEBUG",
)


def _switch(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise TritonConfigError(f"{name}={value!r}: expected 0 or 1 (or true/false, yes/no, on/off)")


def _positive_int(name: str, value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if isinstance(value, bool) or number < 1:
        raise TritonConfigError(f"{name}={value!r}: expected a positive integer (milliseconds)")
    return number


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

        def get(name: str) -> Any:
            if name in options and options[name] is not None:
                return options[name]
            text = env.get(name, "")
            return text if text.strip() else None

        def flag(name: str) -> bool:
            value = get(name)
            return False if value is None else _switch(name, value)

        config = get("ORTMODULE_TRITON_CONFIG_FILE")
        config_path = Path(config) if config is not None else None
        if config_path is not None and not config_path.is_file():
            raise TritonConfigError(
                f"ORTMODULE_TRITON_CONFIG_FILE={str(config)!r}: no such file; give the path of a "
                "JSON fusion config (see the user guide's Triton section) or unset it"
            )
        duration = get("ORTMODULE_MAX_TUNING_DURATION_MS")
        results = get("ORTMODULE_TUNING_RESULTS_PATH")
        found = cls(
            use_triton=flag("ORTMODULE_USE_TRITON"),
            config_file=config_path,
            enable_tuning=flag("ORTMODULE_ENABLE_TUNING"),
            max_tuning_duration_ms=(
                None
                if duration is None
                else _positive_int("ORTMODULE_MAX_TUNING_DURATION_MS", duration)
            ),
            tuning_results_path=Path(results) if results is not None else None,
            use_flash_attention=flag("ORTMODULE_USE_FLASH_ATTENTION"),
            debug=flag("ORTMODULE_TRITON_DEBUG"),
        )
        if found.use_flash_attention and not found.use_triton:
            raise TritonConfigError(
                "ORTMODULE_USE_FLASH_ATTENTION=1 needs ORTMODULE_USE_TRITON=1; set both or unset "
                "ORTMODULE_USE_FLASH_ATTENTION"
            )
        return found
