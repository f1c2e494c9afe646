"""Plug-in points for components: discovery, session configuration and runtime step hooks.

A component (memory optimizer, Triton code generation, QLoRA, ZeRO-3, ...) is an installed
distribution that announces itself through the entry-point group ``ortmodule.components``. The
runtime calls :func:`load_components` once; each entry point names a :class:`Component` (or a
function returning one), whose ``register()`` installs the component into the registries:

* torch op -> ONNX symbolic: :func:`ortmodule_exporter.register_symbolic`;
* ``autograd.Function`` class -> exporter: :func:`ortmodule_exporter.python_op.register_python_op_exporter`;
* post-export graph passes: :func:`ortmodule_exporter.register_post_export_pass`;
* engine session configuration: :func:`register_session_contributor` (this module);
* runtime step hooks (pre/post forward and backward, session created): :func:`register_step_hook`.

The runtime never imports a component by name: a new component is a new folder under
``packages/`` whose ``pyproject.toml`` declares the entry point::

    [project.entry-points."ortmodule.components"]
    memory = "ortmodule_memory.component:COMPONENT"

and whose module defines::

    from ortmodule_exporter.components import Component
    from ortmodule_exporter.option import Option, int_in

    LEVEL = Option(
        "ORTMODULE_MEMORY_OPT_LEVEL", "int", 0, int_in(0, 2), "0, 1 or 2", "ortmodule-memory",
        "Recompute level.", "1", debug_field="memory_opt_level",
    )

    def _register() -> None:
        register_session_contributor("memory", contribute)

    COMPONENT = Component(
        name="ortmodule-memory", version="0.1.0", register=_register, options=(LEVEL,),
    )

An :class:`~ortmodule_exporter.option.Option` in ``options`` is declared by the component: the
runtime parses and validates the variable with it, documents it in ``docs/options.md``, maps its
``DebugOptions`` field and warns when it is set while the component is not registered
(:func:`declared_options` reads the installed components' declarations without registering
them). A plain name in ``options`` says the component acts on a variable declared elsewhere.

Everything a component receives from the runtime's options is a read-only mapping from the
``ORTMODULE_*`` variable name to its parsed value (defaults, then ``DebugOptions``, then the
environment), so a component never imports the runtime.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import onnx
import torch

from .option import Option
from .ordered import OrderedRegistry

__all__ = [
    "ENTRY_POINT_GROUP",
    "Component",
    "attribute_changes_graph",
    "register_untracked_attributes",
    "ComponentError",
    "Option",
    "SessionContext",
    "SessionContribution",
    "SessionInfo",
    "StepContext",
    "StepHook",
    "StepPhases",
    "component_failures",
    "declared_options",
    "handled_options",
    "has_session_contributors",
    "is_module_hook_handled",
    "load_components",
    "loaded_components",
    "mark_module_hook_handled",
    "register_component",
    "register_session_contributor",
    "register_step_hook",
    "session_contribution",
    "step_hooks",
    "step_phases",
    "unregister_component",
    "unregister_session_contributor",
    "unregister_step_hook",
]

logger = logging.getLogger("ortmodule.components")

ENTRY_POINT_GROUP = "ortmodule.components"


class ComponentError(RuntimeError):
    """A component's entry point or contribution is malformed; the message names it."""


@dataclass(frozen=True)
class Component:
    """One installed component, as its entry point announces it."""

    #: distribution name, e.g. ``"ortmodule-memory"``
    name: str
    version: str
    #: installs the component into the registries; called once per process
    register: Callable[[], None]
    #: the ``ORTMODULE_*`` variables the component honours: an :class:`Option` it declares
    #: (parser, default, doc), or the name of a variable declared elsewhere
    options: tuple[str | Option, ...] = ()
    #: ``None`` when the component can work on this machine, else the reason it cannot
    check: Callable[[], str | None] | None = None
    #: one line for ``ortmodule doctor``
    summary: str = ""

    @property
    def option_names(self) -> tuple[str, ...]:
        return tuple(o if isinstance(o, str) else o.name for o in self.options)

    @property
    def declared(self) -> tuple[Option, ...]:
        """The options this component declares (not the names it only honours)."""
        return tuple(o for o in self.options if isinstance(o, Option))

    def problem(self) -> str | None:
        """Why the component cannot work here, or ``None``; a failing check is a problem too."""
        if self.check is None:
            return None
        try:
            return self.check()
        except Exception as err:  # a broken check must not break the runtime
            return f"its check failed: {type(err).__name__}: {err}"


_LOCK = threading.RLock()
_COMPONENTS: dict[str, Component] = {}
_FAILURES: dict[str, str] = {}
_DISCOVERED = [False]


