"""The grown Hugging Face zoo: every architecture a user is likely to bring, tiny, trained on
batches whose batch size, sequence length and padding change at every step.

Each :class:`Arch` is a ``ZooCase`` (built from the library's own config class, dropout 0,
nothing downloaded) plus how it generates: ``prompt`` gives the ``generate`` inputs, or ``None``
for a model that does not generate. ``graphs`` is how many graphs its training may build: 1,
except where the model's Python turns a size into a value the trace bakes behind a guard (CLIP's
contrastive labels are ``arange(batch)``: one graph per batch size).

    arch = ARCHITECTURES["whisper"]
    model = arch.case.build(seed=0)
    args, kwargs = arch.case.make_batch(0)   # step 0's shapes; step 1 has others
    model.generate(**arch.prompt(), max_new_tokens=4)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers as tf
from hf_models import (
    _GQA,
    _SEQ2SEQ_NAMES,
    CHANGING_SHAPES,
    HF_ZOO,
    HIDDEN,
    IGNORE,
    LAYERS,
    SHAPES_ZOO,
    VOCAB,
    _model,
    _sized,
    model_loss,
)

from ortmodule_testing.zoo import Batch, ZooCase

Shape = tuple[int, int]
Prompt = Callable[[], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Arch:
    case: ZooCase
    prompt: Prompt | None
    graphs: int = 1


def shape_of(step: int) -> Shape:
    """(batch, sequence length) of ``step``: :data:`CHANGING_SHAPES` in turn."""
    return CHANGING_SHAPES[step % len(CHANGING_SHAPES)]


def _ids_and_mask(step: int, low: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    """Token ids of step ``step``'s shape; row 0 full, the others right-padded at random."""
    batch, seq = shape_of(step)
    gen = torch.Generator().manual_seed(40_000 + step)
    ids = torch.randint(low, VOCAB - 10, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for row in range(1, batch):
        mask[row, int(torch.randint(seq // 2, seq + 1, (1,), generator=gen)) :] = 0
    return ids, mask, gen


def causal_batch(step: int) -> Batch:
    ids, mask, _ = _ids_and_mask(step)
    return (), {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": ids.masked_fill(mask == 0, IGNORE),
    }


def masked_batch(step: int) -> Batch:
    ids, mask, gen = _ids_and_mask(step, low=5)
    chosen = (torch.rand(ids.shape, generator=gen) < 0.3) & (mask == 1)
    chosen[0, 1] = True
    labels = torch.where(chosen, ids, IGNORE)
    ids = torch.where(chosen, 4, ids)  # 4 stands for [MASK]
    return (), {"input_ids": ids, "attention_mask": mask, "labels": labels}


def classification_batch(step: int) -> Batch:
    ids, mask, gen = _ids_and_mask(step, low=5)
    labels = torch.randint(0, 2, (ids.shape[0],), generator=gen)
    return (), {"input_ids": ids, "attention_mask": mask, "labels": labels}


def seq2seq_batch(step: int) -> Batch:
    ids, mask, gen = _ids_and_mask(step)
    labels = torch.randint(3, VOCAB - 10, (ids.shape[0], ids.shape[1] - 4), generator=gen)
    labels[-1, -2:] = IGNORE
    return (), {"input_ids": ids, "attention_mask": mask, "labels": labels}


def image_batch(step: int) -> Batch:
    batch, _ = shape_of(step)
    gen = torch.Generator().manual_seed(40_000 + step)
    return (), {
        "pixel_values": torch.randn(batch, 3, 32, 32, generator=gen),
        "labels": torch.randint(0, 2, (batch,), generator=gen),
    }


MEL_BINS, MEL_FRAMES = 16, 32  # Whisper: 2 * max_source_positions frames


def speech_batch(step: int) -> Batch:
    ids, _, gen = _ids_and_mask(step)
    labels = ids[:, : ids.shape[1] - 4].clone()
    labels[-1, -2:] = IGNORE
    features = torch.randn(ids.shape[0], MEL_BINS, MEL_FRAMES, generator=gen)
    return (), {"input_features": features, "labels": labels}


def clip_batch(step: int) -> Batch:
    ids, mask, gen = _ids_and_mask(step)
    pixels = torch.randn(ids.shape[0], 3, 16, 16, generator=gen)
    return (), {
        "input_ids": ids,
        "attention_mask": mask,
        "pixel_values": pixels,
        "return_loss": True,
    }


IMAGE_TOKEN = VOCAB - 8  # outside the ids the batches draw (3 .. VOCAB - 11)
IMAGE_TOKENS = 4  # one 16x16 image as 4 embeddings, at positions 1-4


def vision_language_batch(step: int) -> Batch:
    ids, mask, gen = _ids_and_mask(step)
    ids[:, 1 : 1 + IMAGE_TOKENS] = IMAGE_TOKEN
    labels = ids.masked_fill((mask == 0) | (ids == IMAGE_TOKEN), IGNORE)
    pixels = torch.randn(ids.shape[0], 3, 16, 16, generator=gen)
    return (), {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels, "labels": labels}


def _prompt_ids() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB - 10, (2, 6), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _prompt_speech() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"input_features": torch.randn(2, MEL_BINS, MEL_FRAMES, generator=gen)}


def _prompt_image() -> dict[str, torch.Tensor]:
    inputs = _prompt_ids()
    inputs["input_ids"][:, 1 : 1 + IMAGE_TOKENS] = IMAGE_TOKEN
    inputs["pixel_values"] = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return inputs


_TINY_VISION = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16
)
_TEXT = dict(_GQA, head_dim=16)


def _clip() -> torch.nn.Module:
    text = dict(_TINY_VISION, vocab_size=VOCAB, max_position_embeddings=16)
    del text["image_size"]
    return tf.CLIPModel(
        tf.CLIPConfig(
            text_config=text, vision_config=dict(_TINY_VISION, patch_size=8), projection_dim=16
        )
    )


def _llava() -> torch.nn.Module:
    vision = dict(_TINY_VISION, model_type="clip_vision_model", patch_size=8)
    config = tf.LlavaConfig(
        text_config=dict(_TEXT, model_type="llama"),
        vision_config=vision,
        image_token_index=IMAGE_TOKEN,
        image_seq_length=IMAGE_TOKENS,
    )
    return tf.LlavaForConditionalGeneration(config)


def _gemma3() -> torch.nn.Module:
    config = tf.Gemma3Config(
        text_config=dict(_TEXT, sliding_window=4),
        vision_config=dict(_TINY_VISION, patch_size=4),  # 16 patches pooled to 4 tokens
        mm_tokens_per_image=IMAGE_TOKENS,
        image_token_index=IMAGE_TOKEN,
        boi_token_index=IMAGE_TOKEN + 1,
        eoi_token_index=IMAGE_TOKEN + 2,
    )
    return tf.Gemma3ForConditionalGeneration(config)


_MOE = dict(_GQA, intermediate_size=64, num_experts_per_tok=2)

#: the architectures beyond :data:`HF_ZOO` and :data:`SHAPES_ZOO`: model factory, batch, prompt
_MORE: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int], Batch], Prompt | None]] = {
    "mistral_sliding_window": (
        _model(tf.MistralForCausalLM, tf.MistralConfig, **_GQA, sliding_window=4),
        causal_batch,
        _prompt_ids,
    ),
    "mamba": (
        _model(
            tf.MambaForCausalLM,
            tf.MambaConfig,
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            vocab_size=VOCAB,
            state_size=8,
        ),
        causal_batch,
        _prompt_ids,
    ),
    "mixtral": (
        _model(tf.MixtralForCausalLM, tf.MixtralConfig, **_MOE, num_local_experts=4),
        causal_batch,
        _prompt_ids,
    ),
    "qwen2_moe": (
        _model(
            tf.Qwen2MoeForCausalLM,
            tf.Qwen2MoeConfig,
            **_MOE,
            num_experts=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        ),
        causal_batch,
        _prompt_ids,
    ),
    "whisper": (
        _model(
            tf.WhisperForConditionalGeneration,
            tf.WhisperConfig,
            **_sized(*_SEQ2SEQ_NAMES),
            num_mel_bins=MEL_BINS,
            max_source_positions=MEL_FRAMES // 2,
            max_target_positions=32,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
            suppress_tokens=None,
            begin_suppress_tokens=None,
        ),
        speech_batch,
        _prompt_speech,
    ),
    "t5gemma": (
        lambda: tf.T5GemmaForConditionalGeneration(
            tf.T5GemmaConfig(encoder=_TEXT, decoder=_TEXT, vocab_size=VOCAB)
        ),
        seq2seq_batch,
        _prompt_ids,
    ),
    "clip": (_clip, clip_batch, None),
    "llava": (_llava, vision_language_batch, _prompt_image),
    "gemma3": (_gemma3, vision_language_batch, _prompt_image),
}

