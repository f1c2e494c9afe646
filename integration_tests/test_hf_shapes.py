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


_DECODER = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    head_dim=16,
)
IMAGE_TOKEN = 120


def _generator_case(name: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    inputs: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if name == "mistral":  # a sliding window shorter than prompt + new tokens
        model = tf.MistralForCausalLM(tf.MistralConfig(**_DECODER, sliding_window=4))
    elif name == "gemma3":
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**_DECODER, sliding_window=4))
    elif name == "t5gemma":
        config = tf.T5GemmaConfig(encoder=_DECODER, decoder=_DECODER, vocab_size=128)
        model = tf.T5GemmaForConditionalGeneration(config)
    else:  # llava: pixel_values reach the model's forward through generate
        config = tf.LlavaConfig(
            text_config=dict(_DECODER, model_type="llama"),
            vision_config=dict(
                model_type="clip_vision_model",
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                image_size=16,
                patch_size=8,
            ),
            image_token_index=IMAGE_TOKEN,
            image_seq_length=4,
        )
        model = tf.LlavaForConditionalGeneration(config)
        ids[:, 1:5] = IMAGE_TOKEN  # 4 patches of a 16x16 image in 8x8 patches
        inputs["pixel_values"] = torch.randn(2, 3, 16, 16, generator=torch.Generator())
    return model.eval(), inputs


@pytest.mark.parametrize("name", ["mistral", "gemma3", "t5gemma", "llava"])
def test_greedy_generate_gives_eager_tokens(name: str) -> None:
    model, inputs = _generator_case(name)
    want = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    got = ORTModule(model).generate(**inputs, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want), (got, want)
