"""The components the meta-package bundles, and the names ``ortmodule`` re-exports from them.

``pip install "ortmodule[cpu]"`` (or ``[cuda]``) installs them; each also installs on its own.
A component offers a name for ``ortmodule`` to re-export through the entry-point group
``ortmodule.exports`` in its own ``pyproject.toml``::

    [project.entry-points."ortmodule.exports"]
    FusedAdam = "ortmodule_optim:FusedAdam"

``from ortmodule import FusedAdam`` resolves the name there, on first use, so a component that is
missing (or cannot be imported) only fails the import that needs it, with the distribution to
install; the component depends on nothing of the meta-package.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from types import MappingProxyType

__all__ = [
    "BUNDLED",
    "COMPONENT_VARIABLES",
    "EXPORTS_GROUP",
    "BundledComponent",
    "MissingComponentError",
    "exports",
    "find_export",
    "status",
]


class MissingComponentError(ImportError):
    """A name ``ortmodule`` re-exports lives in a component distribution that is not installed."""


#: the entry-point group of the names ``ortmodule`` re-exports
EXPORTS_GROUP = "ortmodule.exports"


@dataclass(frozen=True)
class BundledComponent:
    #: distribution name, e.g. ``"ortmodule-optim"``
    dist: str
    #: the meta-package extras that install it (``()``: a plain dependency)
    extras: tuple[str, ...] = ()
    summary: str = ""

    @property
    def install(self) -> str:
        return f"pip install {self.dist}"


# Keep in step with packages/ortmodule/pyproject.toml (a test checks it): the doctor reports each
# one's state. Components still being built land here as they are merged: ortmodule-memory (cpu,
# cuda), ortmodule-triton and ortmodule-qlora (cuda).
BUNDLED: tuple[BundledComponent, ...] = (
    BundledComponent("ortmodule-optim", summary="FusedAdam, FP16_Optimizer"),
    BundledComponent("ortmodule-sampler", summary="load-balancing distributed samplers"),
    BundledComponent(
        "ortmodule-zero", summary="DeepSpeed ZeRO stage 3 (ORTMODULE_ENABLE_ZERO_STAGE3)"
    ),
)


def exports() -> dict[str, metadata.EntryPoint]:
    """Name -> the entry point of every name an installed component offers for re-export."""
    return {ep.name: ep for ep in metadata.entry_points(group=EXPORTS_GROUP)}


def _dist_name(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else ep.module.split(".")[0].replace("_", "-")


def find_export(name: str, promised: bool = False) -> object:
    """The object ``ortmodule.<name>`` stands for; ``AttributeError`` if no installed component
    offers it. ``promised``: ``ortmodule.__all__`` lists the name, so its component is missing."""
    ep = exports().get(name)
    if ep is None:
        if promised:
            raise MissingComponentError(
                f"ortmodule.{name} comes from a component distribution that is not installed: "
                "pip install 'ortmodule[cpu]' installs every component",
                name=name,
            )
        raise AttributeError(f"module 'ortmodule' has no attribute {name!r}")
    try:
        return ep.load()
    except ModuleNotFoundError as err:
        if err.name != ep.module.split(".")[0]:
            raise
        dist = _dist_name(ep)
        raise MissingComponentError(
            f"ortmodule.{name} comes from the {dist} distribution, which is not installed or "
            f"cannot be imported: pip install {dist} (or pip install 'ortmodule[cpu]' for every "
            "component)",
            name=err.name,
        ) from err


def status(component: BundledComponent) -> tuple[str | None, str | None]:
    """``(installed version or None, why it cannot be used here or None)``."""
    try:
        version = metadata.version(component.dist)
    except metadata.PackageNotFoundError:
        return None, f"not installed: {component.install}"
    for ep in exports().values():
        if _dist_name(ep) != component.dist:
            continue
        try:
            ep.load()
        except ImportError:
            return version, f"installed but {ep.module} cannot be imported; reinstall it"
    return version, None


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
