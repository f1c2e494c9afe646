"""Every input dim is dynamic: one graph follows a new batch size or sequence length.

The trace sees one call's sizes. Where ONNX shape inference could not derive a value's shape,
the ONNX conversion once kept the traced sizes and folded ``x.size(i)`` into a constant, so the
next call with another length failed in a ``Reshape`` (``torch.nn.MultiheadAttention``:
``Reshape {4,3,16} -> {6,12,4}``). Each case runs three (batch, length) pairs against eager,
with fallback disabled (conftest), outputs and every gradient compared, in one build.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from ortmodule import ORTModule

RTOL, ATOL = 1e-4, 1e-5
SIZES = [(2, 6), (3, 4), (4, 5)]  # (batch, sequence length)
EMBED, HEADS = 16, 4


class _SelfAttention(torch.nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(EMBED, HEADS, batch_first=batch_first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, weights = self.attn(x, x, x)
        return out + weights.mean()


def _encoder_layer() -> torch.nn.Module:
    return torch.nn.TransformerEncoderLayer(EMBED, HEADS, 32, dropout=0.0, batch_first=True)


CASES: dict[str, tuple[Callable[[], torch.nn.Module], bool]] = {
    "multihead_attention_batch_first": (lambda: _SelfAttention(batch_first=True), True),
    "multihead_attention_sequence_first": (lambda: _SelfAttention(batch_first=False), False),
    "transformer_encoder_layer": (_encoder_layer, True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_new_batch_and_sequence_lengths_match_eager_in_one_graph(name: str) -> None:
    make, batch_first = CASES[name]
    torch.manual_seed(0)
    eager = make()
    wrapped = ORTModule(copy.deepcopy(eager))
    gen = torch.Generator().manual_seed(1)
    for batch, length in SIZES:
        shape = (batch, length, EMBED) if batch_first else (length, batch, EMBED)
        x = torch.randn(shape, generator=gen)
        x_eager, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
        want, got = eager(x_eager), wrapped(x_ours)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        want.square().sum().backward()
        got.square().sum().backward()
        torch.testing.assert_close(x_ours.grad, x_eager.grad, rtol=RTOL, atol=ATOL)
        for (pname, p), q in zip(
            eager.named_parameters(), wrapped.module.parameters(), strict=True
        ):
            torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL, msg=pname)
            p.grad = q.grad = None
    # the sizes are symbolic in the graph: no re-export for a new length
    assert wrapped._runner.transitions.builds == 1, wrapped._runner.transitions.history
