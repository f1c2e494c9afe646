"""A GPT-style decoder: pre-LN blocks, causal scaled-dot-product attention, loss in the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import check_heads

__all__ = ["GPTConfig", "GPTDecoder"]


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a :class:`GPTDecoder`; the defaults are the benchmark size."""

    vocab_size: int = 1024
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 128
    dropout: float = 0.0
    mlp_ratio: int = 4

    @classmethod
    def small(cls) -> GPTConfig:
        """A size that trains in milliseconds on a CPU, for tests."""
        return cls(vocab_size=128, d_model=32, n_layers=2, n_heads=4, seq_len=16)

    def __post_init__(self) -> None:
        check_heads(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.dropout = config.dropout
        # No bias: softmax ignores a key bias, so its gradient would be pure rounding noise that
        # Adam scales up to full-size updates, differing between any two engines.
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=-1)
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(batch, seq, d_model)
        return self.resid_dropout(self.proj(y))  # type: ignore[no-any-return]


class GPTBlock(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, hidden),
            nn.GELU(),
            nn.Linear(hidden, config.d_model),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))  # type: ignore[no-any-return]


class GPTDecoder(nn.Module):
    """Token + learned position embeddings, pre-LN blocks, final LayerNorm, LM head.

    ``labels`` follow the Hugging Face convention: aligned with ``input_ids`` (usually a copy of
    them); the model shifts them so position ``t`` predicts token ``t + 1``.

        model = GPTDecoder(GPTConfig.small())
        ids = torch.randint(0, 128, (2, 16))
        logits = model(ids)  # (2, 16, 128)
        loss, logits = model(ids, labels=ids.clone())
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(GPTBlock(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
        )
        return loss, logits