def register_component(component: Component) -> None:
    """Install ``component`` now (its ``register()`` runs once); entry points call this for you."""
    if not isinstance(component, Component):
        raise ComponentError(
            f"register_component expects an ortmodule_exporter.components.Component, "
            f"got {type(component).__name__}"
        )
    with _LOCK:
        if component.name in _COMPONENTS:
            return
        component.register()
        _COMPONENTS[component.name] = component


def unregister_component(name: str) -> None:
    """Forget a component (its registrations stay; tests remove them through their registries)."""
    with _LOCK:
        _COMPONENTS.pop(name, None)
        _FAILURES.pop(name, None)


def _from_entry_point(ep: importlib.metadata.EntryPoint) -> Component:
    obj = ep.load()
    if callable(obj) and not isinstance(obj, Component):
        obj = obj()
    if not isinstance(obj, Component):
        raise ComponentError(
            f"entry point {ep.name} = {ep.value!r} in group {ENTRY_POINT_GROUP!r} must name a "
            f"Component or a function returning one, not {type(obj).__name__}"
        )
    return obj


_ANNOUNCED: dict[tuple[str, ...], list[tuple[str, str, Component | str]]] = {}


def _announced() -> list[tuple[str, str, Component | str]]:
    """``(entry-point name, value, Component or the error that stopped it)`` for every installed
    entry point, loaded (not registered) once per ``sys.path``; sorted so the order is stable."""
    key = tuple(sys.path)
    with _LOCK:
        found = _ANNOUNCED.get(key)
        if found is None:
            found = []
            points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
            for ep in sorted(points, key=lambda ep: (ep.name, ep.value)):
                try:
                    found.append((ep.name, ep.value, _from_entry_point(ep)))
                except Exception as err:
                    found.append((ep.name, ep.value, f"{type(err).__name__}: {err}"))
            _ANNOUNCED.clear()
            _ANNOUNCED[key] = found
        return found


def load_components() -> dict[str, Component]:
    """Discover and register every installed component once per process; returns them by name.

    A component that fails to load is logged once at WARNING with its error and skipped, so a
    broken optional component never stops training; :func:`component_failures` lists them.
    """
    with _LOCK:
        if not _DISCOVERED[0]:
            _DISCOVERED[0] = True
            for name, value, got in _announced():
                try:
                    if isinstance(got, str):
                        raise ComponentError(got)
                    register_component(got)
                except Exception as err:
                    _FAILURES[name] = (
                        got if isinstance(got, str) else f"{type(err).__name__}: {err}"
                    )
                    logger.warning(
                        "component %s (%s) could not be loaded and is skipped: %s",
                        name,
                        value,
                        _FAILURES[name],
                    )
        return dict(_COMPONENTS)


def declared_options() -> tuple[tuple[Option, str], ...]:
    """``(option, component name)`` for every option an installed or registered component
    declares, whether or not it is registered yet; a variable declared twice keeps the first.

    >>> [(o.name, c) for o, c in declared_options()][:1]  # doctest: +SKIP
    [('ORTMODULE_MEMORY_OPT_LEVEL', 'ortmodule-memory')]
    """
    with _LOCK:
        found = [got for _n, _v, got in _announced() if isinstance(got, Component)]
        seen = {c.name for c in found}
        found += [c for name, c in sorted(_COMPONENTS.items()) if name not in seen]
    declared: dict[str, tuple[Option, str]] = {}
    for component in sorted(found, key=lambda c: c.name):
        for option in component.declared:
            if option.name in declared:
                logger.warning(
                    "%s is declared by %s and by %s; %s's declaration is used",
                    option.name,
                    declared[option.name][1],
                    component.name,
                    declared[option.name][1],
                )
                continue
            declared[option.name] = (option, component.name)
    return tuple(declared.values())


def loaded_components() -> dict[str, Component]:
    with _LOCK:
        return dict(_COMPONENTS)


def component_failures() -> dict[str, str]:
    """Entry-point name -> the error that stopped it loading."""
    with _LOCK:
        return dict(_FAILURES)


def handled_options() -> frozenset[str]:
    """The ``ORTMODULE_*`` variables that some loaded component honours."""
    with _LOCK:
        return frozenset(name for c in _COMPONENTS.values() for name in c.option_names)


# -- attributes that never change the exported graph -------------------------------------------

_UNTRACKED_PREFIXES: set[str] = set()


