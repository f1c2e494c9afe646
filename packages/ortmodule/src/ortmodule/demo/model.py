"""The demo's model: a small character-level GPT, and sampling text from it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import DemoConfig
from .data import CharTokenizer


class _Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d_model)
        # no bias: softmax ignores a key bias, so its gradient is rounding noise that Adam would
        # scale into full-size updates, different in any two engines
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d_model, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, seq, d_model))
        return x + self.mlp(self.ln_2(x))  # type: ignore[no-any-return]


class DemoGPT(nn.Module):
    """A character-level GPT: token and position embeddings, pre-LN blocks, LM head.

    >>> model = DemoGPT(vocab_size=50, seq_len=16, layers=1, d_model=32, heads=4)
    >>> ids = torch.randint(0, 50, (2, 16))
    >>> model(ids).shape                      # logits
    torch.Size([2, 16, 50])
    >>> model(ids, targets=ids).shape         # the mean cross-entropy
    torch.Size([])
    """

    def __init__(
        self, vocab_size: int, seq_len: int, layers: int, d_model: int, heads: int
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok_emb(ids) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(config: DemoConfig, vocab_size: int) -> DemoGPT:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return DemoGPT(vocab_size, config.seq_len, config.layers, config.d_model, config.heads)


@torch.no_grad()
def generate(
    model: nn.Module, tokenizer: CharTokenizer, prompt: str, count: int, seq_len: int, seed: int
) -> str:
    """Sample ``count`` characters after ``prompt`` (temperature 0.8, seeded).

    The context is always a full window of ``seq_len`` characters (the prompt is left-padded
    with spaces), so every call has the same shapes and reuses one inference graph.
    """
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    ids = tokenizer.encode(" " * seq_len + prompt)
    for _ in range(count):
        window = torch.tensor([ids[-seq_len:]], device=device)
        logits = model(window)[0, -1].float().cpu()
        probs = torch.softmax(logits / 0.8, dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    return prompt + tokenizer.decode(ids[seq_len + len(prompt) :])
