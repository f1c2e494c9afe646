"""The ``ORTMODULE_*`` variable ortmodule-zero acts on, declared here and nowhere else.

>>> ENABLE_ZERO_STAGE3.convert("on")
True
"""

from __future__ import annotations

from ortmodule_exporter.option import switch

__all__ = ["ENABLE_ZERO_STAGE3", "OPTIONS"]

ENABLE_ZERO_STAGE3 = switch(
    "ORTMODULE_ENABLE_ZERO_STAGE3",
    False,
    "ortmodule-zero",
    "Gather DeepSpeed ZeRO stage 3 partitioned parameters for the engine, release them after.",
)

OPTIONS = (ENABLE_ZERO_STAGE3,)
