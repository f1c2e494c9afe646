"""Checks shared by the zoo's model configurations."""

from __future__ import annotations

from typing import Any


def check_heads(config: Any) -> None:
    """Attention splits ``d_model`` into ``n_heads`` equal parts: refuse a size that does not."""
    if config.d_model % config.n_heads:
        raise ValueError(
            f"{type(config).__name__}.d_model ({config.d_model}) must be divisible by "
            f"n_heads ({config.n_heads})"
        )
