"""The zoo's registry: each case is a model factory, a batch per step index, and a loss.

Every case is small enough to train a few steps on a CPU in well under a second. Batches are
drawn from a ``torch.Generator`` seeded from the step index, so ``make_batch(3)`` is the same
batch every time, and every step has the same structure (shapes, dtypes, Python values); only
tensor values change.

Dropout probability is 0 in every case: dropout draws from each engine's own RNG, so masks
cannot match across engines. The modules still hold ``nn.Dropout`` so that it is exported.

    case = ZOO["gpt"]
    model = case.build(seed=0)
    args, kwargs = case.make_batch(0)
    loss = case.loss_fn(model(*args, **kwargs), args, kwargs)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ortmodule_testing.zoo.bert import IGNORE_INDEX, MASK_TOKEN_ID, BertConfig, BertEncoder
from ortmodule_testing.zoo.cnn import CNN
from ortmodule_testing.zoo.dict_io import DictIOModel
from ortmodule_testing.zoo.frozen import FrozenSubmoduleModel
from ortmodule_testing.zoo.gpt import GPTConfig, GPTDecoder
from ortmodule_testing.zoo.mlp import MLP
from ortmodule_testing.zoo.non_tensor_args import NonTensorArgsModel

__all__ = [
    "ZOO",
    "Batch",
    "BatchFn",
    "LossFn",
    "ZooCase",
    "bert_benchmark",
    "gpt_benchmark",
    "masked_lm_benchmark",
]

Batch = tuple[tuple[Any, ...], dict[str, Any]]
BatchFn = Callable[[int], Batch]
LossFn = Callable[[Any, tuple[Any, ...], dict[str, Any]], torch.Tensor]

# Masked-LM: the share of real (non-padding) tokens that carry a label.
MLM_PROBABILITY = 0.15


@dataclass(frozen=True)
class ZooCase:
    """One workload: ``loss_fn(model(*args, **kwargs), args, kwargs)`` is a scalar to minimise.

    ``make_model`` does not seed; call ``torch.manual_seed`` first or use :meth:`build`.
    ``tolerance`` is the ``(rtol, atol)`` for comparing an engine against PyTorch eager.
    """

    name: str
    make_model: Callable[[], nn.Module]
    make_batch: BatchFn
    loss_fn: LossFn
    tolerance: tuple[float, float] = (1e-4, 1e-5)

    def build(self, seed: int = 0) -> nn.Module:
        """``make_model()`` under ``torch.manual_seed(seed)``, leaving the global RNG untouched."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.make_model()


def _generator(step: int) -> torch.Generator:
    if step < 0:
        raise ValueError(f"make_batch takes a step index >= 0, got {step}")
    return torch.Generator().manual_seed(10_000 + step)


# --- mlp: regression towards sin of the inputs, loss outside the model ---------------------


def _mlp_batch(step: int) -> Batch:
    return (torch.randn(8, 16, generator=_generator(step)),), {}


def _mlp_loss(out: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    target = torch.sin(args[0][:, : out.shape[-1]])
    return F.mse_loss(out, target)


# --- cnn: classify which channel is brightest ----------------------------------------------


def _cnn_batch(step: int) -> Batch:
    return (torch.randn(4, 3, 16, 16, generator=_generator(step)),), {}


def _cnn_loss(out: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    return F.cross_entropy(out, args[0].mean(dim=(2, 3)).argmax(dim=1))


# --- gpt / bert: the loss is computed inside the model ---------------------------------------


def _lm_batch(step: int, batch: int, config: GPTConfig) -> Batch:
    ids = torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=_generator(step))
    return (ids,), {"labels": ids.clone()}


def _mlm_batch(step: int, batch: int, seq: int, vocab_size: int) -> Batch:
    """Right-padded sequences of random lengths; 15% of real tokens masked and labelled."""
    gen = _generator(step)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=gen)
    attention_mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    # 0 is padding and 1 is [MASK], so words start at 2.
    tokens = torch.randint(MASK_TOKEN_ID + 1, vocab_size, (batch, seq), generator=gen)
    tokens = tokens * attention_mask
    chosen = (torch.rand(batch, seq, generator=gen) < MLM_PROBABILITY) & attention_mask.bool()
    if not chosen.any():  # a batch without labels has a NaN loss
        chosen[0, 0] = True
    labels = torch.where(chosen, tokens, IGNORE_INDEX)
    input_ids = torch.where(chosen, MASK_TOKEN_ID, tokens)
    return (input_ids, attention_mask), {"labels": labels}


