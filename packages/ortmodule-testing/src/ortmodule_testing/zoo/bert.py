"""A BERT-style encoder for masked-LM: padding mask built in the model, post-LN layers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import check_heads

__all__ = ["IGNORE_INDEX", "MASK_TOKEN_ID", "PAD_TOKEN_ID", "BertConfig", "BertEncoder"]

PAD_TOKEN_ID = 0
MASK_TOKEN_ID = 1
IGNORE_INDEX = -100


@dataclass(frozen=True)
class BertConfig:
    """Sizes of a :class:`BertEncoder`; the defaults are the benchmark size.

    ``tie_word_embeddings`` makes the masked-LM decoder share the word-embedding weight, as
    Hugging Face's BERT does; it is off by default so that every model in the zoo has distinct
    parameters, and on where a test wants shared weights.
    """

    vocab_size: int = 1024
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 1024
    max_position: int = 128
    type_vocab_size: int = 2
    dropout: float = 0.0
    layer_norm_eps: float = 1e-12
    tie_word_embeddings: bool = False
    #: with labels, return the logits beside the loss; off for a loss-only training module (the
    #: engine can then compute the vocabulary projection on the labelled tokens only)
    return_logits: bool = True

    @classmethod
    def small(cls, **changes: Any) -> BertConfig:
        """A size that trains in milliseconds on a CPU, for tests; ``changes`` override fields."""
        small = cls(vocab_size=128, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_position=16)
        return dataclasses.replace(small, **changes)

    def __post_init__(self) -> None:
        check_heads(self)


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.d_model, padding_idx=PAD_TOKEN_ID)
        self.position = nn.Embedding(config.max_position, config.d_model)
        self.token_type = nn.Embedding(config.type_vocab_size, config.d_model)
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word(input_ids) + self.position(positions) + self.token_type(token_type_ids)
        return self.dropout(self.norm(x))  # type: ignore[no-any-return]


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.dropout = config.dropout
        self.query = nn.Linear(config.d_model, config.d_model)
        # No bias: softmax ignores a key bias, so its gradient would be pure rounding noise that
        # Adam scales up to full-size updates, differing between any two engines.
        self.key = nn.Linear(config.d_model, config.d_model, bias=False)
        self.value = nn.Linear(config.d_model, config.d_model)
        self.out = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor, additive_mask: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, self.n_heads, -1).transpose(1, 2)

        y = F.scaled_dot_product_attention(
            heads(self.query(x)),
            heads(self.key(x)),
            heads(self.value(x)),
            attn_mask=additive_mask,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.out(y.transpose(1, 2).reshape(batch, seq, d_model))  # type: ignore[no-any-return]


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = BertSelfAttention(config)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.attn_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.ffn = nn.Sequential(
            nn.Linear(config.d_model, config.d_ff),
            nn.GELU(),
            nn.Linear(config.d_ff, config.d_model),
            nn.Dropout(config.dropout),
        )
        self.ffn_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, additive_mask: torch.Tensor) -> torch.Tensor:
        x = self.attn_norm(x + self.attn_dropout(self.attention(x, additive_mask)))
        return self.ffn_norm(x + self.ffn(x))  # type: ignore[no-any-return]


class BertMLMHead(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.transform = nn.Sequential(
            nn.Linear(config.d_model, config.d_model),
            nn.GELU(),
            nn.LayerNorm(config.d_model, eps=config.layer_norm_eps),
        )
        self.decoder = nn.Linear(config.d_model, config.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(x))  # type: ignore[no-any-return]


class BertEncoder(nn.Module):
    """Embeddings (``padding_idx=0``), post-LN encoder layers, masked-LM head.

    ``attention_mask`` is ``(batch, seq)`` with 1 for real tokens and 0 for padding; the model
    turns it into an additive mask. ``labels`` hold the original token at masked positions and
    ``-100`` elsewhere. Returns ``{"logits"}``, plus ``"loss"`` when labels are given.

        model = BertEncoder(BertConfig.small())
        ids = torch.tensor([[5, 6, 7, 0]])
        mask = torch.tensor([[1, 1, 1, 0]])
        model(ids, mask)["logits"].shape  # (1, 4, 128)
        model(ids, mask, labels=torch.tensor([[-100, 6, -100, -100]]))["loss"]
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.n_layers))
        self.mlm_head = BertMLMHead(config)
        if config.tie_word_embeddings:
            self.mlm_head.decoder.weight = self.embeddings.word.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids)
        # (batch, 1, 1, seq): every query may look at every real key, none at padding.
        dtype = x.dtype
        keep = attention_mask[:, None, None, :].to(dtype)
        additive_mask = (1.0 - keep) * torch.finfo(dtype).min
        for layer in self.layers:
            x = layer(x, additive_mask)
        logits: torch.Tensor = self.mlm_head(x)
        if labels is None:
            return {"logits": logits}
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX
        )
        if not self.config.return_logits:
            return {"loss": loss}
        return {"loss": loss, "logits": logits}
