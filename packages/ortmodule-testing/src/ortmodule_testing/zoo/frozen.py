"""A model with frozen parts (``requires_grad=False``) between trainable ones."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["FrozenSubmoduleModel"]


class FrozenSubmoduleModel(nn.Module):
    """Frozen embedding -> trainable adapter -> frozen backbone -> trainable head.

    The frozen parameters' gradients stay ``None``, yet the adapter's gradient has to flow back
    through the frozen backbone, as in adapter and LoRA fine-tuning.

        model = FrozenSubmoduleModel()
        model(torch.randint(0, 64, (4, 5))).shape  # (4, 4)
        [n for n, p in model.named_parameters() if p.requires_grad]
        # ['adapter.weight', 'adapter.bias', 'head.weight', 'head.bias']
    """

    def __init__(self, vocab_size: int = 64, d_model: int = 16, num_classes: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.adapter = nn.Linear(d_model, d_model)
        self.backbone = nn.Sequential(nn.Linear(d_model, d_model), nn.ReLU())
        self.head = nn.Linear(d_model, num_classes)
        for frozen in (self.embedding, self.backbone):
            frozen.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.backbone(self.adapter(self.embedding(input_ids)))
        return self.head(h.mean(dim=1))  # type: ignore[no-any-return]
