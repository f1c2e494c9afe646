"""A Hugging Face model returning only its loss, as a training wrapper does.

Hugging Face models given ``labels`` return their logits beside the loss. Logits that leave the
model are computed on every token, so label sparsity cannot skip the unlabelled ones in the
layers only the loss reads (the user guide's "labelled rows"). Wrapped, the loss is the only
output:

    model = LossOnly(BertForMaskedLM(config))
    loss = model(input_ids, attention_mask, labels)
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LossOnly"]


class LossOnly(nn.Module):
    """``model(input_ids=..., attention_mask=..., labels=...).loss``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        return out.loss  # type: ignore[no-any-return]
