"""``ORTTrainer``: Hugging Face's ``Trainer`` for an ``ORTModule``-wrapped ``PreTrainedModel``.

``Trainer`` trains an ``ORTModule`` as it is (the wrapper has the model's ``forward`` signature,
``config`` and state dict keys), but it saves with ``save_pretrained`` only when the model is a
``PreTrainedModel``: for a wrapper it writes bare weights without ``config.json``, which
``from_pretrained`` cannot load. ``ORTTrainer`` saves the wrapped model instead, so a checkpoint
loads into a plain model::

    from ortmodule import ORTModule
    from ortmodule.integrations.hf_trainer import ORTTrainer

    trainer = ORTTrainer(model=ORTModule(model), args=args, train_dataset=data)
    trainer.train()
    trainer.save_model("out")
    plain = type(model).from_pretrained("out")

Importing this module imports ``transformers`` (it is the user's choice to use ``Trainer``).
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel, Trainer

from ..ortmodule import ORTModule

__all__ = ["ORTTrainer"]


class ORTTrainer(Trainer):
    """``transformers.Trainer`` that saves the model inside an ``ORTModule``."""

    def _save(
        self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None
    ) -> None:
        wrapper: Any = self.model  # type: ignore[has-type]  # transformers leaves it unannotated
        if not (isinstance(wrapper, ORTModule) and isinstance(wrapper.module, PreTrainedModel)):
            super()._save(output_dir, state_dict)
            return
        # the wrapper's state dict is the wrapped model's (same keys, same tensors)
        self.model = wrapper.module
        try:
            super()._save(output_dir, state_dict)
        finally:
            self.model = wrapper
