"""Modifiers that give DeepSpeed's mixed-precision optimizers multi-tensor checks.

Each replaces, on one instance, the methods DeepSpeed runs once per gradient tensor (overflow
check, gradient norm, unscale and clip) with versions doing a few multi-tensor operations, keeping
DeepSpeed's results: the same overflow decisions, the same norm (up to summation order), the same
clip rule, and DeepSpeed's own collectives. Loss scaling, skipping and the update itself stay
DeepSpeed's. Written against DeepSpeed 0.19; DeepSpeed is imported only when a modifier runs.

``fp16_optimizer`` starts its registry from :data:`DEEPSPEED_MODIFIERS`; this module imports
nothing of the registry.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ortmodule_optim.multi_tensor import has_inf_or_nan, scale_, tensor_norms

__all__ = [
    "DEEPSPEED_MODIFIERS",
    "modify_deepspeed_fp16",
    "modify_deepspeed_unfused_fp16",
    "modify_deepspeed_zero",
]

FUSED_FP16 = "deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer"
UNFUSED_FP16 = "deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer"
ZERO_1_2 = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"


def _replace(obj: Any, name: str, fn: Callable[..., Any]) -> None:
    setattr(obj, name, types.MethodType(fn, obj))


def _live_grads(params: Iterable[Any]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


# -- shared by DeepSpeed's FP16 optimizers (CheckOverflow) ------------------------------------


def _check_overflow_has_overflow_serial(self: Any, params: Iterable[Any]) -> bool:
    """``CheckOverflow.has_overflow_serial``: any non-finite gradient, one host sync in all."""
    return bool(has_inf_or_nan(_live_grads(params)))


def _combined_scale(self: Any, total_norm: float) -> float:
    # DeepSpeed's FP16 rule: the norm is of scaled gradients; clip only when it exceeds clip_grad.
    cur_scale: float = self.loss_scale_config.cur_scale
    combined_scale = cur_scale
    if self.clip_grad > 0.0:
        clip = ((total_norm / cur_scale) + 1e-6) / self.clip_grad
        if clip > 1:
            combined_scale = clip * cur_scale
    return combined_scale


# -- deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer ------------------------------------


def _fused_unscale_and_clip_grads(
    self: Any, grad_groups_flat: list[torch.Tensor], total_norm: float, apply_scale: bool = True
) -> float:
    combined_scale = _combined_scale(self, total_norm)
    if apply_scale:
        scale_(grad_groups_flat, 1.0 / combined_scale)
    return combined_scale


def modify_deepspeed_fp16(optimizer: Any) -> None:
    """DeepSpeed's (fused) ``FP16_Optimizer``.

    Its gradient norm is already taken over one flat buffer per param group, so only the
    per-tensor overflow check and the unscale/clip are replaced.
    """
    _replace(optimizer.overflow_checker, "has_overflow_serial", _check_overflow_has_overflow_serial)
    _replace(optimizer, "unscale_and_clip_grads", _fused_unscale_and_clip_grads)


# -- deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer ---------------------------


def _unfused_unscale_and_clip_grads(
    self: Any, total_norm: float, apply_scale: bool = True
) -> float:
    combined_scale = _combined_scale(self, total_norm)
    if apply_scale:
        scale_(_live_grads(p for group in self.fp32_groups for p in group), 1.0 / combined_scale)
    return combined_scale


def _unfused_weight_norm(grads: list[torch.Tensor]) -> float:
    """``deepspeed.runtime.utils.get_weight_norm`` of gradients without model parallelism."""
    sum_of_squares = float(tensor_norms(grads, 2.0).pow(2).sum())
    # DeepSpeed rounds the sum to fp32 before the root and marks inf/NaN with -1.
    total = float(torch.tensor([sum_of_squares], dtype=torch.float32)[0]) ** 0.5
    return -1.0 if not math.isfinite(total) else total


def _unfused_step(self: Any, closure: Any = None) -> bool:
    """``FP16_UnfusedOptimizer.step`` (non-legacy path, no model parallelism), multi-tensor."""
    from deepspeed.moe.utils import split_params_grads_into_shared_and_expert_params
    from deepspeed.runtime.utils import get_global_norm, is_invalid_grad_norm

    self.overflow = self.overflow_checker.check()
    if self.overflow:
        return bool(self._skip_invalid_grad_norm())

    norm_groups: list[float] = []
    for fp16_group, fp32_group in zip(self.fp16_groups, self.fp32_groups, strict=True):
        grads_for_norm, _ = split_params_grads_into_shared_and_expert_params(fp16_group)
        norm_groups.append(_unfused_weight_norm(grads_for_norm) if grads_for_norm else 0.0)
        for fp32_param, fp16_param in zip(fp32_group, fp16_group, strict=True):
            if fp16_param.grad is None:
                fp32_param.grad = torch.zeros_like(fp32_param)
            else:
                fp32_param.grad = fp16_param.grad.to(fp32_param.dtype)

    self._global_grad_norm = get_global_norm(norm_list=norm_groups)
    if is_invalid_grad_norm(self._global_grad_norm):
        return bool(self._skip_invalid_grad_norm())
    self._update_scale(False)
    self.unscale_and_clip_grads(self._global_grad_norm)

    self.optimizer.step()

    with torch.no_grad():
        for fp32_group, fp16_group in zip(self.fp32_groups, self.fp16_groups, strict=True):
            for fp32_param in fp32_group:
                fp32_param.grad = None
            if fp16_group:
                torch._foreach_copy_([p.data for p in fp16_group], [p.data for p in fp32_group])
    return bool(self.overflow)


def modify_deepspeed_unfused_fp16(optimizer: Any) -> None:
    """DeepSpeed's ``FP16_UnfusedOptimizer`` (per-parameter fp32 master weights).

    The overflow check and unscale/clip are replaced; so is ``step`` (for its per-tensor norm)
    unless model parallelism (``mpu``) or the legacy fused-LAMB path is in use, where DeepSpeed's
    own step is kept.
    """
    _replace(optimizer.overflow_checker, "has_overflow_serial", _check_overflow_has_overflow_serial)
    _replace(optimizer, "unscale_and_clip_grads", _unfused_unscale_and_clip_grads)
    if optimizer.mpu is None and not optimizer.fused_lamb_legacy:
        _replace(optimizer, "step", _unfused_step)


# -- deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer ------------------------------


def _device_name() -> str:
    from deepspeed.accelerator import get_accelerator

    name: str = get_accelerator().current_device_name()
    return name


def _zero_has_overflow_serial(self: Any, params: Iterable[Any]) -> torch.Tensor:
    return has_inf_or_nan(_live_grads(params)).reshape(1).to(_device_name())


def _zero_has_overflow_partitioned_grads_serial(self: Any) -> torch.Tensor:
    grads: list[torch.Tensor] = []
    for i in range(len(self.bit16_groups)):
        group = (
            self.averaged_gradients.get(i) if isinstance(self.averaged_gradients, dict) else None
        )
        grads.extend(g for g in group or () if g is not None)
    return has_inf_or_nan(grads).reshape(1).to(_device_name())


def _zero_get_grad_norm_direct(
    self: Any, gradients: list[torch.Tensor], params: list[Any], norm_type: float = 2
) -> torch.Tensor:
    """``DeepSpeedZeroOptimizer.get_grad_norm_direct`` with one foreach norm per group."""
    from deepspeed import comm as dist
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import (
        is_model_parallel_parameter,
        mask_nan_or_inf_with_val_inplace,
    )
    from deepspeed.runtime.zero.utils import get_norm_dtype

    norm_type = float(norm_type)
    if norm_type == math.inf:
        total_norm = tensor_norms(gradients, math.inf).max()
        dist.all_reduce(total_norm, op=dist.ReduceOp.MAX, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=total_norm, op=dist.ReduceOp.MAX)
    else:
        param_gradients = (g for g in gradients if not getattr(g, "_zero_padding", False))
        selected = [
            g
            for g, p in zip(param_gradients, params, strict=False)
            if not (hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated)
            and (is_model_parallel_parameter(p) or self.model_parallel_rank == 0)
        ]
        if selected:
            norms = tensor_norms(selected, norm_type, dtype=get_norm_dtype())
            total_norm = norms.to(_device_name()).pow(norm_type).sum().float()
        else:
            total_norm = torch.tensor(0.0, dtype=torch.float32).to(self.device)
        dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=total_norm, op=dist.ReduceOp.SUM)
        total_norm = total_norm.pow(1.0 / norm_type)
    mask_nan_or_inf_with_val_inplace(total_norm, device=self.device)
    return total_norm


def _zero_unscale_and_clip_grads(self: Any, grad_groups_flat: list[Any], total_norm: Any) -> None:
    from deepspeed.runtime.utils import is_invalid_grad_norm

    if self.clip_grad == 0.0 and self.loss_scale == 1.0:
        return
    combined_scale = self.loss_scale
    if self.clip_grad > 0.0:
        clip_norm = total_norm
        if is_invalid_grad_norm(clip_norm):
            clip_norm = torch.tensor(float("inf"), dtype=torch.float, device=self.device)
        clip = ((clip_norm / self.loss_scale) + 1e-6) / self.clip_grad
        clip = torch.clamp(clip, min=1.0)
        combined_scale = clip * self.loss_scale
    flat: list[torch.Tensor] = []
    for grad in grad_groups_flat:
        flat.extend(grad if isinstance(grad, list) else [grad])
    scale_(flat, 1.0 / combined_scale)


def modify_deepspeed_zero(optimizer: Any) -> None:
    """DeepSpeed's ZeRO stage 1/2 ``DeepSpeedZeroOptimizer``: overflow checks, norm and clip."""
    _replace(optimizer, "has_overflow_serial", _zero_has_overflow_serial)
    _replace(
        optimizer,
        "has_overflow_partitioned_grads_serial",
        _zero_has_overflow_partitioned_grads_serial,
    )
    _replace(optimizer, "get_grad_norm_direct", _zero_get_grad_norm_direct)
    _replace(optimizer, "unscale_and_clip_grads", _zero_unscale_and_clip_grads)


#: the modifier of each DeepSpeed optimizer class FP16_Optimizer knows from the start
DEEPSPEED_MODIFIERS: dict[str, Callable[[Any], None]] = {
    FUSED_FP16: modify_deepspeed_fp16,
    UNFUSED_FP16: modify_deepspeed_unfused_fp16,
    ZERO_1_2: modify_deepspeed_zero,
}
