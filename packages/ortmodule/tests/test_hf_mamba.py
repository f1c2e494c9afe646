"""Hugging Face ``MambaForCausalLM`` (tiny, reference PyTorch kernels: no ``mamba_ssm`` or
``causal_conv1d`` here) trains in the engine equal to eager: 3 AdamW steps, fallback disabled.

Its depthwise causal ``Conv1d`` hit the engine's grouped 1-D ConvGrad bug (issue #36: D's
gradient of layer 1 was off by 0.034 where eager's is -0.034); see
``ortmodule_exporter.passes.grouped_conv_grad``.
"""

from __future__ import annotations

import os

import pytest

tf = pytest.importorskip("transformers")

from hf_models import _model, adamw, causal_lm_batch, model_loss  # noqa: E402

from ortmodule import ORTModule  # noqa: E402
from ortmodule_testing.parity import assert_same_training, clone_model, train_steps  # noqa: E402
from ortmodule_testing.zoo import ZooCase  # noqa: E402

MAMBA = ZooCase(
    "hf_mamba",
    _model(
        tf.MambaForCausalLM,
        tf.MambaConfig,
        hidden_size=64,
        num_hidden_layers=2,
        vocab_size=128,
        state_size=8,
    ),
    causal_lm_batch,
    model_loss,
)


def test_mamba_causal_lm_trains_equal_to_eager() -> None:
    assert os.environ["ORTMODULE_FALLBACK_POLICY"] == "FALLBACK_DISABLE"
    model = MAMBA.build(seed=0)
    eager = train_steps(clone_model(model), MAMBA, 3, adamw)
    wrapped = ORTModule(clone_model(model))
    ours = train_steps(wrapped, MAMBA, 3, adamw)
    assert_same_training(eager=eager, other=ours, rtol=1e-4, atol=1e-5)
    assert wrapped._runner.transitions.builds == 1, wrapped._runner.transitions.history