def register_untracked_attributes(*prefixes: str) -> None:
    """Attribute names starting with one of ``prefixes`` never cause a re-export.

    ORTModule forwards attribute writes to the wrapped module and re-exports when a written
    value changes, since a flag the forward reads changes the graph. A component whose library
    keeps its own bookkeeping on the module (DeepSpeed's ``ds_*`` counters, written every step)
    declares those names here.

    >>> register_untracked_attributes("mylib_")
    >>> attribute_changes_graph("mylib_counter")
    False
    """
    with _LOCK:
        _UNTRACKED_PREFIXES.update(prefixes)


def attribute_changes_graph(name: str) -> bool:
    """Whether a write of attribute ``name`` on the wrapped module may change the exported graph."""
    return not any(name.startswith(prefix) for prefix in _UNTRACKED_PREFIXES)


# -- engine session configuration --------------------------------------------------------------


@dataclass(frozen=True)
class SessionContext:
    """What a session contributor sees: the graph the engine is about to run, and the options."""

    #: the model handed to the engine session (with gradient nodes when ``training``)
    model: onnx.ModelProto
    training: bool
    device: torch.device
    #: ``ORTMODULE_*`` variable -> parsed value
    options: Mapping[str, Any]
    #: graph input name -> concrete shape of the batch that triggered this build
    input_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    #: the engine's ``BuiltGraph`` (feed/fetch names), so a contributor can open a probe session
    built: Any = None


@dataclass(frozen=True)
class SessionContribution:
    """Session settings a contributor asks for; entries become ``add_session_config_entry`` calls."""

    config_entries: Mapping[str, str] = field(default_factory=dict)
    #: the engine's memory-efficient execution order (recompute needs it to pay off)
    memory_efficient_order: bool = False
    #: on CPU, the engine allocates without an arena: what a run allocated goes back when it is
    #: freed, for less memory between steps and slower steps (``engine.SessionConfig.cpu_arena``)
    release_cpu_memory: bool = False


SessionContributor = Callable[[SessionContext], SessionContribution | None]


def _check_contributor(name: str, fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"register_session_contributor({name!r}, ...): fn must be callable")


_CONTRIBUTORS: OrderedRegistry[SessionContributor] = OrderedRegistry(_check_contributor)


def register_session_contributor(name: str, fn: SessionContributor, order: int = 100) -> None:
    """Let ``fn(context)`` add engine session settings to every session; lower ``order`` first.

    >>> from ortmodule_exporter.components import SessionContribution
    >>> register_session_contributor(
    ...     "probe", lambda ctx: SessionContribution({"session.example": "1"}) if ctx.training else None
    ... )
    >>> unregister_session_contributor("probe")
    """
    _CONTRIBUTORS.register(name, fn, order)


def unregister_session_contributor(name: str) -> None:
    _CONTRIBUTORS.unregister(name)


def has_session_contributors() -> bool:
    """Whether any contributor is registered (the runtime skips building a context otherwise)."""
    return bool(_CONTRIBUTORS)


def session_contribution(context: SessionContext) -> SessionContribution:
    """Every contributor's settings merged; two contributors setting one key differently is an error."""
    entries: dict[str, str] = {}
    owner: dict[str, str] = {}
    efficient = release = False
    for entry in _CONTRIBUTORS.in_order():
        name, got = entry.name, entry.fn(context)
        if got is None:
            continue
        if not isinstance(got, SessionContribution):
            raise ComponentError(
                f"session contributor {name!r} returned {type(got).__name__}, "
                "expected SessionContribution or None"
            )
        for key, value in got.config_entries.items():
            if key in entries and entries[key] != value:
                raise ComponentError(
                    f"session config entry {key!r}: contributor {owner[key]!r} sets "
                    f"{entries[key]!r} and {name!r} sets {value!r}; disable one of them"
                )
            entries[key] = str(value)
            owner[key] = name
        efficient = efficient or got.memory_efficient_order
        release = release or got.release_cpu_memory
    return SessionContribution(entries, efficient, release)


# -- runtime step hooks ------------------------------------------------------------------------


@dataclass(frozen=True)
class StepContext:
    """Passed to every step hook: the wrapped module and the options of its ORTModule."""

    module: torch.nn.Module
    options: Mapping[str, Any]


@dataclass(frozen=True)
class SessionInfo:
    """A session the runtime just created: ``session`` is the exporter's Training/InferenceSession."""

    context: SessionContext
    session: Any
    built: Any


