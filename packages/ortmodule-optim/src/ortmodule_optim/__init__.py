"""Multi-tensor optimizers for ORTModule training: FusedAdam and FP16_Optimizer.

>>> from ortmodule_optim import FusedAdam
>>> optimizer = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)

Importing this package imports neither onnxruntime nor triton (Triton is loaded by FusedAdam's
CUDA path on first use) nor DeepSpeed (loaded by FP16_Optimizer's modifiers when they run).
"""

from ortmodule_optim.fp16_optimizer import (
    FP16_Optimizer,
    register_fp16_modifier,
    supported_fp16_optimizers,
)
from ortmodule_optim.fused_adam import FusedAdam

__all__ = ["FP16_Optimizer", "FusedAdam", "register_fp16_modifier", "supported_fp16_optimizers"]
__version__ = "0.1.0"
