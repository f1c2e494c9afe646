"""More decoder architectures train in the engine equal to eager while the batch size, the
sequence length and the padding change at every step (one graph serves them all: no dimension
is baked). Fallback is disabled (conftest)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from hf_models import SHAPES_ZOO, adamw  # noqa: E402

from ortmodule import ORTModule  # noqa: E402
from ortmodule_testing.parity import assert_same_training, clone_model, train_steps  # noqa: E402

STEPS = 4  # four different (batch, length) pairs


@pytest.mark.parametrize("name", sorted(SHAPES_ZOO))
def test_training_with_changing_shapes_matches_eager(name: str) -> None:
    case = SHAPES_ZOO[name]
    model = case.build(seed=0)
    eager = train_steps(clone_model(model), case, STEPS, adamw)
    wrapped = ORTModule(clone_model(model))
    ours = train_steps(wrapped, case, STEPS, adamw)
    assert_same_training(eager, ours, 1e-4, 1e-5)
    assert wrapped._runner.exports == 1, wrapped._runner.transitions.history
