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

import logging
from collections.abc import Callable
from typing import Any

import torch
import transformers as tf

from ortmodule import ORTModule
from ortmodule_pytree import flatten
from ortmodule_testing.parity import assert_same_training, clone_model, train_steps
from ortmodule_testing.zoo import Batch, LossOnly, ZooCase

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


def _sized(width: str, layers: str, heads: str, ffn: str = "", **extra: Any) -> dict[str, Any]:
    """The tiny sizes (vocabulary, width, layers, heads, feed-forward width) under the keywords
    one config class names them by; ``layers``, ``heads`` and ``ffn`` may hold several keywords
    separated by spaces (an encoder's and a decoder's), ``ffn`` none where the config derives it.
    """
    sizes: dict[str, Any] = {"vocab_size": VOCAB, width: HIDDEN}
    for keywords, value in ((layers, LAYERS), (heads, HEADS), (ffn, FFN)):
        sizes.update(dict.fromkeys(keywords.split(), value))
    return {**sizes, **extra}


_DECODER = _sized("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
# grouped-query attention: 2 key/value heads for 4 query heads
#: an encoder-decoder's keywords (Bart, Whisper): each size for both halves
_SEQ2SEQ_NAMES = (
    "d_model",
    "encoder_layers decoder_layers",
    "encoder_attention_heads decoder_attention_heads",
    "encoder_ffn_dim decoder_ffn_dim",
)
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


NO_DROPOUT = dict(_ENCODER, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
#: wrapped in :class:`LossOnly` with :func:`padded_mlm_batch`: encoders, and a decoder whose
#: padding mask is merged with its causal mask (the loss shifts the labels, not the logits, so
#: rows still pair up; with most labels -100 it is an instruction-tuning batch)
LOSS_ONLY_MODELS = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**_ENCODER)),
    "bert": lambda: tf.BertForMaskedLM(tf.BertConfig(**NO_DROPOUT)),
    "roberta": lambda: tf.RobertaForMaskedLM(tf.RobertaConfig(**NO_DROPOUT)),
    "distilbert": lambda: tf.DistilBertForMaskedLM(
        tf.DistilBertConfig(
            vocab_size=VOCAB,
            max_position_embeddings=64,
            dim=HIDDEN,
            n_layers=LAYERS,
            n_heads=HEADS,
            hidden_dim=FFN,
            dropout=0.0,
            attention_dropout=0.0,
        )
    ),
}


def padded_mlm_batch(step: int) -> Batch:
    """Rows of 24 tokens, 6-24 of them real, 30% of those labelled (and the first token)."""
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(6, 25, (4,), generator=gen)
    mask = (torch.arange(24)[None, :] < lengths[:, None]).long()
    ids = torch.randint(5, 128, (4, 24), generator=gen) * mask
    labels = torch.where((torch.rand(4, 24, generator=gen) < 0.3) & mask.bool(), ids, -100)
    labels[0, 0] = int(ids[0, 0])
    return (ids, mask, labels), {}


def loss_only_case(name: str) -> ZooCase:
    """:data:`LOSS_ONLY_MODELS` ``name`` returning its loss, on :func:`padded_mlm_batch`."""
    make = LOSS_ONLY_MODELS[name]
    return ZooCase(f"hf_{name}", lambda: LossOnly(make()), padded_mlm_batch, lambda out, a, k: out)