def _first_output(out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    return out[0]  # type: ignore[no-any-return]


def _loss_entry(out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    return out["loss"]  # type: ignore[no-any-return]


# --- dict_io -----------------------------------------------------------------------------------


def _dict_io_batch(step: int) -> Batch:
    gen = _generator(step)
    x = torch.randn(4, 6, 8, generator=gen)
    mask = torch.rand(4, 6, generator=gen) < 0.7
    mask[:, 0] = True  # every row keeps at least one position
    targets = torch.randn(4, 4, generator=gen)
    return ({"x": x, "mask": mask},), {"targets": targets}


# --- non_tensor_args: non-default values for every Python argument ---------------------------


def _non_tensor_batch(step: int) -> Batch:
    x = torch.randn(8, 8, generator=_generator(step))
    return (x,), {"scale": 0.5, "use_bias": False, "mode": "gelu"}


def _sum_of_squares(
    out: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.Tensor:
    return out.square().sum()


# --- frozen ------------------------------------------------------------------------------------


def _frozen_batch(step: int) -> Batch:
    return (torch.randint(0, 64, (8, 5), generator=_generator(step)),), {}


def _frozen_loss(out: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    return F.cross_entropy(out, args[0][:, 0] % out.shape[-1])


def _cases(*cases: ZooCase) -> dict[str, ZooCase]:
    return {case.name: case for case in cases}


ZOO: dict[str, ZooCase] = _cases(
    # Loss outside the model: mse(out, sin(x[:, :8])).
    ZooCase("mlp", lambda: MLP(16, 8), _mlp_batch, _mlp_loss),
    # BatchNorm running statistics are buffers the engine must update too.
    ZooCase("cnn", lambda: CNN(3, 10), _cnn_batch, _cnn_loss),
    ZooCase(
        "gpt",
        lambda: GPTDecoder(GPTConfig.small()),
        lambda step: _lm_batch(step, 4, GPTConfig.small()),
        _first_output,
    ),
    ZooCase(
        "bert",
        lambda: BertEncoder(BertConfig.small()),
        lambda step: _mlm_batch(
            step, 4, BertConfig.small().max_position, BertConfig.small().vocab_size
        ),
        _loss_entry,
    ),
    # A loss-only masked LM (how a training wrapper calls it): about 12% of labels count.
    ZooCase(
        "masked_lm",
        lambda: BertEncoder(BertConfig.small(return_logits=False)),
        lambda step: _mlm_batch(
            step, 4, BertConfig.small().max_position, BertConfig.small().vocab_size
        ),
        _loss_entry,
    ),
    ZooCase("dict_io", DictIOModel, _dict_io_batch, _loss_entry),
    # use_bias=False: fc1.bias gets no gradient (None), which an engine must keep.
    ZooCase("non_tensor_args", NonTensorArgsModel, _non_tensor_batch, _sum_of_squares),
    ZooCase("frozen", FrozenSubmoduleModel, _frozen_batch, _frozen_loss),
)


def gpt_benchmark(batch: int = 8) -> tuple[Callable[[], nn.Module], BatchFn]:
    """The benchmark GPT (vocab 1024, d 256, 4 layers, 4 heads, seq 128) and its batches.

    make_model, make_batch = gpt_benchmark()
    args, kwargs = make_batch(0)  # (input_ids (8, 128),), {"labels": (8, 128)}
    loss, logits = make_model()(*args, **kwargs)
    """
    config = GPTConfig()
    return (lambda: GPTDecoder(config)), (lambda step: _lm_batch(step, batch, config))


def masked_lm_benchmark(batch: int = 8) -> tuple[Callable[[], nn.Module], BatchFn]:
    """A loss-only BERT masked LM with a realistic vocabulary share of the compute.

    Vocab 8192, d 256, 4 layers, 4 heads, seq 128; the batches of :func:`bert_benchmark` (about
    11% of tokens labelled). The model returns only the loss, as a training wrapper does.

        make_model, make_batch = masked_lm_benchmark()
        args, kwargs = make_batch(0)
        make_model()(*args, **kwargs)["loss"]
    """
    config = BertConfig(vocab_size=8192, return_logits=False)
    return (lambda: BertEncoder(config)), (
        lambda step: _mlm_batch(step, batch, config.max_position, config.vocab_size)
    )


def bert_benchmark(batch: int = 8) -> tuple[Callable[[], nn.Module], BatchFn]:
    """The benchmark BERT masked-LM (vocab 1024, d 256, 4 layers, 4 heads, seq 128) and batches.

    Sequences are right-padded to 128 from random lengths in [64, 128]; 15% of the real tokens
    are replaced by [MASK] and labelled, every other label is -100.

        make_model, make_batch = bert_benchmark()
        args, kwargs = make_batch(0)  # (input_ids, attention_mask), {"labels": ...}
        make_model()(*args, **kwargs)["loss"]
    """
    config = BertConfig()
    return (lambda: BertEncoder(config)), (
        lambda step: _mlm_batch(step, batch, config.max_position, config.vocab_size)
    )
