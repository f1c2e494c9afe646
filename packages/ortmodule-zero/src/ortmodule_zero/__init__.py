"""DeepSpeed ZeRO for ORTModule (found by the runtime through its entry point).

Stage 3: switch it on with ``export ORTMODULE_ENABLE_ZERO_STAGE3=1``, then ``ORTModule(model)``
and ``deepspeed.initialize(model=..., config={"zero_optimization": {"stage": 3}, ...})`` as
usual. Under stages 1 and 2 nothing is switched on: the engine's CPU sessions built in their
steps allocate without the arena (``partitioned_optimizer``), as stage 3's do.
"""

from ortmodule_zero.stage3 import OPTION, ZeroStage3Error, ZeroStage3Hook, zero_parameters

__all__ = ["OPTION", "ZeroStage3Error", "ZeroStage3Hook", "zero_parameters"]
__version__ = "0.1.0"
