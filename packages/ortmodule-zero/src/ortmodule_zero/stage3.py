"""ZeRO stage 3 under ORTModule: gather DeepSpeed's partitioned parameters for the engine.

DeepSpeed's stage 3 keeps each parameter as a shard and gathers it in forward pre-hooks on every
submodule. ORTModule never calls the submodules (the engine runs one graph for the whole module),
so those hooks do not fire, and the export would trace a deep copy that still carries them. This
hook does their job at the granularity ORTModule has, the whole wrapped module:

* ``pre_forward``: every partitioned parameter is gathered with DeepSpeed's own coalesced
  all-gather (``param.all_gather``), before the runtime reads shapes (graph key, export) or hands
  the tensors to the engine;
* ``exporting``: DeepSpeed's submodule hooks are suspended while the module is traced, and it is
  traced in place, not deep-copied (``traced_in_place``): its parameters are gathered to full
  size then, and a copy held the whole model a second time on every rank (measured: +1.1x the
  parameters' bytes at the peak, still resident after the export);
* ``session_contribution``: an engine session built while a stage-3 module steps allocates
  without the CPU engine's arena (``ORTMODULE_CPU_MEM_ARENA=AUTO``). The arena keeps a step's peak
  of engine buffers (the gathered model's activations and every gradient at once) resident
  between steps, beneath DeepSpeed's buffers and the optimizer; at 360M parameters on 2 ranks that
  was the difference between a rank killed at 12.2 GiB and one that peaks at 11314 MiB;
* after the backward (a callback queued on autograd's engine in ``post_backward``, so it runs once
  every gradient has been accumulated and handed to DeepSpeed's reduce hooks), or right after the
  forward when no backward will follow (eval, ``no_grad``), the parameters gathered here are
  partitioned again (``param.partition``).

Why not release after the forward and gather again for the backward, as DeepSpeed does per
submodule in eager: the engine keeps the tensors of its forward as inputs of its backward graph,
so releasing them would free nothing, and gathering again would hold the weights twice. Autograd
also needs each parameter at full size when it accumulates the gradient into ``.grad``.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ortmodule_exporter.components import (
    StepContext,
    mark_module_hook_handled,
)
from ortmodule_exporter.export import traced_in_place

from .arena import ArenaFreeSteps
from .options import ENABLE_ZERO_STAGE3

OPTION = ENABLE_ZERO_STAGE3.name
COMPONENT_NAME = "ortmodule-zero"


class ZeroStage3Error(RuntimeError):
    """ZeRO stage 3 parameters reached ORTModule without the stage-3 support switched on."""


def zero_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of ``module`` that DeepSpeed ZeRO stage 3 manages (``ds_status`` set)."""
    return [p for p in module.parameters() if hasattr(p, "ds_status")]


def _status(param: torch.nn.Parameter) -> str:
    return str(param.ds_status.name)  # type: ignore[attr-defined]


def _deepspeed_hook(fn: Any) -> bool:
    return str(getattr(fn, "__module__", "") or "").startswith("deepspeed.")


def _hook_dicts(module: torch.nn.Module) -> tuple[dict[int, Any], ...]:
    return (module._forward_pre_hooks, module._forward_hooks)


