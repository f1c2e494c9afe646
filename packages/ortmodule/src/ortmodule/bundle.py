"""The components the meta-package bundles, and the names ``ortmodule`` re-exports from them.

``pip install "ortmodule[cpu]"`` (or ``[cuda]``) installs them; each also installs on its own.
``from ortmodule import FusedAdam`` resolves the name here, on first use, so a component that is
missing only fails the import that needs it, with the distribution to install.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from types import MappingProxyType

__all__ = [
    "BUNDLED",
    "COMPONENT_VARIABLES",
    "BundledComponent",
    "MissingComponentError",
    "find_export",
    "status",
]


class MissingComponentError(ImportError):
    """A name ``ortmodule`` re-exports lives in a component distribution that is not installed."""


@dataclass(frozen=True)
class BundledComponent:
    #: distribution name, e.g. ``"ortmodule-optim"``
    dist: str
    #: import name, e.g. ``"ortmodule_optim"``
    module: str
    #: the names ``ortmodule`` re-exports from it
    exports: tuple[str, ...]
    #: the meta-package extras that install it (``()``: a plain dependency)
    extras: tuple[str, ...] = ()
    summary: str = ""

    @property
    def install(self) -> str:
        return f"pip install {self.dist}"


# Keep in step with packages/ortmodule/pyproject.toml. Components still being built land here
# as they are merged: ortmodule-memory (cpu, cuda), ortmodule-triton and ortmodule-qlora (cuda).
BUNDLED: tuple[BundledComponent, ...] = (
    BundledComponent(
        "ortmodule-optim",
        "ortmodule_optim",
        ("FusedAdam", "FP16_Optimizer"),
        summary="FusedAdam, FP16_Optimizer",
    ),
    BundledComponent(
        "ortmodule-sampler",
        "ortmodule_sampler",
        ("LoadBalancingDistributedSampler", "LoadBalancingDistributedBatchSampler"),
        summary="load-balancing distributed samplers",
    ),
    BundledComponent(
        "ortmodule-zero",
        "ortmodule_zero",
        (),
        summary="DeepSpeed ZeRO stage 3 (ORTMODULE_ENABLE_ZERO_STAGE3)",
    ),
)

_BY_NAME = {name: c for c in BUNDLED for name in c.exports}

# Each component declares its own variables (parser, default, doc) in its package, and the
# runtime reads those declarations from the installed components. This is the one thing the
# meta-package knows of them without them: which distribution to name when a variable is set and
# its component is not installed (the message would otherwise call it an unknown name). A test
# checks it against what the installed components declare.
#: variable -> the distribution (installed by ortmodule's extras) that declares it
COMPONENT_VARIABLES: Mapping[str, str] = MappingProxyType(
    {
        **dict.fromkeys(
            (
                "ORTMODULE_PRINT_MEMORY_STATS",
                "ORTMODULE_MEMORY_OPT_LEVEL",
                "ORTMODULE_MEMORY_OPT_CONFIG",
                "ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT",
            ),
            "ortmodule-memory",
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
            "ortmodule-triton",
        ),
        "ORTMODULE_ENABLE_ZERO_STAGE3": "ortmodule-zero",
    }
)


def find_export(name: str) -> object:
    """The object ``ortmodule.<name>`` stands for; ``AttributeError`` if it re-exports no such name."""
    component = _BY_NAME.get(name)
    if component is None:
        raise AttributeError(f"module 'ortmodule' has no attribute {name!r}")
    try:
        module = importlib.import_module(component.module)
    except ModuleNotFoundError as err:
        if err.name != component.module:
            raise
        raise MissingComponentError(
            f"ortmodule.{name} comes from the {component.dist} distribution, which is not "
            f"installed: {component.install} (or pip install 'ortmodule[cpu]' for every "
            "component)",
            name=component.module,
        ) from err
    return getattr(module, name)


def status(component: BundledComponent) -> tuple[str | None, str | None]:
    """``(installed version or None, why it cannot be used here or None)``."""
    try:
        version = metadata.version(component.dist)
    except metadata.PackageNotFoundError:
        return None, f"not installed: {component.install}"
    try:
        found = importlib.util.find_spec(component.module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return version, f"installed but {component.module} cannot be imported; reinstall it"
    return version, None
