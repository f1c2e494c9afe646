"""A small image classifier: convolutions, batch norm (running statistics are buffers), pooling."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["CNN"]


class CNN(nn.Module):
    """Two Conv2d -> BatchNorm2d -> ReLU stages with Dropout and MaxPool2d between them,
    AdaptiveAvgPool2d, then a Linear head. Works on any image size of at least 2x2.

        CNN()(torch.randn(4, 3, 16, 16)).shape  # torch.Size([4, 10])

    The convolutions have no bias, as is usual before BatchNorm: BatchNorm subtracts the mean,
    so a conv bias gets a gradient that is zero up to rounding, and Adam turns that rounding
    noise into full-size updates that differ between any two engines.
    """

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        channels: tuple[int, int] = (8, 16),
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        c1, c2 = channels
        self.features = nn.Sequential(
            # No conv bias before BatchNorm: see the class docstring.
            nn.Conv2d(in_channels, c1, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(c1),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(c2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(c2, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).flatten(1))  # type: ignore[no-any-return]
