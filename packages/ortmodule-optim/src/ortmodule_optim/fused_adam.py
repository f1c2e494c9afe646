"""Adam and AdamW as a few multi-tensor operations per step.

Parameters of one group are bucketed once by (device, dtype, step count); each bucket is updated
by one call of PyTorch's fused Adam kernel (``torch._fused_adamw_``, what
``torch.optim.AdamW(fused=True)`` runs), or one Triton launch on CUDA where Triton imports,
whatever the number of parameters. On CPU the fused kernel is the fastest of torch's AdamW
variants (one pass over memory instead of about eight), and results are bitwise those of
``torch.optim.AdamW(fused=True)``. Without bias correction, which the fused kernel always applies,
a bucket takes a fixed handful of ``torch._foreach_*`` calls in the order of torch's
multi-tensor Adam.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.optim.optimizer import ParamsT

from ortmodule_optim.adam_bucket import Bucket, Hyper

__all__ = ["FusedAdam"]

# Keys of a torch.optim.Adam/AdamW param group that have no FusedAdam counterpart. Loading a
# checkpoint that sets one of the behaviour-changing ones to a non-default value is refused.
_TORCH_ONLY_KEYS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused")
_UNSUPPORTED_IF_TRUE = ("amsgrad", "maximize", "differentiable")


@dataclass
class _Plan:
    """The buckets of one param group, valid while the same parameters carry gradients."""

    params: list[torch.Tensor]
    has_grad: tuple[bool, ...]
    buckets: list[Bucket]


class FusedAdam(torch.optim.Optimizer):
    """Adam/AdamW whose update is a handful of multi-tensor operations per step.

    ``adam_w_mode=True`` is ``torch.optim.AdamW`` (decoupled weight decay), ``False`` is
    ``torch.optim.Adam`` with L2 weight decay added to the gradient. Parameters without a
    gradient are skipped, as torch does.

    >>> model = torch.nn.Linear(4, 2)
    >>> opt = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    >>> model(torch.randn(3, 4)).sum().backward()
    >>> opt.step()
    >>> opt.zero_grad()
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adam_w_mode: bool = True,
        set_grad_none: bool = True,
    ) -> None:
        if isinstance(lr, torch.Tensor) or not 0.0 <= lr:
            raise ValueError(f"FusedAdam: lr must be a float >= 0, got {lr!r}")
        if not 0.0 <= eps:
            raise ValueError(f"FusedAdam: eps must be >= 0, got {eps!r}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"FusedAdam: betas must be two floats in [0, 1), got {betas!r}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"FusedAdam: weight_decay must be >= 0, got {weight_decay!r}")
        self.set_grad_none = set_grad_none
        self._plans: dict[int, _Plan] = {}
        defaults: dict[str, Any] = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": (float(betas[0]), float(betas[1])),
            "eps": eps,
            "weight_decay": weight_decay,
            "adam_w_mode": adam_w_mode,
        }
        super().__init__(params, defaults)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "set_grad_none": self.set_grad_none}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Also reached by load_state_dict and unpickling: cached buckets would point at old state.
        super().__setstate__(state)
        self.__dict__.setdefault("set_grad_none", True)
        self._plans = {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for i, p in enumerate(group["params"]):
            if torch.is_complex(p):
                raise ValueError(
                    f"FusedAdam: param_groups[{len(self.param_groups) - 1}]['params'][{i}] is "
                    f"complex ({p.dtype}); FusedAdam supports real floating point parameters "
                    "only. Optimize torch.view_as_real(param) instead, or use torch.optim.AdamW."
                )
            if not p.is_floating_point():
                raise ValueError(
                    f"FusedAdam: param_groups[{len(self.param_groups) - 1}]['params'][{i}] has "
                    f"dtype {p.dtype}; only floating point parameters can be optimized."
                )
        self._plans.clear()

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Drop gradients (``set_grad_none``, the default) or zero them with one foreach call."""
        if set_to_none is None:
            set_to_none = self.set_grad_none
        if set_to_none:
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
            return
        by_device_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.grad_fn is not None:
                    g.detach_()
                else:
                    g.requires_grad_(False)
                if g.is_sparse:
                    g.zero_()
                else:
                    by_device_dtype.setdefault((g.device, g.dtype), []).append(g)
        for grads in by_device_dtype.values():
            torch._foreach_zero_(grads)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Adam step over every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            plan = self._plan(index, group)
            for bucket in plan.buckets:
                self._update(index, group, bucket)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a FusedAdam checkpoint, or a ``torch.optim.Adam``/``AdamW`` one.

        Hyperparameters come from the checkpoint, as with any torch optimizer. A torch group's
        ``decoupled_weight_decay`` becomes ``adam_w_mode``; keys torch has and FusedAdam lacks
        are dropped; keys FusedAdam has and the checkpoint lacks keep their current value.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"FusedAdam.load_state_dict: the checkpoint has {len(saved_groups)} param "
                f"groups, this optimizer has {len(self.param_groups)}"
            )
        groups = []
        for i, (saved, current) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            groups.append(_translate_group(i, saved, current))
        super().load_state_dict({**state_dict, "param_groups": groups})
        self._plans.clear()

    # -- internals -------------------------------------------------------------------------

    def _plan(self, index: int, group: dict[str, Any]) -> _Plan:
        params: list[torch.Tensor] = group["params"]
        has_grad = tuple([p.grad is not None for p in params])
        plan = self._plans.get(index)
        if plan is not None and plan.params is params and plan.has_grad == has_grad:
            return plan
        plan = _Plan(params, has_grad, self._bucket(index, params, has_grad))
        self._plans[index] = plan
        return plan

    def _bucket(
        self, index: int, params: list[torch.Tensor], has_grad: tuple[bool, ...]
    ) -> list[Bucket]:
        buckets: dict[tuple[torch.device, torch.dtype, int], Bucket] = {}
        for i, (p, live) in enumerate(zip(params, has_grad, strict=True)):
            if not live:
                continue
            grad = cast(torch.Tensor, p.grad)
            if grad.is_sparse:
                raise _sparse_error(index, i)
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            missing = {"step", "exp_avg", "exp_avg_sq"} - state.keys()
            if missing:
                raise KeyError(
                    f"FusedAdam: state of param_groups[{index}]['params'][{i}] lacks "
                    f"{sorted(missing)}; was it loaded from another optimizer's checkpoint?"
                )
            step_t = state["step"]
            step = int(step_t.item()) if isinstance(step_t, torch.Tensor) else int(step_t)
            if not isinstance(step_t, torch.Tensor):
                state["step"] = step_t = torch.tensor(float(step), dtype=torch.float32)
            key = (p.device, p.dtype, step)
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = Bucket([], [], [], [], step)
            bucket.params.append(p)
            bucket.exp_avgs.append(state["exp_avg"])
            bucket.exp_avg_sqs.append(state["exp_avg_sq"])
            bucket.steps.append(step_t)
        return list(buckets.values())

    def _update(self, index: int, group: dict[str, Any], bucket: Bucket) -> None:
        grads = [cast(torch.Tensor, p.grad) for p in bucket.params]
        if any([g.is_sparse for g in grads]):
            # Checked before any in-place update, so a refused step leaves no half-updated state.
            self._explain(index, group, RuntimeError("sparse gradient"))
        bucket.step += 1
        beta1, beta2 = group["betas"]
        lr = float(group["lr"])
        if group["bias_correction"]:
            bias_correction1 = 1 - beta1**bucket.step
            bias_correction2 = 1 - beta2**bucket.step
        else:
            bias_correction1 = bias_correction2 = 1.0
        hyper = Hyper(
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            adam_w_mode=bool(group["adam_w_mode"]),
            step_size=lr / bias_correction1,
            bias_correction2_sqrt=bias_correction2**0.5,
        )
        fused = bool(group["bias_correction"]) and not (_on_cuda(bucket) and _triton_available())
        try:
            if fused:
                _fused_kernel_step(bucket, grads, hyper)
            elif not (_on_cuda(bucket) and _triton_adam_step(bucket, grads, hyper)):
                _foreach_adam_step(bucket, grads, hyper)
        except RuntimeError as err:
            bucket.step -= 1
            if fused:
                torch._foreach_sub_(bucket.steps, 1.0)
            self._explain(index, group, err)
            raise
        if not fused:
            torch._foreach_add_(bucket.steps, 1.0)

    def _explain(self, index: int, group: dict[str, Any], err: Exception) -> None:
        """Turn a foreach failure into a message that names the parameter."""
        for i, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise _sparse_error(index, i) from err
            if g.dtype != p.dtype or g.device != p.device or g.shape != p.shape:
                raise RuntimeError(
                    f"FusedAdam: param_groups[{index}]['params'][{i}] has a gradient of "
                    f"{g.dtype} {tuple(g.shape)} on {g.device}, but the parameter is "
                    f"{p.dtype} {tuple(p.shape)} on {p.device}; they must match."
                ) from err


def _foreach_adam_step(bucket: Bucket, grads: list[torch.Tensor], h: Hyper) -> None:
    """The update of ``torch.optim.adam._multi_tensor_adam`` for one step count, in its order."""
    params = bucket.params
    if h.weight_decay != 0:
        if h.adam_w_mode:
            torch._foreach_mul_(params, 1 - h.lr * h.weight_decay)
        else:
            grads = list(torch._foreach_add(grads, params, alpha=h.weight_decay))
    torch._foreach_lerp_(bucket.exp_avgs, grads, 1 - h.beta1)
    torch._foreach_mul_(bucket.exp_avg_sqs, h.beta2)
    torch._foreach_addcmul_(bucket.exp_avg_sqs, grads, grads, 1 - h.beta2)
    denom = torch._foreach_sqrt(bucket.exp_avg_sqs)
    if h.bias_correction2_sqrt != 1.0:
        torch._foreach_div_(denom, h.bias_correction2_sqrt)
    torch._foreach_add_(denom, h.eps)
    torch._foreach_addcdiv_(params, bucket.exp_avgs, denom, -h.step_size)


def _fused_kernel_step(bucket: Bucket, grads: list[torch.Tensor], h: Hyper) -> None:
    """One call of torch's fused Adam kernel, with the arguments ``AdamW(fused=True)`` passes.

    The kernel reads the step count from ``bucket.steps``, so they are advanced first, as torch
    does; it computes the bias corrections itself from them.
    """
    torch._foreach_add_(bucket.steps, 1.0)
    kernel = torch._fused_adamw_ if h.adam_w_mode else torch._fused_adam_
    kernel(
        bucket.params,
        grads,
        bucket.exp_avgs,
        bucket.exp_avg_sqs,
        [],
        bucket.steps,
        amsgrad=False,
        maximize=False,
        **{name: getattr(h, name) for name in _KERNEL_HYPERPARAMETERS},
    )


#: the fields of :class:`Hyper` the fused kernel takes, under the same keywords (it computes the
#: bias corrections itself)
_KERNEL_HYPERPARAMETERS = ("lr", "beta1", "beta2", "weight_decay", "eps")


def _on_cuda(bucket: Bucket) -> bool:
    return bucket.params[0].device.type == "cuda"


_TRITON_STEP: Callable[[Bucket, list[torch.Tensor], Hyper], bool] | None = None


def _triton_available() -> bool:
    _load_triton_step()
    return _TRITON_STEP is not _NO_TRITON


def _NO_TRITON(bucket: Bucket, grads: list[torch.Tensor], h: Hyper) -> bool:
    return False


def _load_triton_step() -> None:
    global _TRITON_STEP
    if _TRITON_STEP is None:
        try:
            # At call time, not module level: triton_adam imports triton, which
            # ``import ortmodule_optim`` must not (one way: triton_adam imports adam_bucket only).
            from ortmodule_optim.triton_adam import triton_adam_step
        except ImportError:
            _TRITON_STEP = _NO_TRITON
        else:
            _TRITON_STEP = triton_adam_step


def _triton_adam_step(bucket: Bucket, grads: list[torch.Tensor], h: Hyper) -> bool:
    """The Triton kernel where triton imports; False (use foreach) where it does not."""
    _load_triton_step()
    assert _TRITON_STEP is not None
    return _TRITON_STEP(bucket, grads, h)


def _sparse_error(group: int, i: int) -> RuntimeError:
    return RuntimeError(
        f"FusedAdam: param_groups[{group}]['params'][{i}] has a sparse gradient, which FusedAdam "
        "does not support. Use torch.optim.SparseAdam for that parameter (for example "
        "nn.Embedding(sparse=True)), or make its gradient dense (sparse=False)."
    )


def _translate_group(index: int, saved: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    group = dict(saved)
    for key in _UNSUPPORTED_IF_TRUE:
        if group.get(key):
            raise ValueError(
                f"FusedAdam.load_state_dict: param_groups[{index}] was saved with {key}=True, "
                "which FusedAdam does not implement; load it into torch.optim.AdamW instead."
            )
    if "adam_w_mode" not in group and "decoupled_weight_decay" in group:
        group["adam_w_mode"] = bool(group["decoupled_weight_decay"])
    group.pop("decoupled_weight_decay", None)
    for key in _TORCH_ONLY_KEYS:
        group.pop(key, None)
    for key, value in current.items():
        if key != "params":
            group.setdefault(key, value)
    if isinstance(group.get("lr"), torch.Tensor):
        group["lr"] = float(group["lr"])
    return group
