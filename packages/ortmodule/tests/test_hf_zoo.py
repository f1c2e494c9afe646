"""Hugging Face models beyond the training each architecture gets in test_hf_architectures.py:
a cache output that carries gradients, a batch without attention mask or cache, both attention
implementations, generate in eval mode. Fallback is disabled (conftest)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import HF_ZOO, adamw, assert_outputs_close, causal_lm_batch  # noqa: E402

from ortmodule import ORTModule  # noqa: E402
from ortmodule_testing.parity import assert_same_training, clone_model, train_steps  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5


def test_cache_output_is_a_dynamic_cache_whose_tensors_carry_gradients() -> None:
    from transformers.cache_utils import DynamicCache

    case = HF_ZOO["llama"]
    model = case.build(seed=0)
    eager, wrapped = clone_model(model), ORTModule(clone_model(model))
    _, kwargs = case.make_batch(0)
    outs = []
    for m in (eager, wrapped):
        out = m(**kwargs)
        cache = out["past_key_values"]
        assert type(cache) is DynamicCache
        # a loss that reads the cache: its gradient must reach the k/v projections
        (out["loss"] + cache.layers[1].keys.square().mean()).backward()
        outs.append(out)
    assert_outputs_close(outs[1]["past_key_values"], outs[0]["past_key_values"])
    assert outs[1]["past_key_values"].get_seq_length() == kwargs["input_ids"].shape[1]
    for (name, p), q in zip(eager.named_parameters(), wrapped.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL, msg=name)


def test_pretraining_batch_without_attention_mask_and_without_cache() -> None:
    # no attention mask and use_cache=False: transformers looks for packed sequences in the
    # position ids with a bool cumsum, which must export as a valid int64 CumSum
    case = HF_ZOO["llama"]
    model = case.build(seed=0)
    _, kwargs = causal_lm_batch(0)
    batch = {"input_ids": kwargs["input_ids"], "labels": kwargs["input_ids"], "use_cache": False}
    eager, wrapped = clone_model(model), ORTModule(clone_model(model))
    want, got = eager(**batch), wrapped(**batch)
    assert "past_key_values" not in got and "past_key_values" not in want
    torch.testing.assert_close(got["loss"], want["loss"], rtol=RTOL, atol=ATOL)
    want["loss"].backward()
    got["loss"].backward()
    for (name, p), q in zip(eager.named_parameters(), wrapped.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_attention_implementations_match_eager(attn: str) -> None:
    case = HF_ZOO["qwen2"]
    model = case.build(seed=0)
    model.set_attn_implementation(attn)
    assert model.config._attn_implementation == attn
    eager = train_steps(clone_model(model), case, 2, adamw)
    ours = train_steps(ORTModule(clone_model(model)), case, 2, adamw)
    assert_same_training(eager=eager, other=ours, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_generate_in_eval_mode_runs_the_engine_and_matches_eager(name: str) -> None:
    model = HF_ZOO[name].build(seed=0).eval()
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    want = model.generate(ids, max_new_tokens=4, do_sample=False)
    wrapped = ORTModule(model)
    got = wrapped.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)
    # the prompt (empty cache) and the decoding steps (a filled cache): two inference graphs,
    # and for T5 a third for its first decoding step, whose cache holds one position (a dim of
    # size 1 stays a fixed 1 in a graph)
    want_builds = 3 if name == "t5" else 2
    assert wrapped._runner.transitions.builds == want_builds, wrapped._runner.transitions.history
