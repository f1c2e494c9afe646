"""Hugging Face models train in the engine unchanged: per-step losses, step-1 gradients and every
final parameter equal eager after 5 AdamW steps; eval/no_grad outputs (caches included) too.
Fallback is disabled (conftest), so every step ran in the engine."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import HF_ZOO, adamw, causal_lm_batch  # noqa: E402

from ortmodule import ORTModule  # noqa: E402
from ortmodule_pytree import flatten  # noqa: E402
from ortmodule_testing.parity import (  # noqa: E402
    assert_same_training,
    clone_model,
    eval_outputs,
    train_steps,
)

STEPS = 5
RTOL, ATOL = 1e-4, 1e-5


def _sizes_as_ints(outputs: Any) -> Any:
    """A sliding-window cache layer counts tokens in ``cumulative_length``, a Python int in eager
    that the exporter traces as a 0-d tensor (it is ``+= key.shape[-2]``); the engine then
    hands it back as a tensor of the same value. Known difference: compare it as an int."""
    for out in outputs:
        cache = out.get("past_key_values") if hasattr(out, "get") else None
        for layer in getattr(cache, "layers", ()):
            value = getattr(layer, "cumulative_length", None)
            if isinstance(value, torch.Tensor):
                assert value.dim() == 0 and not value.is_floating_point()
                layer.cumulative_length = int(value)
    return outputs


def assert_outputs_close(got: Any, want: Any) -> None:
    """Same structure (cache objects included, via the pytree ORTModule uses), close tensors."""
    got = _sizes_as_ints(got)
    got_tensors, got_schema = flatten(got, prefix="output")
    want_tensors, want_schema = flatten(want, prefix="output")
    assert got_schema.names == want_schema.names
    assert repr(got_schema) == repr(want_schema)
    for name, a, b in zip(want_schema.names, got_tensors, want_tensors, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("name", sorted(HF_ZOO))
def test_hf_training_matches_eager(name: str) -> None:
    case = HF_ZOO[name]
    model = case.build(seed=0)
    eager = train_steps(clone_model(model), case, STEPS, adamw)
    wrapped = ORTModule(clone_model(model))
    ours = train_steps(wrapped, case, STEPS, adamw)
    assert_same_training(eager=eager, other=ours, rtol=RTOL, atol=ATOL)
    assert wrapped._runner.transitions.builds == 1, wrapped._runner.transitions.history
    # eval + no_grad from the trained weights: an inference graph, outputs equal eager's
    assert_outputs_close(
        eval_outputs(wrapped, case, steps=1), eval_outputs(wrapped.module, case, steps=1)
    )


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
    # the prompt (empty cache) and the decoding steps (a filled cache): two inference graphs
    assert wrapped._runner.transitions.builds == 2, wrapped._runner.transitions.history