class StepHook:
    """Base class of runtime step hooks; override the phases you need (each defaults to nothing).

    The runtime calls, per ORTModule call: ``pre_forward`` before it reads parameters (so a
    ZeRO-3 hook can gather them), ``post_forward`` after the engine's forward, and around the
    engine's backward ``pre_backward``/``post_backward``. ``on_session`` runs after a new engine
    session is created. ``exporting`` returns a context manager the runtime holds while it exports
    (a copy of) the module, after ``pre_forward``: a component that put hooks on submodules (they
    would run inside the trace) suspends them there.
    """

    def applies_to(self, ctx: StepContext) -> bool:
        """Whether the per-step phases do anything for the ORTModule of ``ctx``.

        Asked once per ORTModule (its options do not change) and again after any hook is
        registered or removed; a hook that answers False costs that ORTModule's steps nothing.
        ``exporting`` and ``on_session`` are called either way.
        """
        return True

    def exporting(self, ctx: StepContext) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def on_session(self, ctx: StepContext, info: SessionInfo) -> None:
        return None

    def pre_forward(self, ctx: StepContext) -> None:
        return None

    def post_forward(self, ctx: StepContext, outputs: Any) -> None:
        return None

    def pre_backward(self, ctx: StepContext) -> None:
        return None

    def post_backward(self, ctx: StepContext) -> None:
        return None


def _check_hook(name: str, hook: Any) -> None:
    if not isinstance(hook, StepHook):
        raise TypeError(
            f"register_step_hook({name!r}, ...): the hook must subclass "
            f"ortmodule_exporter.components.StepHook, got {type(hook).__name__}"
        )


_HOOKS: OrderedRegistry[StepHook] = OrderedRegistry(_check_hook)


def register_step_hook(name: str, hook: StepHook, order: int = 100) -> None:
    """Call ``hook``'s phases on every ORTModule step; lower ``order`` runs first (reversed after).

    >>> class Count(StepHook):
    ...     calls = 0
    ...     def pre_forward(self, ctx):
    ...         Count.calls += 1
    >>> register_step_hook("count", Count())
    >>> unregister_step_hook("count")
    """
    _HOOKS.register(name, hook, order)


def unregister_step_hook(name: str) -> None:
    _HOOKS.unregister(name)


def step_hooks() -> tuple[StepHook, ...]:
    """The registered hooks in order; an empty tuple costs the hot path nothing."""
    return _HOOKS.fns()


_PHASES = ("pre_forward", "post_forward", "pre_backward", "post_backward")


@dataclass(frozen=True)
class StepPhases:
    """For one ORTModule: the hooks each per-step phase calls, in calling order.

    Only hooks that apply to its context (:meth:`StepHook.applies_to`) and override the phase
    are listed, so a step calls nothing that would do nothing. ``post_*`` are in reverse order.
    """

    ctx: StepContext
    #: the registered hooks these were chosen from (``step_hooks()`` at the time)
    hooks: tuple[StepHook, ...]
    pre_forward: tuple[StepHook, ...]
    post_forward: tuple[StepHook, ...]
    pre_backward: tuple[StepHook, ...]
    post_backward: tuple[StepHook, ...]


def step_phases(ctx: StepContext, previous: StepPhases | None = None) -> StepPhases:
    """The hooks of each per-step phase for ``ctx``: ``previous`` while no hook was registered
    or removed since it was made, else chosen afresh.

    >>> phases = step_phases(ctx)
    >>> for hook in phases.pre_forward:
    ...     hook.pre_forward(ctx)
    """
    hooks = _HOOKS.fns()
    if previous is not None and previous.hooks is hooks and previous.ctx is ctx:
        return previous
    applying = [h for h in hooks if h.applies_to(ctx)]
    chosen = {
        phase: tuple(h for h in applying if getattr(type(h), phase) is not getattr(StepHook, phase))
        for phase in _PHASES
    }
    return StepPhases(
        ctx=ctx,
        hooks=hooks,
        pre_forward=chosen["pre_forward"],
        post_forward=chosen["post_forward"][::-1],
        pre_backward=chosen["pre_backward"],
        post_backward=chosen["post_backward"][::-1],
    )


# -- submodule hooks a component stands in for -------------------------------------------------

_HANDLED_ATTR = "__ortmodule_handled_by__"


def mark_module_hook_handled(fn: Callable[..., Any], component: str) -> None:
    """Say that ``component`` does the work of the submodule hook ``fn`` at every step.

    ORTModule warns that hooks on submodules run only during export; a hook marked here is left
    out of that warning (ZeRO-3 marks DeepSpeed's fetch/release hooks it replaces).
    """
    try:
        setattr(fn, _HANDLED_ATTR, component)
    except (AttributeError, TypeError):  # a builtin or a bound method: leave the warning on
        logger.debug("cannot mark hook %r as handled by %s", fn, component)


def is_module_hook_handled(fn: Callable[..., Any]) -> bool:
    return getattr(fn, _HANDLED_ATTR, None) is not None
