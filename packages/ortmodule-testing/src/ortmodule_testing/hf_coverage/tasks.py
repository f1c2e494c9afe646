"""The tasks swept, in order, and the batches each trains on.

    for model_type, task in model_types():           # each type once, under its first task
        cls_name = task.class_name(model_type)       # e.g. "LlamaForCausalLM"
        args, kwargs = task.make_batch(0)

A model type listed under several tasks is trained under the first of :data:`TASKS` that lists
it (causal LM, masked LM, seq2seq LM, sequence classification, image classification).
Batches come from a generator seeded by the step index; padding and ignored labels are in
them as in a fine-tuning batch. Token ids stay below :data:`~.shrink.VOCAB`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..zoo.registry import Batch
from .shrink import IMAGE, VOCAB

__all__ = ["TASKS", "Task", "model_types"]

BATCH = 2
SEQ = 12
IGNORE = -100


def _generator(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(30_000 + step)


def _padding_mask(gen: torch.Generator) -> torch.Tensor:
    """Row 0 full, row 1 right-padded to a random length."""
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, int(torch.randint(SEQ // 2, SEQ, (1,), generator=gen)) :] = 0
    return mask


def causal_lm_batch(step: int) -> Batch:
    gen = _generator(step)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    mask = _padding_mask(gen)
    return (), {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": ids.masked_fill(mask == 0, IGNORE),
    }


def masked_lm_batch(step: int) -> Batch:
    gen = _generator(step)
    ids = torch.randint(5, VOCAB, (BATCH, SEQ), generator=gen)
    mask = _padding_mask(gen)
    chosen = (torch.rand(BATCH, SEQ, generator=gen) < 0.3) & (mask == 1)
    chosen[0, 1] = True
    labels = torch.where(chosen, ids, IGNORE)
    return (), {"input_ids": torch.where(chosen, 4, ids), "attention_mask": mask, "labels": labels}


def seq2seq_batch(step: int) -> Batch:
    gen = _generator(step)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(3, VOCAB, (BATCH, SEQ - 4), generator=gen)
    labels[1, -2:] = IGNORE
    return (), {"input_ids": ids, "attention_mask": _padding_mask(gen), "labels": labels}


def classification_batch(step: int) -> Batch:
    gen = _generator(step)
    ids = torch.randint(5, VOCAB, (BATCH, SEQ), generator=gen)
    return (), {
        "input_ids": ids,
        "attention_mask": _padding_mask(gen),
        "labels": torch.randint(0, 2, (BATCH,), generator=gen),
    }


def image_batch(step: int) -> Batch:
    gen = _generator(step)
    return (), {
        "pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen),
        "labels": torch.randint(0, 2, (BATCH,), generator=gen),
    }


@dataclass(frozen=True)
class Task:
    """One auto mapping of ``transformers.models.auto.modeling_auto`` and its batches.

    ``config``: settings the task adds to the shrunk configuration (two labels for the
    classifiers: the batches' labels are 0 or 1).
    """

    name: str
    mapping: str
    make_batch: Callable[[int], Batch]
    config: dict[str, Any] = field(default_factory=dict)

    def class_names(self) -> dict[str, Any]:
        """model type -> class name(s) in this task's mapping."""
        from transformers.models.auto import modeling_auto

        return dict(getattr(modeling_auto, self.mapping))

    def class_name(self, model_type: str) -> str:
        """The model class for ``model_type``; the first where the mapping lists several."""
        names = self.class_names()[model_type]
        return names if isinstance(names, str) else names[0]


_LABELS = {"num_labels": 2}
TASKS: tuple[Task, ...] = (
    Task("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", causal_lm_batch),
    Task("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", masked_lm_batch),
    Task("seq2seq-lm", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", seq2seq_batch),
    Task(
        "sequence-classification",
        "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
        classification_batch,
        _LABELS,
    ),
    Task(
        "image-classification",
        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
        image_batch,
        _LABELS,
    ),
)
TASKS_BY_NAME = {task.name: task for task in TASKS}


def model_types(tasks: tuple[Task, ...] = TASKS) -> list[tuple[str, Task]]:
    """Every model type of ``tasks``' mappings once, with the first task that lists it."""
    seen: dict[str, Task] = {}
    for task in tasks:
        for model_type in task.class_names():
            seen.setdefault(model_type, task)
    return list(seen.items())
