"""FP16_Optimizer: give a mixed-precision optimizer multi-tensor overflow checks, norms and clips.

The wrapped optimizer is modified in place (its overflow check, gradient norm and clipping are
replaced by multi-tensor versions), so a training engine holding the same object, such as a
DeepSpeed engine, benefits too. Which methods are replaced is decided per optimizer class by a
modifier in a small registry; DeepSpeed's are registered by default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Imports nothing from DeepSpeed; the modifiers import it when they run.
from ortmodule_optim.deepspeed_modifiers import DEEPSPEED_MODIFIERS

__all__ = ["FP16_Optimizer", "register_fp16_modifier", "supported_fp16_optimizers"]

Modifier = Callable[[Any], None]
"""Replaces methods of one optimizer instance in place."""

_MODIFIERS: dict[str, Modifier] = dict(DEEPSPEED_MODIFIERS)
_MODIFIED = "_ortmodule_fp16_modified"


def register_fp16_modifier(class_path: str, modifier: Modifier) -> None:
    """Teach :class:`FP16_Optimizer` an optimizer class, by its ``module.QualName``.

    The modifier receives the optimizer instance and replaces its methods in place; subclasses of
    a registered class are matched too. A later registration for the same class wins.

    >>> def use_multi_tensor_overflow_check(opt):
    ...     opt.has_overflow = lambda params: bool(has_inf_or_nan([p.grad for p in params]))
    >>> register_fp16_modifier("mylib.amp.MyLossScaledOptimizer", use_multi_tensor_overflow_check)
    """
    _MODIFIERS[class_path] = modifier


def supported_fp16_optimizers() -> list[str]:
    """The class paths :class:`FP16_Optimizer` accepts."""
    return sorted(_MODIFIERS)


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _find_modifier(optimizer: Any) -> Modifier | None:
    for cls in type(optimizer).__mro__:
        modifier = _MODIFIERS.get(_class_path(cls))
        if modifier is not None:
            return modifier
    return None


class FP16_Optimizer:  # noqa: N801 - the name users know from DeepSpeed and apex
    """Wrap a DeepSpeed mixed-precision optimizer; behaviour stays that of the wrapped one.

    >>> model, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=adamw, config=cfg)
    >>> optimizer = FP16_Optimizer(optimizer)

    Every attribute not defined here (``loss_scale``, ``overflow``, ``cur_scale``...) is read
    from the wrapped optimizer, which stays reachable as ``.wrapped``.
    """

    def __init__(self, optimizer: Any) -> None:
        modifier = _find_modifier(optimizer)
        if modifier is None:
            supported = "\n  ".join(supported_fp16_optimizers())
            hint = ""
            if hasattr(optimizer, "optimizer") and _find_modifier(optimizer.optimizer):
                hint = (
                    f" It holds a supported optimizer as .optimizer: pass that "
                    f"({type(optimizer).__name__}.optimizer) instead."
                )
            raise TypeError(
                f"FP16_Optimizer does not know {_class_path(type(optimizer))}.{hint} Supported "
                f"optimizers (pass the one deepspeed.initialize returns):\n  {supported}\n"
                "Teach it another one with ortmodule_optim.register_fp16_modifier()."
            )
        if not getattr(optimizer, _MODIFIED, False):
            modifier(optimizer)
            setattr(optimizer, _MODIFIED, True)
        object.__setattr__(self, "wrapped", optimizer)

    wrapped: Any

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.wrapped, name, value)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The wrapped optimizer's step (whose checks are now multi-tensor)."""
        if closure is None:
            return self.wrapped.step()
        return self.wrapped.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wrapped.zero_grad(set_to_none=set_to_none)

    def backward(self, loss: Any, *args: Any, **kwargs: Any) -> Any:
        return self.wrapped.backward(loss, *args, **kwargs)

    def state_dict(self) -> Any:
        return self.wrapped.state_dict()

    def load_state_dict(self, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        return self.wrapped.load_state_dict(state_dict, *args, **kwargs)

    @property
    def param_groups(self) -> Any:
        return self.wrapped.param_groups

    @property
    def state(self) -> Any:
        return self.wrapped.state

    def __repr__(self) -> str:
        return f"FP16_Optimizer({self.wrapped!r})"
