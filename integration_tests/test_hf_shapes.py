"""Hugging Face models whose Python reads sizes: a new batch size or length matches eager.

Fallback is disabled (conftest): each call ran in the engine. Tiny configs, built from the
library's own config classes; nothing is downloaded.
"""

from __future__ import annotations

import copy

import pytest
import torch

tf = pytest.importorskip("transformers")

from ortmodule import ORTModule  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5


def _clip() -> torch.nn.Module:
    config = tf.CLIPConfig(
        text_config=dict(
            vocab_size=128,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=16,
        ),
        vision_config=dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            image_size=16,
            patch_size=8,
        ),
        projection_dim=16,
    )
    torch.manual_seed(0)
    return tf.CLIPModel(config)


def test_clip_contrastive_loss_on_a_partial_last_batch_matches_eager() -> None:
    # CLIP's labels are torch.arange(len(logits)): the trace bakes the batch size behind a
    # guard that reads the logits' rows. It is checked from the input shapes before the run
    # (the engine once failed in SoftmaxCrossEntropyLoss, "shape of logit and label does not
    # match", and after 8 such batches gave up); a batch size that comes back reuses its graph.
    eager = _clip()
    wrapped = ORTModule(copy.deepcopy(eager))
    gen = torch.Generator().manual_seed(0)
    for batch in (4, 3, 4, 3):  # two epochs of 7 examples in batches of 4
        ids = torch.randint(3, 128, (batch, 7), generator=gen)
        pixels = torch.randn(batch, 3, 16, 16, generator=gen)
        want = eager(input_ids=ids, pixel_values=pixels, return_loss=True)
        got = wrapped(input_ids=ids, pixel_values=pixels, return_loss=True)
        torch.testing.assert_close(got.loss, want.loss, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(got.logits_per_text, want.logits_per_text, rtol=RTOL, atol=ATOL)
        want.loss.backward()
        got.loss.backward()
        for (name, p), q in zip(eager.named_parameters(), wrapped.module.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL, msg=name)
            p.grad = q.grad = None
    # one graph per batch size, each built once
    assert wrapped._runner.transitions.builds == 2, wrapped._runner.transitions.history


# Greedy generate on Mistral and Gemma-3 with sliding windows, T5Gemma and LLaVA with
# pixel_values: packages/ortmodule/tests/test_hf_architectures.py (after training, same weights).