class ZeroStage3Hook(ArenaFreeSteps):
    """Gathers partitioned parameters around each ORTModule step; see the module docstring.
    A stage-3 module is marked as stepping for :meth:`session_contribution`."""

    def __init__(self) -> None:
        super().__init__()
        # module -> the parameters this hook gathered and has not released yet
        self._held: weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Parameter]] = (
            weakref.WeakKeyDictionary()
        )
        # module -> forwards whose backward has not run yet
        self._pending: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()
        self._marked: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        # module -> its ZeRO parameters (the same Parameter objects for the module's lifetime)
        self._params: weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Parameter]] = (
            weakref.WeakKeyDictionary()
        )

    def _zero_parameters(self, module: torch.nn.Module) -> list[torch.nn.Parameter]:
        """``zero_parameters(module)`` without walking every parameter at every step.

        This hook runs on every ORTModule step, DeepSpeed or not. Stage 3 converts every
        parameter of the module it manages, so a first parameter without ``ds_status`` means
        none (checked again next step: ``deepspeed.initialize`` may come after a first forward).
        """
        if "deepspeed" not in sys.modules:
            return []  # partitioned parameters are DeepSpeed's: none without it (one dict lookup)
        found = self._params.get(module)
        if found is None:
            first = next(module.parameters(), None)
            if first is None or not hasattr(first, "ds_status"):
                return []
            found = self._params[module] = zero_parameters(module)
        return found

    def _enabled(self, ctx: StepContext, params: list[torch.nn.Parameter]) -> bool:
        if not params:
            return False
        if not ctx.options.get(OPTION, False):
            raise ZeroStage3Error(
                f"{type(ctx.module).__name__} has {len(params)} DeepSpeed ZeRO stage 3 "
                f"partitioned parameters; ORTModule gathers them for the engine only with "
                f"{OPTION}=1. Set it in the environment (export {OPTION}=1) before the first "
                "forward, or use ZeRO stage 1 or 2."
            )
        return True

    def _mark_deepspeed_hooks(self, module: torch.nn.Module) -> None:
        # the runtime's "submodule hooks only run at export" warning is not for these: this hook
        # does their work at every step
        if module in self._marked:
            return
        for sub in module.modules():
            for hooks in _hook_dicts(sub):
                for fn in hooks.values():
                    if _deepspeed_hook(fn):
                        mark_module_hook_handled(fn, COMPONENT_NAME)
        self._marked.add(module)

    def pre_forward(self, ctx: StepContext) -> None:
        params = self._zero_parameters(ctx.module)
        if not self._enabled(ctx, params):
            return
        self._mark_deepspeed_hooks(ctx.module)
        self._stepping.add(ctx.module)
        missing = [p for p in params if _status(p) != "AVAILABLE"]
        if missing:
            # DeepSpeed's coalesced all-gather; it waits for any prefetch already in flight
            missing[0].all_gather(param_list=missing)  # type: ignore[attr-defined]
            held = self._held.setdefault(ctx.module, [])
            seen = {id(p) for p in held}
            held.extend(p for p in missing if id(p) not in seen)

    def post_forward(self, ctx: StepContext, outputs: Any) -> None:
        self._stepping.discard(ctx.module)
        if not self._held or ctx.module not in self._held:
            return
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in outputs):
            self._pending[ctx.module] = self._pending.get(ctx.module, 0) + 1
        elif not self._pending.get(ctx.module):
            self._release(ctx.module)

    def post_backward(self, ctx: StepContext) -> None:
        if not self._pending and not self._held:
            return  # no module of this hook's is gathered or waits for a backward (no ZeRO-3)
        left = self._pending.get(ctx.module, 0) - 1
        self._pending[ctx.module] = max(left, 0)
        if left <= 0 and ctx.module in self._held:
            module = ctx.module
            # autograd accumulates the gradients this backward returns after it returns
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._release(module))

    def _release(self, module: torch.nn.Module) -> None:
        held = [p for p in self._held.pop(module, []) if _status(p) == "AVAILABLE"]
        if held:
            held[0].partition(param_list=held)  # type: ignore[attr-defined]

    def exporting(self, ctx: StepContext) -> contextlib.AbstractContextManager[None]:
        return _exporting(ctx.module)


#: why a stage-3 module is traced in place (the exporter logs it)
IN_PLACE_REASON = (
    "its DeepSpeed ZeRO stage 3 parameters are gathered for the step; a deep copy would hold "
    "the whole model a second time"
)


@contextlib.contextmanager
def _exporting(module: torch.nn.Module) -> Iterator[None]:
    in_place = (
        traced_in_place(IN_PLACE_REASON)
        if any(hasattr(p, "ds_status") for p in module.parameters())
        else contextlib.nullcontext()
    )
    with _suspended_deepspeed_hooks(module), _torch_linear(), in_place:
        yield


@contextlib.contextmanager
def _torch_linear() -> Iterator[None]:
    """PyTorch's own ``torch.nn.functional.linear`` while the module is traced.

    Stage 3 replaces it process-wide with DeepSpeed's memory-efficient autograd Function and
    leaves it replaced (DeepSpeed: "This will persist unless manually reset"), so every later
    export, of any model, would trace each linear layer as an opaque PythonOp instead of the
    engine's own Gemm/MatMul. The engine gets the gathered weights itself, so the plain operator
    is exact here; outside the export DeepSpeed's replacement stays as DeepSpeed left it.
    """
    functional = torch.nn.functional
    current = functional.linear
    original = None
    if getattr(current, "__module__", "") == "deepspeed.runtime.zero.linear":
        init = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
        holder = getattr(init, "InsertPostInitMethodToModuleSubClasses", None)
        original = getattr(holder, "linear_bk", None)
    if original is None:
        yield
        return
    functional.linear = original
    try:
        yield
    finally:
        functional.linear = current


@contextlib.contextmanager
def _suspended_deepspeed_hooks(module: torch.nn.Module) -> Iterator[None]:
    """DeepSpeed's hooks off every submodule while the export traces the module.

    The export gathered the parameters already; those hooks would fetch and release them again
    inside the trace (and, on a copy, fetch plain tensors without ZeRO state). Dictionaries are
    restored in their original order afterwards.
    """
    saved: list[tuple[dict[int, Any], dict[int, Any]]] = []
    for sub in module.modules():
        for hooks in _hook_dicts(sub):
            if any(_deepspeed_hook(fn) for fn in hooks.values()):
                saved.append((hooks, dict(hooks)))
                for key in [k for k, fn in hooks.items() if _deepspeed_hook(fn)]:
                    del hooks[key]
    try:
        yield
    finally:
        for hooks, original in saved:
            hooks.clear()
            hooks.update(original)
