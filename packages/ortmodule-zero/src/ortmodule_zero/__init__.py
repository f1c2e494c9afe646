"""DeepSpeed ZeRO stage 3 for ORTModule (found by the runtime through its entry point).

Switch it on with ``export ORTMODULE_ENABLE_ZERO_STAGE3=1``, then ``ORTModule(model)`` and
``deepspeed.initialize(model=..., config={"zero_optimization": {"stage": 3}, ...})`` as usual.
"""

from ortmodule_zero.stage3 import OPTION, ZeroStage3Error, ZeroStage3Hook, zero_parameters

__all__ = ["OPTION", "ZeroStage3Error", "ZeroStage3Hook", "zero_parameters"]
__version__ = "0.1.0"
