"""A model whose forward takes Python scalars, a bool and a string next to its tensor."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ACTIVATIONS", "NonTensorArgsModel"]

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "tanh": torch.tanh,
}


class NonTensorArgsModel(nn.Module):
    """Linear -> activation picked by ``mode`` -> times ``scale`` -> Linear.

    With ``use_bias=False`` the first layer's bias takes no part in the forward, so its gradient
    stays ``None``: an engine has to report that, not a tensor of zeros.

        model = NonTensorArgsModel()
        model(torch.randn(4, 8), scale=0.5, use_bias=False, mode="gelu").shape  # (4, 8)
    """

    def __init__(self, in_features: int = 8, hidden: int = 16, out_features: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, out_features)

    def forward(
        self, x: torch.Tensor, scale: float = 1.0, use_bias: bool = True, mode: str = "relu"
    ) -> torch.Tensor:
        activation = ACTIVATIONS.get(mode)
        if activation is None:
            raise ValueError(
                f"NonTensorArgsModel: unknown mode {mode!r}; pick one of {sorted(ACTIVATIONS)}"
            )
        h = F.linear(x, self.fc1.weight, self.fc1.bias if use_bias else None)
        return self.fc2(activation(h) * scale)  # type: ignore[no-any-return]
