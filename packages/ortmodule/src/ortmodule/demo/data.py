"""The demo's data: the corpus shipped in ``ortmodule/demo_data/``, a character tokenizer, batches."""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources

import torch

from .config import DemoConfig

CORPUS = "corpus.txt"


def load_corpus() -> str:
    """The text shipped with the package (self-written prose, about 22 KB)."""
    return resources.files("ortmodule").joinpath("demo_data", CORPUS).read_text(encoding="utf-8")


class CharTokenizer:
    """One token per distinct character of the corpus.

    >>> tok = CharTokenizer("hello")
    >>> tok.decode(tok.encode("hole"))
    'hole'
    """

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self._index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        missing = sorted({c for c in text if c not in self._index})
        if missing:
            raise ValueError(f"characters not in the demo vocabulary: {''.join(missing)!r}")
        return [self._index[c] for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in ids)


def make_batches(ids: torch.Tensor, config: DemoConfig) -> torch.Tensor:
    """``(steps, batch, seq_len + 1)`` windows at random offsets: inputs are ``[..., :-1]``,
    targets ``[..., 1:]``. Drawn once, so both runs see exactly the same batches."""
    window = config.seq_len + 1
    if ids.numel() < window + 1:
        raise ValueError(
            f"--seq-len {config.seq_len} is longer than the corpus ({ids.numel()} characters)"
        )
    gen = torch.Generator().manual_seed(config.seed + 1)
    starts = torch.randint(
        0, ids.numel() - window, (config.steps, config.batch_size), generator=gen
    )
    return ids[starts[..., None] + torch.arange(window)]