#: the task of each :data:`HF_ZOO` case, by its batch function's name in hf_models
_ZOO_TASKS = {
    "causal_lm_batch": (causal_batch, _prompt_ids),
    "masked_lm_batch": (masked_batch, None),
    "classification_batch": (classification_batch, None),
    "seq2seq_batch": (seq2seq_batch, _prompt_ids),
    "image_batch": (image_batch, None),
    "changing_shapes_batch": (causal_batch, _prompt_ids),
}


def _architectures() -> dict[str, Arch]:
    found: dict[str, Arch] = {}
    for name, case in {**SHAPES_ZOO, **HF_ZOO}.items():
        batch, prompt = _ZOO_TASKS[case.make_batch.__name__]
        found[name] = Arch(ZooCase(name, case.make_model, batch, model_loss), prompt)
    for name, (make, batch, prompt) in _MORE.items():
        found[name] = Arch(ZooCase(name, make, batch, model_loss), prompt)
    # one graph per batch size: CLIP's labels are arange(batch) (see test_hf_shapes.py), LLaVA
    # splits the image features by a count of images the trace bakes, and Gemma3 checks the
    # count of image tokens with item()
    distinct_batches = len({b for b, _ in CHANGING_SHAPES})
    for name in ("clip", "llava", "gemma3"):
        found[name] = Arch(found[name].case, found[name].prompt, graphs=distinct_batches)
    # Mamba without its CUDA kernels scans the sequence in a Python loop, which the trace
    # unrolls: one graph per sequence length (each checked before its run)
    mamba = found["mamba"]
    found["mamba"] = Arch(mamba.case, mamba.prompt, graphs=len({s for _, s in CHANGING_SHAPES}))
    # T5Gemma: AdamW divides each gradient element by its own size, so an element whose
    # gradient is rounding-level moves by up to lr a step in either engine; one weight element
    # in 2,048 ends 2.7e-5 from a float64 training where eager's is 2e-6, while every loss and
    # gradient matches: atol 1e-4 for it
    t5gemma = found["t5gemma"]
    found["t5gemma"] = Arch(
        dataclasses.replace(t5gemma.case, tolerance=(1e-4, 1e-4)), t5gemma.prompt
    )
    return dict(sorted(found.items()))


ARCHITECTURES: dict[str, Arch] = _architectures()
