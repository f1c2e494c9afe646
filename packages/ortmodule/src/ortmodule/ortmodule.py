"""``ORTModule``: an ``nn.Module`` wrapper whose forward and backward run in ONNX Runtime."""

from __future__ import annotations

import functools
import inspect
import logging
import types
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch

from ortmodule_exporter.components import (
    attribute_changes_graph,
    is_module_hook_handled,
    load_components,
)

from . import custom_autograd, integrations
from .debug_options import DebugOptions
from .execution import GraphRunner
from .fallback import FallbackManager
from .inactive_options import warn_inactive_options
from .log import apply_engine_severity, configure_logger
from .options import RuntimeOptions
from .runner_config import runner_config

logger = logging.getLogger("ortmodule")

_WRAPPED = "_original_module"


class ORTModule(torch.nn.Module):
    """Wrap a module so its training steps run through ONNX Runtime's training engine.

    >>> import torch
    >>> from ortmodule import ORTModule
    >>> model = ORTModule(torch.nn.Linear(4, 2))
    >>> model(torch.randn(3, 4)).sum().backward()
    >>> model.weight.grad.shape
    torch.Size([2, 4])

    The wrapper behaves like the module it wraps: ``state_dict`` keys, parameters, buffers and
    children are the wrapped module's, attributes fall through to it, ``.module`` returns it.
    ``model.__class__`` is the wrapped module's class, so ``isinstance`` holds for it as for the
    module (``type(model)`` stays ``ORTModule``, and so does ``isinstance(model, ORTModule)``).
    Attribute writes reach the wrapped module (``model.use_cache = False``) and a changed flag
    re-exports; the wrapped module's own methods run with ``self`` being the wrapper, so their
    ``self(...)`` calls go through the engine; ``forward`` has the wrapped module's signature.
    """

    def __init__(self, module: torch.nn.Module, debug_options: DebugOptions | None = None) -> None:
        _check_wrappable(module)
        super().__init__()
        self._modules[_WRAPPED] = module
        self.training = module.training
        object.__setattr__(self, "_debug_options", debug_options)
        self._setup()

    def _setup(self) -> None:
        integrations.install_available()
        options = RuntimeOptions.resolve(self._debug_options)
        configure_logger(options.log_level)
        # installed components (memory, Triton, QLoRA, ZeRO-3) register their plug-ins once
        load_components()
        warn_inactive_options(options)  # after the components: they may honour some variables
        custom_autograd.configure(options)
        apply_engine_severity(options.log_level)
        object.__setattr__(self, "_options", options)
        object.__setattr__(
            self,
            "_runner",
            GraphRunner(self.module, runner_config(options), quiet=_quiet_for(options)),
        )
        object.__setattr__(self, "_fallback", FallbackManager(options, self.module))
        object.__setattr__(self, "_warned_hooks", False)
        object.__setattr__(self, "forward", self._forward_with_module_signature())
        self._runner.module_state = self.__dict__.setdefault("_written", {})

    def _forward_with_module_signature(self) -> Callable[..., Any]:
        """``forward`` as an instance attribute whose signature is the wrapped module's (Hugging
        Face's Trainer reads it to choose which dataset columns to pass). A ``partial`` adds no
        Python frame, so warnings keep pointing at the user's call."""
        forward = functools.partial(ORTModule.forward, self)
        wrapped_forward = self.module.forward
        try:
            forward.__signature__ = inspect.signature(wrapped_forward)  # type: ignore[attr-defined]
        except (TypeError, ValueError):
            pass
        forward.__doc__ = wrapped_forward.__doc__
        return forward

    # -- the wrapped module ------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        """The module this ORTModule wraps."""
        return self._modules[_WRAPPED]  # type: ignore[return-value]

    @property
    def options(self) -> RuntimeOptions:
        return self._options  # type: ignore[no-any-return]

    # Libraries decide what a model is from ``model.__class__``: Hugging Face's Trainer finds the
    # label names in ``find_labels(model.__class__)`` (the forward's signature and the class
    # name) and saves with ``save_pretrained`` only when ``isinstance(model, PreTrainedModel)``.
    # Seeing ORTModule there, it computed no eval loss and saved weights without config.json.
    # ``isinstance`` consults ``__class__`` when ``type()`` does not match, so presenting the
    # wrapped module's class makes the wrapper pass for its module wherever a library asks.
    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: F811
        modules = self.__dict__.get("_modules")
        if modules is None or _WRAPPED not in modules:
            return type(self)
        return type(modules[_WRAPPED])

    def _get_name(self) -> str:  # repr: the wrapper's own name, not its module's
        return type(self).__name__

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(dir(type(self))))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules")
            if modules is None or _WRAPPED not in modules:
                raise
            wrapped = modules[_WRAPPED]
            if _user_method(type(wrapped), name) is not None:
                return self._routed_method(getattr(wrapped, name))
            return getattr(wrapped, name)

    def _routed_method(self, bound: Callable[..., Any]) -> Callable[..., Any]:
        """``bound`` (a method of the wrapped module) run with the module's forward routed
        through this wrapper, so ``self(x)`` and ``self.forward(x)`` inside it use the engine.

        ``self`` stays the wrapped module (``type(self)``, ``super()`` and ``isinstance`` work as
        in eager: Hugging Face's ``generate`` looks its decoding methods up on ``type(self)``).
        """

        @functools.wraps(bound)
        def call(*args: Any, **kwargs: Any) -> Any:
            module = self.module
            if "forward" in module.__dict__:  # already routed (a nested call) or user-set
                return bound(*args, **kwargs)

            def routed(*a: Any, **k: Any) -> Any:
                # the export, the fallback and the signature see the module's own forward
                del module.__dict__["forward"]
                try:
                    return self(*a, **k)
                finally:
                    module.__dict__["forward"] = routed

            # with the forward's signature: Hugging Face's generate checks the keyword
            # arguments it passes (pixel_values, ...) against inspect.signature(self.forward)
            functools.update_wrapper(routed, module.forward)
            module.__dict__["forward"] = routed
            try:
                return bound(*args, **kwargs)
            finally:
                module.__dict__.pop("forward", None)

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        if self._owns(name):
            super().__setattr__(name, value)
            return
        self._note_write(name, value)
        setattr(self.module, name, value)

    def __delattr__(self, name: str) -> None:
        if self._owns(name):
            super().__delattr__(name)
            return
        self._note_write(name, _DELETED)
        delattr(self.module, name)

    def _owns(self, name: str) -> bool:
        """Attributes of the wrapper itself; every other write goes to the wrapped module."""
        modules = self.__dict__.get("_modules")
        return (
            modules is None
            or _WRAPPED not in modules
            or name in self.__dict__
            or hasattr(type(self), name)
        )

    def _note_write(self, name: str, value: Any) -> None:
        # The written values are part of the graph key: a flag the forward reads (use_cache,
        # a branch switch) changes the exported graph, so a new value re-exports and the old
        # value finds its graph again. Unhashable values (modules, tensors) count by identity.
        # Called before the write: the first write of a name remembers the value it replaces,
        # so writing that value back gives the original key.
        if not attribute_changes_graph(name):  # a component's bookkeeping (DeepSpeed's ds_*)
            return
        written: dict[str, Hashable] = self.__dict__["_written"]
        first: dict[str, Hashable] = self.__dict__.setdefault("_first_values", {})
        if name not in first:
            first[name] = _token(getattr(self.module, name, _DELETED))
        token = _token(value)
        if token == first[name]:
            written.pop(name, None)
        else:
            written[name] = token

    # -- forward -----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        integrations.install_available()
        fallback: FallbackManager = self._fallback
        if fallback.use_torch():
            return self.module(*args, **kwargs)
        try:
            outputs = self._runner(args, kwargs)
        except Exception as err:
            return fallback.handle(err, args, kwargs)
        # after the runner: components mark the submodule hooks they stand in for on first use
        self._warn_about_hooks()
        return outputs

    def _warn_about_hooks(self) -> None:
        if self._warned_hooks:
            return
        object.__setattr__(self, "_warned_hooks", True)
        hooked = [
            name or type(self.module).__name__
            for name, m in self.module.named_modules()
            if any(
                not is_module_hook_handled(fn)
                for hooks in (
                    m._forward_hooks,
                    m._forward_pre_hooks,
                    m._backward_hooks,
                    m._backward_pre_hooks,
                )
                for fn in hooks.values()
            )
        ]
        if hooked:
            warnings.warn(
                "ORTModule: forward/backward hooks on submodules run only while the model is "
                f"exported, not at every step ({', '.join(hooked[:5])}). Register hooks on the "
                "ORTModule itself, or tensor hooks on parameters (param.register_hook), which "
                "fire as in eager.",
                stacklevel=3,
            )

    # -- nn.Module behaviour delegated to the wrapped module -----------------------------------
    def train(self, mode: bool = True) -> ORTModule:
        self.training = mode
        self.module.train(mode)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> ORTModule:  # .to(), .cuda(), .half(), ...
        self.module._apply(fn, recurse)
        return self

    def apply(self, fn: Any) -> ORTModule:
        self.module.apply(fn)
        return self

    def named_children(self) -> Any:
        return self.module.named_children()

    def named_modules(
        self, memo: Any = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Any:
        return self.module.named_modules(memo, prefix, remove_duplicate)

    def state_dict(
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> Any:
        return self.module.state_dict(
            *args, destination=destination, prefix=prefix, keep_vars=keep_vars
        )

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _replicate_for_data_parallel(self) -> ORTModule:
        raise TypeError(_DATA_PARALLEL_MESSAGE)

    def extra_repr(self) -> str:
        return "engine=onnxruntime-training"

    # -- copy and pickle: engine state is rebuilt lazily ---------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("_runner", "_fallback", "_options", "forward"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickle's default reduction names the class by ``obj.__class__`` (the wrapped
        # module's, see above) and then refuses the mismatch with ``type(obj)``; name ours
        return (_new_wrapper, (type(self),), self.__getstate__())

    def __deepcopy__(self, memo: dict[int, Any]) -> ORTModule:
        import copy

        clone = ORTModule.__new__(ORTModule)
        memo[id(self)] = clone
        clone.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return clone


_DELETED = object()


def _new_wrapper(cls: type[ORTModule]) -> ORTModule:
    """An empty ``cls`` for unpickling; ``__setstate__`` fills it."""
    return cls.__new__(cls)


def _token(value: Any) -> Hashable:
    try:
        hash(value)
        return (type(value), value)
    except TypeError:
        return (type(value), id(value))


def _user_method(cls: type, name: str) -> Callable[..., Any] | None:
    """``cls.name`` when it is a plain function the user's classes define (not nn.Module's)."""
    if name.startswith("__") or name == "forward":
        return None
    for klass in cls.__mro__:
        if name in klass.__dict__:
            if klass in _MODULE_BASES:
                return None
            found = klass.__dict__[name]
            return found if isinstance(found, types.FunctionType) else None
    return None


_MODULE_BASES = frozenset(torch.nn.Module.__mro__)


_DATA_PARALLEL_MESSAGE = (
    "torch.nn.DataParallel(ORTModule(model)) is not supported: DataParallel copies the module to "
    "each GPU at every step, and the engine state ORTModule builds cannot be copied that way. Run "
    "one process per device with torch.nn.parallel.DistributedDataParallel(ORTModule(model)) "
    "(or DeepSpeed) instead."
)


def _refuse_data_parallel(parent: torch.nn.Module, name: str, child: Any) -> None:
    # DataParallel on a CPU-only machine never replicates, so only its constructor can refuse
    if isinstance(child, ORTModule) and isinstance(parent, torch.nn.DataParallel):
        raise TypeError(_DATA_PARALLEL_MESSAGE)


torch.nn.modules.module.register_module_module_registration_hook(_refuse_data_parallel)


def _check_wrappable(module: Any) -> None:
    if isinstance(module, torch.nn.DataParallel):
        raise TypeError(
            "ORTModule does not support torch.nn.DataParallel. Use "
            "torch.nn.parallel.DistributedDataParallel(ORTModule(model)) instead."
        )
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            "ORTModule must be inside DistributedDataParallel, not outside it: write "
            "DistributedDataParallel(ORTModule(model)), not ORTModule(DistributedDataParallel(model))."
        )
    if isinstance(module, ORTModule):
        raise TypeError("this module is already an ORTModule; wrap the original module once")
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"ORTModule wraps a torch.nn.Module, got {type(module).__module__}.{type(module).__qualname__}. "
            "Wrap the model object (an nn.Module), not a function or a scripted/compiled callable."
        )


def _quiet_for(options: RuntimeOptions) -> Any:
    from .log import suppress_output

    return lambda: suppress_output(options.log_level)
