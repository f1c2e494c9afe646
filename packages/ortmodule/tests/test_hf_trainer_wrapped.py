"""A plain ``transformers.Trainer`` (and ``ORTTrainer``) given an ``ORTModule``: ``evaluate``
reports ``eval_loss`` as for the plain model, and ``save_model`` writes what ``save_pretrained``
writes, so ``from_pretrained`` rebuilds the same model.

Issue #36: Trainer finds the label names in ``find_labels(model.__class__)`` and saves with
``save_pretrained`` only when ``isinstance(model, PreTrainedModel)``; the wrapper looked like
neither, so evaluation computed no loss and the checkpoint had no ``config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")

import transformers as tf  # noqa: E402
from hf_models import NO_DROPOUT, padded_mlm_batch  # noqa: E402

from ortmodule import ORTModule  # noqa: E402
from ortmodule.integrations.hf_trainer import ORTTrainer  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
#: not the config's defaults, so a checkpoint without config.json cannot load as this model
SIZES = dict(NO_DROPOUT)


@pytest.fixture(autouse=True)
def _engine_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")


def _bert() -> tf.BertForMaskedLM:
    torch.manual_seed(0)
    return tf.BertForMaskedLM(tf.BertConfig(**SIZES))


def _data() -> list[dict[str, torch.Tensor]]:
    names = ("input_ids", "attention_mask", "labels")
    return [
        {name: t[i] for name, t in zip(names, padded_mlm_batch(step)[0], strict=True)}
        for step in range(2)
        for i in range(2)
    ]


def _args(out: Path) -> tf.TrainingArguments:
    return tf.TrainingArguments(
        str(out), per_device_eval_batch_size=2, report_to=[], use_cpu=True,
        save_strategy="no", seed=0, disable_tqdm=True,
    )  # fmt: skip


_TRAINERS: dict[str, Any] = {"Trainer": tf.Trainer, "ORTTrainer": ORTTrainer}


@pytest.mark.parametrize("trainer", sorted(_TRAINERS))
def test_evaluate_reports_the_eval_loss_of_the_plain_model(tmp_path: Path, trainer: str) -> None:
    plain = tf.Trainer(model=_bert(), args=_args(tmp_path / "plain"), eval_dataset=_data())
    wrapped = ORTModule(_bert())
    ours = _TRAINERS[trainer](model=wrapped, args=_args(tmp_path / "ort"), eval_dataset=_data())
    assert ours.label_names == plain.label_names == ["labels"]
    want, got = plain.evaluate(), ours.evaluate()
    assert "eval_loss" in want
    assert "eval_loss" in got, f"no eval_loss in {sorted(got)}"
    torch.testing.assert_close(got["eval_loss"], want["eval_loss"], rtol=RTOL, atol=ATOL)
    # the engine computed it (fallback is disabled): an inference graph was built
    assert wrapped._runner.exports >= 1


def test_question_answering_label_names_are_found_through_the_wrapper(tmp_path: Path) -> None:
    # find_labels reads the class name too: QA models label start and end positions
    torch.manual_seed(0)
    model = tf.BertForQuestionAnswering(tf.BertConfig(**SIZES))
    plain = tf.Trainer(model=model, args=_args(tmp_path / "plain"))
    trainer = tf.Trainer(model=ORTModule(model), args=_args(tmp_path / "ort"))
    assert trainer.label_names == plain.label_names == ["start_positions", "end_positions"]
    assert trainer.can_return_loss == plain.can_return_loss


@pytest.mark.parametrize("trainer", sorted(_TRAINERS))
def test_save_model_round_trips_through_from_pretrained(tmp_path: Path, trainer: str) -> None:
    wrapped = ORTModule(_bert())
    saver = _TRAINERS[trainer](model=wrapped, args=_args(tmp_path / "run"))
    saver.save_model(str(tmp_path / "saved"))
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"]
    assert config["hidden_size"] == SIZES["hidden_size"]
    loaded = tf.BertForMaskedLM.from_pretrained(str(tmp_path / "saved"))
    assert loaded.config.hidden_size == SIZES["hidden_size"]
    want = wrapped.module.state_dict()
    got = loaded.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    # and through the Auto class, which reads the architecture from config.json
    auto = tf.AutoModelForMaskedLM.from_pretrained(str(tmp_path / "saved"))
    assert type(auto) is tf.BertForMaskedLM
