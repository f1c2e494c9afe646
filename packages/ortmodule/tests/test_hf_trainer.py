"""transformers.Trainer trains an ORTModule-wrapped model like the plain one (losses, weights),
ORTTrainer trains through the model's loss alone (so labelled rows applies to a masked LM), and
ORTTrainer.save_model writes a checkpoint that from_pretrained loads into a plain model."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")

import transformers as tf  # noqa: E402
from hf_models import HF_ZOO, NO_DROPOUT, causal_lm_batch, padded_mlm_batch  # noqa: E402

from ortmodule import ORTModule  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5


def _causal_lm_data() -> list[dict[str, torch.Tensor]]:
    return [
        {k: v[i] for k, v in causal_lm_batch(step)[1].items()}
        for step in range(3)
        for i in range(2)
    ]


def _masked_lm_data() -> list[dict[str, torch.Tensor]]:
    """Two rows a step of the padded masked-LM batches (about 30% of the real tokens labelled)."""
    names = ("input_ids", "attention_mask", "labels")
    return [
        {name: t[i] for name, t in zip(names, padded_mlm_batch(step)[0], strict=True)}
        for step in range(3)
        for i in range(2)
    ]


def _train(
    model: torch.nn.Module,
    out: Path,
    wrap: bool,
    data: Callable[[], list[dict[str, torch.Tensor]]] = _causal_lm_data,
    bf16: bool = False,
    **trainer_kwargs: Any,
) -> tuple[Any, list[float]]:
    from transformers import Trainer, TrainingArguments

    from ortmodule.integrations.hf_trainer import ORTTrainer

    args = TrainingArguments(
        str(out), per_device_train_batch_size=2, max_steps=3, learning_rate=1e-3,
        adam_epsilon=1e-6, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
        seed=0, disable_tqdm=True, bf16=bf16,
    )  # fmt: skip
    trainer_cls = ORTTrainer if wrap else Trainer
    trainer = trainer_cls(
        model=ORTModule(model) if wrap else model, args=args, train_dataset=data(), **trainer_kwargs
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses


def _assert_same_training(trainer: Any, losses: list[float], plain: Any, plain_losses: Any) -> None:
    assert len(losses) == 3
    torch.testing.assert_close(losses, plain_losses, rtol=RTOL, atol=ATOL)
    want = plain.model.state_dict()
    for name, value in trainer.model.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=RTOL, atol=ATOL, msg=name)


def test_trainer_with_ortmodule_matches_plain_trainer_and_saves_a_loadable_model(
    tmp_path: Path,
) -> None:
    case = HF_ZOO["llama"]
    plain_trainer, plain_losses = _train(case.build(seed=0), tmp_path / "plain", wrap=False)
    trainer, losses = _train(case.build(seed=0), tmp_path / "ort", wrap=True)
    wrapped = trainer.model
    assert isinstance(wrapped, ORTModule)
    # fallback is disabled: the engine trained it, through the model's loss alone
    assert trainer._loss_model[1]._runner.exports >= 1
    # Trainer picks dataset columns from this signature
    assert "labels" in inspect.signature(wrapped.forward).parameters
    _assert_same_training(trainer, losses, plain_trainer, plain_losses)

    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "config.json").exists()
    loaded = type(wrapped.module).from_pretrained(str(tmp_path / "saved"))
    assert type(loaded) is type(wrapped.module)
    for name, value in wrapped.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_trainer_bf16_on_cpu_trains_like_the_plain_trainer(tmp_path: Path) -> None:
    """``TrainingArguments(bf16=True)`` on CPU: accelerate runs each forward under bfloat16
    autocast, which the engine graph follows (docs/mixed_precision.md)."""
    from ortmodule_testing.parity import GRAD_RTOL, LOSS_RTOL

    case = HF_ZOO["llama"]
    plain, plain_losses = _train(case.build(seed=0), tmp_path / "plain", wrap=False, bf16=True)
    trainer, losses = _train(case.build(seed=0), tmp_path / "ort", wrap=True, bf16=True)
    assert trainer._loss_model[1]._runner.exports >= 1  # fallback disabled: the engine ran
    torch.testing.assert_close(losses, plain_losses, rtol=LOSS_RTOL, atol=0.0)
    want = plain.model.state_dict()
    for name, value in trainer.model.state_dict().items():
        # 3 AdamW steps of lr 1e-3: noise-level gradients may step apart by 2 lr each
        torch.testing.assert_close(value, want[name], rtol=GRAD_RTOL, atol=6e-3, msg=name)


def _bert_mlm() -> torch.nn.Module:
    torch.manual_seed(0)
    return tf.BertForMaskedLM(tf.BertConfig(**NO_DROPOUT))


def test_masked_lm_trains_through_its_loss_alone_on_the_labelled_rows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BertForMaskedLM returns its logits beside the loss; ORTTrainer's steps run the loss alone,
    so the head runs on the labelled tokens, and the training equals a plain Trainer's."""
    plain, plain_losses = _train(_bert_mlm(), tmp_path / "plain", False, _masked_lm_data)
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")  # the wrapper sets the logger's level
    with caplog.at_level(logging.INFO, logger="ortmodule"):
        trainer, losses = _train(_bert_mlm(), tmp_path / "ort", True, _masked_lm_data)
    assert "labelled rows on" in caplog.text
    assert trainer.model._runner.exports == 0  # the model as given built no graph
    _assert_same_training(trainer, losses, plain, plain_losses)


def test_loss_only_off_trains_the_model_as_given(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, plain_losses = _train(_bert_mlm(), tmp_path / "plain", False, _masked_lm_data)
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")  # the wrapper sets the logger's level
    with caplog.at_level(logging.INFO, logger="ortmodule"):
        trainer, losses = _train(
            _bert_mlm(), tmp_path / "ort", True, _masked_lm_data, loss_only=False
        )
    assert trainer._loss_model is None
    assert trainer.model._runner.exports >= 1
    # the logits leave the model: labelled rows cannot apply
    assert "labelled rows off" in caplog.text
    _assert_same_training(trainer, losses, plain, plain_losses)


class _Scaled(torch.nn.Module):
    """A Trainer-style model whose forward reads a plain attribute (``scale``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.head = torch.nn.Linear(8, 32)
        self.scale = 1.0

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.embed(input_ids) * self.scale)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 32), labels.reshape(-1))
        return {"loss": loss, "logits": logits}


def test_an_attribute_written_through_the_wrapper_reaches_the_loss_graph(tmp_path: Path) -> None:
    """``trainer.model.scale = 3.0`` between two trainings: the loss-only graph re-exports with
    the new value, as the wrapper's own graph would, and both trainings equal a plain Trainer's."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (6, 5), generator=gen)

    def data() -> list[dict[str, torch.Tensor]]:
        return [{"input_ids": row, "labels": row} for row in ids]

    results = []
    for wrap in (False, True):
        torch.manual_seed(0)
        trainer, first = _train(_Scaled(), tmp_path / f"{wrap}", wrap, data)
        trainer.model.scale = 3.0
        trainer.train()
        second = [h["loss"] for h in trainer.state.log_history if "loss" in h][len(first) :]
        results.append((trainer, first, second))
    (plain, plain_first, plain_second), (trainer, first, second) = results
    assert trainer._loss_model[1]._runner.exports == 2
    torch.testing.assert_close(first, plain_first, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(second, plain_second, rtol=RTOL, atol=ATOL)
    assert second != first  # the new scale changed the losses
