"""The Hugging Face zoo: tiny ``transformers`` models built from their own config classes.

Every model is its library's default configuration except for size (hidden 64, 2 layers, 4
heads, vocabulary 128) and dropout 0 (dropout draws from each engine's own RNG, so masks cannot
match eager). Nothing is downloaded. Each case is an ``ortmodule_testing`` ``ZooCase`` whose loss
is the model's own ``loss`` output (labels go in, the model shifts them where it does so).

    case = HF_ZOO["llama"]
    model = case.build(seed=0)
    args, kwargs = case.make_batch(0)
    case.loss_fn(model(*args, **kwargs), args, kwargs).backward()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers as tf

from ortmodule_testing.zoo import Batch, ZooCase

VOCAB = 128
HIDDEN = 64
LAYERS = 2
HEADS = 4
FFN = 128
BATCH = 2
SEQ = 12
IGNORE = -100


def _no_dropout(config: Any) -> Any:
    """Every float setting whose name says dropout is set to 0 (names differ per model)."""
    for name, value in config.to_dict().items():
        if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
            setattr(config, name, 0.0)
    return config


def _model(model_cls: Any, config_cls: Any, **settings: Any) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        config = _no_dropout(config_cls(**settings))
        return model_cls(config)  # type: ignore[no-any-return]

    return make


_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    intermediate_size=FFN,
)
# grouped-query attention: 2 key/value heads for 4 query heads
_GQA = dict(_DECODER, num_key_value_heads=2)
_ENCODER = dict(_DECODER, max_position_embeddings=64)


def _generator(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(20_000 + step)


def _padding_mask(gen: torch.Generator) -> torch.Tensor:
    """Row 0 full, row 1 right-padded to a random length (the common fine-tuning batch)."""
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, int(torch.randint(SEQ // 2, SEQ, (1,), generator=gen)) :] = 0
    return mask


def causal_lm_batch(step: int) -> Batch:
    gen = _generator(step)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    mask = _padding_mask(gen)
    labels = ids.masked_fill(mask == 0, IGNORE)
    return (), {"input_ids": ids, "attention_mask": mask, "labels": labels}


def masked_lm_batch(step: int) -> Batch:
    gen = _generator(step)
    ids = torch.randint(5, VOCAB, (BATCH, SEQ), generator=gen)
    mask = _padding_mask(gen)
    chosen = (torch.rand(BATCH, SEQ, generator=gen) < 0.3) & (mask == 1)
    chosen[0, 1] = True
    labels = torch.where(chosen, ids, IGNORE)
    ids = torch.where(chosen, 4, ids)  # 4 stands for [MASK]; any id works for a random model
    return (), {"input_ids": ids, "attention_mask": mask, "labels": labels}


def classification_batch(step: int) -> Batch:
    gen = _generator(step)
    ids = torch.randint(5, VOCAB, (BATCH, SEQ), generator=gen)
    return (), {
        "input_ids": ids,
        "attention_mask": _padding_mask(gen),
        "labels": torch.randint(0, 2, (BATCH,), generator=gen),
    }


def seq2seq_batch(step: int) -> Batch:
    gen = _generator(step)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(3, VOCAB, (BATCH, SEQ - 4), generator=gen)
    labels[1, -2:] = IGNORE
    return (), {"input_ids": ids, "attention_mask": _padding_mask(gen), "labels": labels}


def image_batch(step: int) -> Batch:
    gen = _generator(step)
    return (), {
        "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=gen),
        "labels": torch.randint(0, 2, (BATCH,), generator=gen),
    }


def model_loss(out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    return out["loss"]  # type: ignore[no-any-return]


def _case(name: str, make: Callable[[], torch.nn.Module], batch: Callable[[int], Batch]) -> ZooCase:
    return ZooCase(name, make, batch, model_loss)


HF_ZOO: dict[str, ZooCase] = {
    case.name: case
    for case in (
        # decoders: rotary embeddings, RMSNorm, grouped-query attention, sdpa masks
        _case(
            "gpt2",
            _model(
                tf.GPT2LMHeadModel,
                tf.GPT2Config,
                vocab_size=VOCAB,
                n_embd=HIDDEN,
                n_layer=LAYERS,
                n_head=HEADS,
                n_positions=64,
            ),
            causal_lm_batch,
        ),
        _case("llama", _model(tf.LlamaForCausalLM, tf.LlamaConfig, **_GQA), causal_lm_batch),
        _case("qwen2", _model(tf.Qwen2ForCausalLM, tf.Qwen2Config, **_GQA), causal_lm_batch),
        _case("mistral", _model(tf.MistralForCausalLM, tf.MistralConfig, **_GQA), causal_lm_batch),
        _case(
            "gemma",
            _model(tf.GemmaForCausalLM, tf.GemmaConfig, **_GQA, head_dim=16),
            causal_lm_batch,
        ),
        _case("phi", _model(tf.PhiForCausalLM, tf.PhiConfig, **_DECODER), causal_lm_batch),
        _case(
            "gpt_neox", _model(tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig, **_DECODER), causal_lm_batch
        ),
        _case(
            "opt",
            _model(
                tf.OPTForCausalLM,
                tf.OPTConfig,
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                num_hidden_layers=LAYERS,
                num_attention_heads=HEADS,
                ffn_dim=FFN,
                word_embed_proj_dim=HIDDEN,
                max_position_embeddings=64,
            ),
            causal_lm_batch,
        ),
        _case(
            "bloom",
            _model(
                tf.BloomForCausalLM,
                tf.BloomConfig,
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                n_layer=LAYERS,
                n_head=HEADS,
            ),
            causal_lm_batch,
        ),
        _case(
            "falcon",
            _model(
                tf.FalconForCausalLM,
                tf.FalconConfig,
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                num_hidden_layers=LAYERS,
                num_attention_heads=HEADS,
            ),
            causal_lm_batch,
        ),
        # encoders
        _case("bert_mlm", _model(tf.BertForMaskedLM, tf.BertConfig, **_ENCODER), masked_lm_batch),
        _case(
            "bert_classification",
            _model(tf.BertForSequenceClassification, tf.BertConfig, **_ENCODER),
            classification_batch,
        ),
        _case(
            "roberta", _model(tf.RobertaForMaskedLM, tf.RobertaConfig, **_ENCODER), masked_lm_batch
        ),
        _case(
            "distilbert",
            _model(
                tf.DistilBertForMaskedLM,
                tf.DistilBertConfig,
                vocab_size=VOCAB,
                dim=HIDDEN,
                n_layers=LAYERS,
                n_heads=HEADS,
                hidden_dim=FFN,
                max_position_embeddings=64,
            ),
            masked_lm_batch,
        ),
        _case(
            "deberta_v2",
            _model(tf.DebertaV2ForMaskedLM, tf.DebertaV2Config, **_ENCODER),
            masked_lm_batch,
        ),
        # encoder-decoders: labels are shifted into decoder inputs inside the model
        _case(
            "t5",
            _model(
                tf.T5ForConditionalGeneration,
                tf.T5Config,
                vocab_size=VOCAB,
                d_model=HIDDEN,
                d_kv=HIDDEN // HEADS,
                d_ff=FFN,
                num_layers=LAYERS,
                num_heads=HEADS,
                decoder_start_token_id=0,
                pad_token_id=0,
            ),
            seq2seq_batch,
        ),
        _case(
            "bart",
            _model(
                tf.BartForConditionalGeneration,
                tf.BartConfig,
                vocab_size=VOCAB,
                d_model=HIDDEN,
                encoder_layers=LAYERS,
                decoder_layers=LAYERS,
                encoder_attention_heads=HEADS,
                decoder_attention_heads=HEADS,
                encoder_ffn_dim=FFN,
                decoder_ffn_dim=FFN,
                max_position_embeddings=64,
            ),
            seq2seq_batch,
        ),
        # vision
        _case(
            "vit",
            _model(
                tf.ViTForImageClassification,
                tf.ViTConfig,
                hidden_size=HIDDEN,
                num_hidden_layers=LAYERS,
                num_attention_heads=HEADS,
                intermediate_size=FFN,
                image_size=32,
                patch_size=8,
                num_labels=2,
            ),
            image_batch,
        ),
    )
}
