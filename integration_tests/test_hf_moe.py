"""Hugging Face mixture-of-experts decoders in their default configuration (transformers'
``grouped_mm`` experts: routing sorted by expert, ``torch._grouped_mm`` over per-expert row
offsets) train in the engine equal to eager and generate eager's tokens; fallback is disabled
(conftest), so every step ran in the engine.

``_grouped_mm`` has no ONNX form: it runs in PyTorch inside the engine as an ATen node made a
PythonOp (its gradient is autograd's). Its meta kernel accepts bfloat16 only, which once left
the node untyped and the gradient build failed ("gradient builder has not been registered:
ATen"); the export now records the traced output types on every ATen node.

Training: 3 AdamW steps whose sequence length and padding change each step, fp32 compared with
rtol 1e-4, atol 1e-5 on losses, step-1 gradients and final parameters.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

tf = pytest.importorskip("transformers")

from ortmodule import ORTModule  # noqa: E402
from ortmodule_testing.parity import assert_same_training, clone_model, train_steps  # noqa: E402
from ortmodule_testing.zoo import Batch, ZooCase  # noqa: E402

VOCAB = 128
_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    num_experts_per_tok=2,
)
CONFIGS: dict[str, Any] = {
    "mixtral": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(**_DECODER, num_local_experts=4)),
    "qwen2_moe": lambda: tf.Qwen2MoeForCausalLM(
        tf.Qwen2MoeConfig(
            **_DECODER,
            num_experts=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        )
    ),
}


def _batch(step: int) -> Batch:
    """Two rows of 8, 10, 12 tokens at steps 0, 1, 2; row 1 right-padded to a random length."""
    gen = torch.Generator().manual_seed(30_000 + step)
    seq = 8 + 2 * step
    ids = torch.randint(3, VOCAB, (2, seq), generator=gen)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, int(torch.randint(seq // 2, seq, (1,), generator=gen)) :] = 0
    return (), {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": ids.masked_fill(mask == 0, -100),
    }


def _adamw(params: Any) -> torch.optim.Optimizer:
    # eps 1e-6 as in the Hugging Face zoo tests: analytically zero gradients (attention key
    # biases) are rounding noise in both engines, which eps 1e-8 would turn into random steps
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def _case(name: str) -> ZooCase:
    return ZooCase(f"hf_{name}", CONFIGS[name], _batch, lambda out, a, k: out["loss"])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_moe_with_default_experts_trains_and_generates_like_eager(name: str) -> None:
    case = _case(name)
    model = case.build(seed=0)
    assert model.config._experts_implementation == "grouped_mm"
    eager = train_steps(clone_model(model), case, 3, _adamw)
    wrapped = ORTModule(clone_model(model))
    ours = train_steps(wrapped, case, 3, _adamw)
    assert_same_training(eager=eager, other=ours, rtol=1e-4, atol=1e-5)
    assert wrapped._runner.transitions.builds == 1, wrapped._runner.transitions.history

    # greedy decoding from the trained weights: eval graphs for the prompt and for each token
    trained = wrapped.module.eval()
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    want = trained.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    wrapped.eval()
    got = wrapped.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    # the prompt (empty cache) and the decoding steps (a filled cache): two inference graphs
    assert wrapped._runner.transitions.builds == 3, wrapped._runner.transitions.history
