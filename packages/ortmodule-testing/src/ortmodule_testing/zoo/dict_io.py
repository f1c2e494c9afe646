"""A model whose input is a dict and whose output is a ModelOutput look-alike."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ortmodule_testing.zoo.model_output import ModelOutput

__all__ = ["DictIOModel", "DictIOOutput"]


@dataclass
class DictIOOutput(ModelOutput):
    """``loss`` is absent from the mapping when no targets were given."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None


class DictIOModel(nn.Module):
    """Masked mean-pooling over a sequence given as ``{"x": (B, S, F) float, "mask": (B, S) bool}``.

    model = DictIOModel()
    inputs = {"x": torch.randn(2, 6, 8), "mask": torch.ones(2, 6, dtype=torch.bool)}
    out = model(inputs)  # DictIOOutput with keys ['logits', 'hidden']
    out = model(inputs, targets=torch.zeros(2, 4))  # keys ['loss', 'logits', 'hidden']
    """

    def __init__(self, in_features: int = 8, hidden: int = 16, out_features: int = 4) -> None:
        super().__init__()
        self.encoder = nn.Linear(in_features, hidden)
        self.head = nn.Linear(hidden, out_features)

    def forward(
        self, inputs: dict[str, torch.Tensor], targets: torch.Tensor | None = None
    ) -> DictIOOutput:
        x, mask = inputs["x"], inputs["mask"]
        hidden = torch.tanh(self.encoder(x)).masked_fill(~mask.unsqueeze(-1), 0.0)
        count = mask.to(hidden.dtype).sum(dim=1, keepdim=True).clamp(min=1.0)
        logits = self.head(hidden.sum(dim=1) / count)
        loss = F.mse_loss(logits, targets) if targets is not None else None
        return DictIOOutput(loss=loss, logits=logits, hidden=hidden)
