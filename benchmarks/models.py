"""The benchmark workloads: a model factory, a batch per step and the loss, at two sizes.

The models come from the shared zoo (``ortmodule_testing.zoo``), so the benchmarks train what
the parity tests check. ``quick`` sizes keep the whole suite under ten minutes on two cores;
``--full`` uses bigger batches and more steps.

    workload = WORKLOADS["gpt"]
    model = workload.build(full=False)
    args, kwargs = workload.batch(step=0, full=False)
    loss = workload.loss(model(*args, **kwargs))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ortmodule_exporter.aten.parallel import ThreadTrial
from ortmodule_testing.zoo import (
    CNN,
    MLP,
    LossOnly,
    bert_benchmark,
    gpt_benchmark,
    masked_lm_benchmark,
)

__all__ = [
    "AUTOCAST_MODELS",
    "DEFAULT_MODELS",
    "LABEL_SPARSITY_MODELS",
    "PADDING_ELIMINATION",
    "PADDING_MODELS",
    "SCALE_MODELS",
    "WORKLOADS",
    "Workload",
]

Batch = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class Workload:
    """One model to benchmark; ``warmup`` steps are run, then ``measured`` steps are timed."""

    name: str
    description: str
    make_model: Callable[[bool], nn.Module]
    make_batch: Callable[[int, bool], Batch]
    loss: Callable[[Any, Batch], torch.Tensor]
    #: (warmup, measured) steps for the quick and the full suite
    quick_steps: tuple[int, int]
    full_steps: tuple[int, int]

    def build(self, full: bool, seed: int = 0) -> nn.Module:
        """The model under ``torch.manual_seed(seed)``: every process builds the same weights."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.make_model(full)

    def batch(self, step: int, full: bool) -> Batch:
        return self.make_batch(step, full)

    def steps(self, full: bool) -> tuple[int, int]:
        return self.full_steps if full else self.quick_steps


#: warm-up steps: every step of the in-engine thread trial (ORTMODULE_TORCH_THREADS_IN_ENGINE=auto
#: measures 1 thread against PyTorch's count on a graph's first steps) is past before timing
WARMUP = ThreadTrial.WARMUP + 2 * ThreadTrial.ROUNDS


def _gen(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(20_000 + step)


# -- GPT and BERT: the zoo's benchmark sizes (vocab 1024, d 256, 4 layers, seq 128) --------------


def _gpt_model(full: bool) -> nn.Module:
    return gpt_benchmark()[0]()


def _gpt_batch(step: int, full: bool) -> Batch:
    return gpt_benchmark(batch=16 if full else 8)[1](step)


def _bert_model(full: bool) -> nn.Module:
    return bert_benchmark()[0]()


def _bert_batch(step: int, full: bool) -> Batch:
    return bert_benchmark(batch=16 if full else 8)[1](step)


def _masked_lm_model(full: bool) -> nn.Module:
    return masked_lm_benchmark()[0]()


def _masked_lm_batch(step: int, full: bool) -> Batch:
    return masked_lm_benchmark(batch=16 if full else 8)[1](step)


def _first(out: Any, batch: Batch) -> torch.Tensor:
    return out[0]  # type: ignore[no-any-return]


def _loss_entry(out: Any, batch: Batch) -> torch.Tensor:
    return out["loss"]  # type: ignore[no-any-return]


# -- MLP with many small layers: per-op overhead dominates -----------------------------------------


def _mlp_model(full: bool) -> nn.Module:
    return MLP(16, 8, many_small=True)


def _mlp_batch(step: int, full: bool) -> Batch:
    return (torch.randn(256 if full else 64, 16, generator=_gen(step)),), {}


def _mlp_loss(out: Any, batch: Batch) -> torch.Tensor:
    x = batch[0][0]
    return F.mse_loss(out, torch.sin(x[:, : out.shape[-1]]))


# -- CNN: convolutions, BatchNorm buffers, pooling -------------------------------------------------


def _cnn_model(full: bool) -> nn.Module:
    return CNN(3, 10, channels=(32, 64) if full else (16, 32))


def _cnn_batch(step: int, full: bool) -> Batch:
    size = 64 if full else 32
    return (torch.randn(32 if full else 16, 3, size, size, generator=_gen(step)),), {}


def _cnn_loss(out: Any, batch: Batch) -> torch.Tensor:
    images = batch[0][0]
    return F.cross_entropy(out, images.mean(dim=(2, 3)).argmax(dim=1))


# -- a tiny Hugging Face Llama: built from a config, nothing downloaded ----------------------------


def _llama_config(vocab: int) -> Any:
    # imported here: transformers is a bench dependency only, and a missing one must turn
    # into an error row in the report, not a crash of the whole suite
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )


