"""transformers.Trainer trains an ORTModule-wrapped model like the plain one (losses, weights),
and ORTTrainer.save_model writes a checkpoint that from_pretrained loads into a plain model."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")

from hf_models import HF_ZOO, causal_lm_batch  # noqa: E402

from ortmodule import ORTModule  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5


def _train(model: torch.nn.Module, out: Path, wrap: bool) -> tuple[Any, list[float]]:
    from transformers import Trainer, TrainingArguments

    from ortmodule.integrations.hf_trainer import ORTTrainer

    data = [
        {k: v[i] for k, v in causal_lm_batch(step)[1].items()}
        for step in range(3)
        for i in range(2)
    ]
    args = TrainingArguments(
        str(out), per_device_train_batch_size=2, max_steps=3, learning_rate=1e-3,
        adam_epsilon=1e-6, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
        seed=0, disable_tqdm=True,
    )  # fmt: skip
    trainer_cls = ORTTrainer if wrap else Trainer
    trainer = trainer_cls(model=ORTModule(model) if wrap else model, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses


def test_trainer_with_ortmodule_matches_plain_trainer_and_saves_a_loadable_model(
    tmp_path: Path,
) -> None:
    case = HF_ZOO["llama"]
    plain_trainer, plain_losses = _train(case.build(seed=0), tmp_path / "plain", wrap=False)
    trainer, losses = _train(case.build(seed=0), tmp_path / "ort", wrap=True)
    wrapped = trainer.model
    assert isinstance(wrapped, ORTModule)
    assert wrapped._runner.exports >= 1  # fallback is disabled: the engine trained it
    # Trainer picks dataset columns from this signature
    assert "labels" in inspect.signature(wrapped.forward).parameters
    assert len(losses) == 3
    torch.testing.assert_close(losses, plain_losses, rtol=RTOL, atol=ATOL)
    want = plain_trainer.model.state_dict()
    for name, value in wrapped.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=RTOL, atol=ATOL, msg=name)

    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "config.json").exists()
    loaded = type(wrapped.module).from_pretrained(str(tmp_path / "saved"))
    assert type(loaded) is type(wrapped.module)
    for name, value in wrapped.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
