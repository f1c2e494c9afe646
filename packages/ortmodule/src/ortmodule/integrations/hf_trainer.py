"""``ORTTrainer``: Hugging Face's ``Trainer`` for an ``ORTModule``-wrapped ``PreTrainedModel``.

A plain ``Trainer`` trains, evaluates and saves an ``ORTModule`` as it does the model: the
wrapper has the model's ``forward`` signature, ``config`` and state dict keys, and presents the
model's class (``model.__class__``), so ``Trainer`` finds the label names (``eval_loss`` in
``evaluate``) and saves with ``save_pretrained`` (``config.json`` included). ``ORTTrainer`` adds
the loss-only training steps below; a checkpoint from either loads into a plain model::

    from ortmodule import ORTModule
    from ortmodule.integrations.hf_trainer import ORTTrainer

    trainer = ORTTrainer(model=ORTModule(model), args=args, train_dataset=data)
    trainer.train()
    trainer.save_model("out")
    plain = type(model).from_pretrained("out")

Training steps run the model's loss alone. ``Trainer``'s own ``compute_loss`` reads nothing but
``outputs["loss"]`` while training (no label smoother, no ``compute_loss_func``), yet a Hugging
Face model given ``labels`` returns its logits too, and logits that leave the model are computed,
forward and backward, on every token. ``ORTTrainer`` runs those steps through a second
``ORTModule`` over the same module whose only output is the loss, so label sparsity shrinks the
head to the labelled tokens (a masked LM, a prompt-masked causal LM). It shares the parameters,
the options and the gradients; evaluation, ``return_outputs=True``, a label smoother or a
``compute_loss_func`` go through the model as given. ``ORTTrainer(..., loss_only=False)``
turns this off.

Importing this module imports ``transformers`` (it is the user's choice to use ``Trainer``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from transformers import Trainer

from ..ortmodule import ORTModule

__all__ = ["ORTTrainer"]

logger = logging.getLogger("ortmodule")


class _LossOf(torch.nn.Module):
    """``{"loss": model(...).loss}``: the one output ``Trainer.compute_loss`` reads in training."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        out = self.model(*args, **kwargs)
        if isinstance(out, Mapping) and "loss" not in out:
            raise ValueError(
                f"ORTTrainer: {type(self.model).__name__} returned no loss (its outputs: "
                f"{', '.join(out)}) although the batch has labels; pass the labels under the "
                "name the model's forward takes, or ORTTrainer(..., loss_only=False) to train "
                "through its outputs as they are"
            )
        return {"loss": out["loss"] if isinstance(out, Mapping) else out[0]}


class ORTTrainer(Trainer):
    """``transformers.Trainer`` that trains an ``ORTModule`` through its loss alone
    (``loss_only``; see the module's text)."""

    def __init__(self, *args: Any, loss_only: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loss_only = loss_only
        #: (the wrapper it was built for, the ORTModule over its loss)
        self._loss_model: tuple[ORTModule, ORTModule] | None = None

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        if (
            self.loss_only
            and isinstance(model, ORTModule)
            and model.training
            and torch.is_grad_enabled()
            and not return_outputs
            and self.label_smoother is None
            and self.compute_loss_func is None
            and "labels" in inputs
        ):
            model = self._loss_of(model)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _loss_of(self, wrapper: ORTModule) -> ORTModule:
        if self._loss_model is None or self._loss_model[0] is not wrapper:
            loss_model = ORTModule(_LossOf(wrapper.module), wrapper._debug_options)
            # attributes written through the user's wrapper (a flag the forward reads) key this
            # graph too: a new value re-exports it as it does the wrapper's own
            loss_model._runner.module_state = wrapper.__dict__.setdefault("_written", {})
            self._loss_model = (wrapper, loss_model)
            logger.info(
                "ORTTrainer: training steps run %s's loss alone (its other outputs are not "
                "returned), so label sparsity can shrink its head; loss_only=False keeps them",
                type(wrapper.module).__name__,
            )
        loss_model = self._loss_model[1]
        loss_model.train(wrapper.training)
        return loss_model
