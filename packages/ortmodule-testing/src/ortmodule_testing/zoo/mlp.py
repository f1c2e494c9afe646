"""A multi-layer perceptron: the smallest real workload, and the many-small-layers benchmark."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MLP"]

# The many-small-layers shape: per-op overhead dominates, which is what that benchmark measures.
MANY_SMALL_DEPTH = 48
MANY_SMALL_WIDTH = 16


class MLP(nn.Module):
    """``depth`` hidden blocks of Linear -> ReLU -> Dropout, then a Linear head.

    MLP(16, 8)(torch.randn(4, 16)).shape  # torch.Size([4, 8])
    MLP(16, 8, many_small=True)  # 48 hidden layers of width 16
    """

    def __init__(
        self,
        in_features: int = 16,
        out_features: int = 8,
        hidden: int | None = None,
        depth: int | None = None,
        *,
        many_small: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if hidden is None:
            hidden = MANY_SMALL_WIDTH if many_small else 32
        if depth is None:
            depth = MANY_SMALL_DEPTH if many_small else 2
        if depth < 1:
            raise ValueError(f"MLP depth must be at least 1, got {depth}")
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout)]
            width = hidden
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))  # type: ignore[no-any-return]