def _bert_config(vocab: int, **extra: Any) -> Any:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=128,
        # attention dropout 0 as in every model here (dropout draws differ between engines)
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **extra,
    )


def _llama(use_cache: bool | None) -> Callable[[bool], nn.Module]:
    def make(full: bool) -> nn.Module:
        from transformers import LlamaForCausalLM

        config = _llama_config(1024)
        if use_cache is not None:
            config.use_cache = use_cache
        return LlamaForCausalLM(config)

    return make


def _llama_batch(step: int, full: bool) -> Batch:
    ids = torch.randint(0, 1024, (16 if full else 8, 128), generator=_gen(step))
    return (), {"input_ids": ids, "labels": ids}


def _padded_ids(
    gen: torch.Generator, batch: int, shortest: int, longest: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of rows of 128 tokens, each right-padded (id 0) from a length in
    [shortest, longest]; real ids are 5 and above."""
    lengths = torch.randint(shortest, longest + 1, (batch,), generator=gen)
    mask = (torch.arange(128)[None, :] < lengths[:, None]).long()
    return torch.randint(5, vocab, (batch, 128), generator=gen) * mask, mask


def _classifier_model(full: bool) -> nn.Module:
    from transformers import BertForSequenceClassification

    return BertForSequenceClassification(_bert_config(8192, num_labels=3))


def _classifier_batch(step: int, full: bool) -> Batch:
    """Short sentences in 128-token rows: 16-79 real tokens, about 37% of the batch."""
    gen = _gen(step)
    batch = 32 if full else 16
    ids, mask = _padded_ids(gen, batch, 16, 79, 8192)
    labels = torch.randint(0, 3, (batch,), generator=gen)
    return (), {"input_ids": ids, "attention_mask": mask, "labels": labels}


#: bert-base's vocabulary: the masked-LM head and its loss dominate the step
_HF_VOCAB = 30522


def _hf_masked_lm(loss_only: bool) -> Callable[[bool], nn.Module]:
    def make(full: bool) -> nn.Module:
        from transformers import BertForMaskedLM

        model = BertForMaskedLM(_bert_config(_HF_VOCAB))
        return LossOnly(model) if loss_only else model

    return make


def _hf_masked_lm_batch(loss_only: bool) -> Callable[[int, bool], Batch]:
    """Rows of 128 tokens right-padded from [64, 128], 15% of the real ones labelled."""

    def make(step: int, full: bool) -> Batch:
        gen = _gen(step)
        batch = 16 if full else 8
        ids, mask = _padded_ids(gen, batch, 64, 128, _HF_VOCAB)
        labels = torch.where(
            (torch.rand(batch, 128, generator=gen) < 0.15) & mask.bool(), ids, -100
        )
        if loss_only:
            return (ids, mask, labels), {}
        return (), {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return make


#: Llama 2's vocabulary
_SFT_VOCAB = 32000


def _llama_sft_model(full: bool) -> nn.Module:
    from transformers import LlamaForCausalLM

    return LossOnly(LlamaForCausalLM(_llama_config(_SFT_VOCAB)))


def _llama_sft_batch(step: int, full: bool) -> Batch:
    """Instruction tuning: the first 32-96 of 128 tokens are the prompt, labelled -100."""
    gen = _gen(step)
    batch = 16 if full else 8
    ids = torch.randint(0, _SFT_VOCAB, (batch, 128), generator=gen)
    prompt = torch.randint(32, 97, (batch, 1), generator=gen)
    labels = torch.where(torch.arange(128)[None, :] < prompt, -100, ids)
    return (ids, torch.ones_like(ids), labels), {}


def _loss_itself(out: Any, batch: Batch) -> torch.Tensor:
    return out  # type: ignore[no-any-return]


def _hf_loss(out: Any, batch: Batch) -> torch.Tensor:
    return out.loss  # type: ignore[no-any-return]


# -- real sizes (--scale): GPT-2 small and a Llama of about 350M, built from configs ------------

#: GPT-2 small: 124M parameters, its vocabulary and context
GPT2_SMALL: dict[str, Any] = {
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
}
#: a Llama-architecture model of about 350M parameters at Llama 2's vocabulary (untied head)
LLAMA_350M: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 22,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "max_position_embeddings": 2048,
}
#: (batch, tokens) of the real-size workloads: GPT-2 as the issue measured it (4 x 256); the
#: Llama at 2 x 256 so one step stays near half a minute on two cores
GPT2_BATCH = (4, 256)
LLAMA_BATCH = (2, 256)


def gpt2_model(size: dict[str, Any] | None = None) -> nn.Module:
    """Hugging Face ``GPT2LMHeadModel`` at ``size`` (GPT-2 small's config by default), dropout
    off (the engine's dropout draws differ from PyTorch's, so losses could not be compared)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        **(size or GPT2_SMALL), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False
    )
    return GPT2LMHeadModel(config)


def llama_model(size: dict[str, Any] | None = None) -> nn.Module:
    """Hugging Face ``LlamaForCausalLM`` at ``size`` (:data:`LLAMA_350M` by default)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**(size or LLAMA_350M), use_cache=False))


def causal_lm_batch(vocab: int, shape: tuple[int, int]) -> Callable[[int, bool], Batch]:
    """Random token rows of ``shape``, labels = inputs (the model shifts them)."""

    def make(step: int, full: bool) -> Batch:
        ids = torch.randint(0, vocab, shape, generator=_gen(step))
        return (), {"input_ids": ids, "labels": ids}

    return make


# -- tiny: the per-step Python overhead ------------------------------------------------------------


def _tiny_model(full: bool) -> nn.Module:
    return nn.Linear(8, 8)


def _tiny_batch(step: int, full: bool) -> Batch:
    return (torch.randn(4, 8, generator=_gen(step)),), {}


def _sum_of_squares(out: Any, batch: Batch) -> torch.Tensor:
    return out.square().mean()  # type: ignore[no-any-return]


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "gpt",
            "GPT-style decoder: vocab 1024, d 256, 4 layers, 4 heads, seq 128, batch 8 (16 with --full)",
            _gpt_model,
            _gpt_batch,
            _first,
            (WARMUP, 8),
            (WARMUP, 30),
        ),
        Workload(
            "bert",
            "BERT-style masked LM: vocab 1024, d 256, 4 layers, seq 128 right-padded from [64, 128], "
            "15% of tokens labelled, batch 8 (16 with --full)",
            _bert_model,
            _bert_batch,
            _loss_entry,
            (WARMUP, 8),
            (WARMUP, 30),
        ),
        Workload(
            "masked_lm",
            "loss-only BERT masked LM: vocab 8192, d 256, 4 layers, seq 128 right-padded from "
            "[64, 128], 15% of real tokens labelled (about 11% of all), batch 8 (16 with --full)",
            _masked_lm_model,
            _masked_lm_batch,
            _loss_entry,
            (WARMUP, 8),
            (WARMUP, 30),
        ),
        Workload(
            "mlp_many_small",
            "MLP with 48 hidden layers of width 16 (ReLU), batch 64 (256 with --full)",
            _mlp_model,
            _mlp_batch,
            _mlp_loss,
            (WARMUP, 30),
            (WARMUP, 100),
        ),
        Workload(
            "cnn",
            "CNN: 2 x (Conv3x3 -> BatchNorm -> ReLU), pooling, 16x3x32x32 images "
            "(32x3x64x64, wider, with --full)",
            _cnn_model,
            _cnn_batch,
            _cnn_loss,
            (WARMUP, 20),
            (WARMUP, 60),
        ),
        Workload(
            "llama",
            "tiny Hugging Face LlamaForCausalLM (default config but vocab 1024, hidden 256, "
            "4 layers, 4 heads), seq 128, batch 8 (16 with --full), labels = inputs",
            _llama(None),
            _llama_batch,
            _hf_loss,
            (WARMUP, 8),
            (WARMUP, 30),
        ),
        Workload(
            "bert_classifier",
            "Hugging Face BertForSequenceClassification (vocab 8192, hidden 256, 4 layers, "
            "3 classes), rows of 128 tokens with 16-79 real (about 37%), batch 16 (32 with --full)",
            _classifier_model,
            _classifier_batch,
            _hf_loss,
            (WARMUP, 8),
            (WARMUP, 30),
        ),
        Workload(
            "hf_masked_lm",
            "Hugging Face BertForMaskedLM returning only its loss (vocab 30522, hidden 256, "
            "4 layers), seq 128 right-padded from [64, 128], 15% of real tokens labelled, "
            "batch 8 (16 with --full)",
            _hf_masked_lm(loss_only=True),
            _hf_masked_lm_batch(loss_only=True),
            _loss_itself,
            (WARMUP, 8),
            (WARMUP, 20),
        ),
        Workload(
            "hf_masked_lm_logits",
            "the same BertForMaskedLM returning loss and logits (its default output)",
            _hf_masked_lm(loss_only=False),
            _hf_masked_lm_batch(loss_only=False),
            _hf_loss,
            (WARMUP, 8),
            (WARMUP, 20),
        ),
        Workload(
            "hf_llama_sft",
            "Hugging Face LlamaForCausalLM returning only its loss (vocab 32000, hidden 256, "
            "4 layers), seq 128 whose first 32-96 tokens are the prompt (labels -100, about 47%), "
            "batch 8 (16 with --full)",
            _llama_sft_model,
            _llama_sft_batch,
            _loss_itself,
            (WARMUP, 8),
            (WARMUP, 20),
        ),
        Workload(
            "gpt2_124m",
            "Hugging Face GPT2LMHeadModel at GPT-2 small's config (124M parameters, vocab 50257, "
            "12 layers, width 768, dropout off), batch 4 x 256 tokens, labels = inputs",
            lambda full: gpt2_model(),
            causal_lm_batch(GPT2_SMALL["vocab_size"], GPT2_BATCH),
            _hf_loss,
            (2, 3),
            (4, 8),
        ),
        Workload(
            "llama_350m",
            "Hugging Face LlamaForCausalLM from config: about 350M parameters (vocab 32000, "
            "hidden 1024, 22 layers, 16 heads, MLP 2816, untied head), batch 2 x 256, labels = inputs",
            lambda full: llama_model(),
            causal_lm_batch(LLAMA_350M["vocab_size"], LLAMA_BATCH),
            _hf_loss,
            (2, 5),
            (3, 6),
        ),
        Workload(
            "llama_no_cache",
            "the same tiny Llama with use_cache=False (no DynamicCache in its outputs)",
            _llama(False),
            _llama_batch,
            _hf_loss,
            (WARMUP, 8),
            (WARMUP, 30),
        ),
    )
}

#: on request only: a variant of a default model, and the Hugging Face models at real
#: vocabularies, whose eager steps (about 1 s each here) would double the suite's time
ON_REQUEST = (
    "llama_no_cache",
    "hf_masked_lm",
    "hf_masked_lm_logits",
    "hf_llama_sft",
    "gpt2_124m",
    "llama_350m",
)
#: the real-size workloads of ``python -m benchmarks --scale`` (issue #41); on request only
SCALE_MODELS = ("gpt2_124m", "llama_350m")
#: what `python -m benchmarks` runs without --models
DEFAULT_MODELS = tuple(name for name in WORKLOADS if name not in ON_REQUEST)

#: workloads run under bfloat16 autocast too with ``--bf16`` (eager, ORTModule and torch.compile
#: under ``torch.autocast("cpu", torch.bfloat16)``, against fp32 eager)
AUTOCAST_MODELS = ("gpt", "bert", "llama")
#: workloads also run with ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER=0 (the on/off comparison)
LABEL_SPARSITY_MODELS = ("masked_lm",)
#: workloads also run with padding elimination on (off by default), per process and interleaved
PADDING_MODELS = ("masked_lm", "bert_classifier")
PADDING_ELIMINATION = {"ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER": "1"}

#: the overhead workload: one Linear(8, 8) on a 4x8 batch, where nearly all time is per-step work
TINY = Workload(
    "tiny",
    "Linear(8, 8) on a 4x8 batch",
    _tiny_model,
    _tiny_batch,
    _sum_of_squares,
    (20, 300),
    (50, 2000),
)