def adamw(params: Any) -> torch.optim.Optimizer:
    """The optimizer of the parity tests of Hugging Face models."""
    # eps 1e-6 instead of 1e-8: an attention key bias has an analytically zero gradient (softmax
    # is shift-invariant per query), so both engines hand AdamW rounding noise (~1e-9) there,
    # and eps 1e-8 turns that noise into steps of ~lr/10 of random sign. With 1e-6 those steps
    # stay ~1e-6, every element can be compared, and real gradients (>1e-4) still get full Adam.
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def trains_like_eager(case: ZooCase, steps: int, caplog: Any) -> ORTModule:
    """Train ``case`` under eager and under ORTModule with :func:`adamw`, the ORTModule steps'
    ``ortmodule`` log captured at INFO by pytest's ``caplog``; assert they match; the wrapper."""
    model = case.build(seed=0)
    eager = train_steps(clone_model(model), case, steps, adamw)
    wrapped = ORTModule(clone_model(model))
    with caplog.at_level(logging.INFO, logger="ortmodule"):
        record = train_steps(wrapped, case, steps, adamw)
    assert_same_training(eager, record, *case.tolerance)
    return wrapped


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
                **_sized(
                    "hidden_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "ffn_dim",
                    word_embed_proj_dim=HIDDEN,
                    max_position_embeddings=64,
                ),
            ),
            causal_lm_batch,
        ),
        _case(
            "bloom",
            _model(
                tf.BloomForCausalLM,
                tf.BloomConfig,
                **_sized("hidden_size", "n_layer", "n_head"),
            ),
            causal_lm_batch,
        ),
        _case(
            "falcon",
            _model(
                tf.FalconForCausalLM,
                tf.FalconConfig,
                **_sized("hidden_size", "num_hidden_layers", "num_attention_heads"),
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
                **_sized("dim", "n_layers", "n_heads", "hidden_dim", max_position_embeddings=64),
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
                **_sized(
                    "d_model",
                    "num_layers",
                    "num_heads",
                    "d_ff",
                    d_kv=HIDDEN // HEADS,
                    decoder_start_token_id=0,
                    pad_token_id=0,
                ),
            ),
            seq2seq_batch,
        ),
        _case(
            "bart",
            _model(
                tf.BartForConditionalGeneration,
                tf.BartConfig,
                **_sized(*_SEQ2SEQ_NAMES, max_position_embeddings=64),
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


#: (batch, sequence length) of each step of :func:`changing_shapes_batch`
CHANGING_SHAPES = [(2, 12), (3, 9), (2, 14), (4, 10), (3, 12)]


def changing_shapes_batch(step: int) -> Batch:
    """A causal-LM batch whose batch size, length and right padding change every step (the
    last partial batch of an epoch, sequences bucketed by length)."""
    batch, seq = CHANGING_SHAPES[step % len(CHANGING_SHAPES)]
    gen = torch.Generator().manual_seed(30_000 + step)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for row in range(1, batch):
        mask[row, int(torch.randint(seq // 2, seq + 1, (1,), generator=gen)) :] = 0
    labels = ids.masked_fill(mask == 0, IGNORE)
    return (), {"input_ids": ids, "attention_mask": mask, "labels": labels}


_SMALL_GPT = dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=64)

#: more decoder architectures (Llama again as the reference), trained on
#: :func:`changing_shapes_batch` in test_hf_shapes_zoo.py
SHAPES_ZOO: dict[str, ZooCase] = {
    case.name: case
    for case in (
        ZooCase(name, make, changing_shapes_batch, model_loss)
        for name, make in (
            ("llama", _model(tf.LlamaForCausalLM, tf.LlamaConfig, **_GQA)),
            ("qwen3", _model(tf.Qwen3ForCausalLM, tf.Qwen3Config, **_GQA, head_dim=16)),
            ("granite", _model(tf.GraniteForCausalLM, tf.GraniteConfig, **_GQA)),
            ("olmo2", _model(tf.Olmo2ForCausalLM, tf.Olmo2Config, **_GQA)),
            ("starcoder2", _model(tf.Starcoder2ForCausalLM, tf.Starcoder2Config, **_GQA)),
            ("stablelm", _model(tf.StableLmForCausalLM, tf.StableLmConfig, **_GQA)),
            ("gpt_bigcode", _model(tf.GPTBigCodeForCausalLM, tf.GPTBigCodeConfig, **_SMALL_GPT)),
            ("gptj", _model(tf.GPTJForCausalLM, tf.GPTJConfig, **_SMALL_GPT, rotary_dim=8)),
            (
                "codegen",
                _model(tf.CodeGenForCausalLM, tf.CodeGenConfig, **_SMALL_GPT, rotary_dim=8),
            ),
            ("phi3", _model(tf.Phi3ForCausalLM, tf.Phi3Config, **_GQA, pad_token_id=0)),
            ("gemma2", _model(tf.Gemma2ForCausalLM, tf.Gemma2Config, **_GQA, head_dim=16)),
            (
                "gemma3_text",
                _model(tf.Gemma3ForCausalLM, tf.Gemma3TextConfig, **_GQA, head_dim=16),
            ),
            (
                "xglm",
                _model(
                    tf.XGLMForCausalLM,
                    tf.XGLMConfig,
                    **_sized(
                        "d_model",
                        "num_layers",
                        "attention_heads",
                        "ffn_dim",
                        max_position_embeddings=64,
                    ),
                ),
            ),
        )
    )
}


def _sizes_as_ints(outputs: Any) -> Any:
    """A sliding-window cache layer counts tokens in ``cumulative_length``, a Python int in eager
    that the exporter traces as a 0-d tensor (it is ``+= key.shape[-2]``); the engine then
    hands it back as a tensor of the same value. Known difference: compare it as an int."""
    for out in outputs:
        cache = out.get("past_key_values") if hasattr(out, "get") else None
        # an encoder-decoder cache holds two caches of layers
        caches = [
            getattr(cache, n, None) for n in ("self_attention_cache", "cross_attention_cache")
        ]
        layers = [x for c in (cache, *caches) for x in getattr(c, "layers", ())]
        for layer in layers:
            value = getattr(layer, "cumulative_length", None)
            if isinstance(value, torch.Tensor):
                assert value.dim() == 0 and not value.is_floating_point()
                layer.cumulative_length = int(value)
    return outputs


def assert_outputs_close(got: Any, want: Any) -> None:
    """Same structure (cache objects included, via the pytree ORTModule uses), close tensors."""
    got = _sizes_as_ints(got)
    got_tensors, got_schema = flatten(got, prefix="output")
    want_tensors, want_schema = flatten(want, prefix="output")
    assert got_schema.names == want_schema.names
    assert repr(got_schema) == repr(want_schema)
    for name, a, b in zip(want_schema.names, got_tensors, want_tensors, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
