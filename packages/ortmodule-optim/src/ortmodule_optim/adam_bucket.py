"""What one Adam update works on: a bucket of tensors and the step's hyperparameters.

Shared by FusedAdam (``fused_adam``), which builds them, and its CUDA kernel (``triton_adam``),
which reads them; neither of those imports the other's module for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Bucket", "Hyper"]


@dataclass
class Bucket:
    """Parameters of one group that share device, dtype and step count."""

    params: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    steps: list[torch.Tensor]
    step: int
    kernel_cache: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Hyper:
    """The hyperparameters of one step of one bucket, bias corrections folded in."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adam_w_mode: bool
    step_size: float
    bias_correction2_sqrt: float
