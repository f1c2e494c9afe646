"""The transformers coverage tool: config shrinking, error causes, the report, and one sweep of
two model types end to end (that one needs transformers and ortmodule)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from ortmodule_testing.hf_coverage.report import cause, coverage, render
from ortmodule_testing.hf_coverage.run_one import Result
from ortmodule_testing.hf_coverage.shrink import (
    DROP,
    NotShrinkable,
    shrink_config,
    size_overrides,
)


def test_size_overrides_shrinks_what_is_there_and_nothing_else() -> None:
    settings = {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": None,  # None: the model derives it, so it stays None
        "intermediate_size": 11008,
        "vocab_size": 32000,
        "attention_dropout": 0.1,
        "hidden_act": "silu",
        "pad_token_id": 31999,
        "eos_token_id": [2, 32001],
        "bos_token_id": 1,
        "use_cache": True,  # a bool is not a size
        "layer_types": ["full_attention"] * 32,
    }
    out = size_overrides(settings, layers_before=32)
    assert out == {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 128,
        "attention_dropout": 0.0,
        "pad_token_id": 0,
        "eos_token_id": [2],
        "layer_types": DROP,
    }


def test_size_overrides_turns_off_every_random_drop() -> None:
    # drop path (stochastic depth) and LayerDrop draw random numbers like dropout does: eager's
    # and the engine's draws differ, so FocalNet, BEiT, Data2VecVision and SegFormer (drop path
    # 0.1 by default) trained apart although both trainings were correct
    settings = {
        "hidden_dropout_prob": 0.1,
        "drop_path_rate": 0.1,
        "drop_connect_rate": 0.2,
        "encoder_layerdrop": 0.1,
        "stochastic_depth_prob": 0.1,
        "layer_norm_eps": 1e-5,  # a float that is no probability stays
    }
    assert size_overrides(settings) == {
        "hidden_dropout_prob": 0.0,
        "drop_path_rate": 0.0,
        "drop_connect_rate": 0.0,
        "encoder_layerdrop": 0.0,
        "stochastic_depth_prob": 0.0,
    }


def test_size_overrides_turns_off_per_stage_drop_probabilities() -> None:
    # CvT keeps one drop path rate per stage, (0.0, 0.0, 0.1) by default: left on, its last
    # stage drops different samples in eager and under the engine and the sweep read "wrong"
    settings = {"drop_path_rate": (0.0, 0.0, 0.1), "attention_drop_rate": [0.1, 0.2],
                "embed_dim": (64, 192, 384)}  # fmt: skip
    assert size_overrides(settings) == {
        "drop_path_rate": (0.0, 0.0, 0.0),
        "attention_drop_rate": [0.0, 0.0],
    }


def test_size_overrides_distilbert_names_and_stage_lists() -> None:
    out = size_overrides({"dim": 768, "hidden_dim": 3072, "depths": [3, 4, 6, 3],
                          "hidden_sizes": [256, 512, 1024, 2048], "num_heads": [3, 6, 12, 24]})  # fmt: skip
    assert out == {
        "dim": 64,
        "hidden_dim": 128,
        "depths": [1, 1, 1, 1],
        "hidden_sizes": [16, 32, 64, 128],
        "num_heads": [2, 2, 2, 2],
    }


def test_size_overrides_mamba2_heads_split_the_expanded_width() -> None:
    # Mamba-2 checks num_heads * head_dim == expand * hidden_size, and n_groups divides num_heads
    out = size_overrides({"hidden_size": 4096, "expand": 2, "num_heads": 128, "head_dim": 64,
                          "n_groups": 8, "chunk_size": 256})  # fmt: skip
    assert out == {
        "hidden_size": 64,
        "num_heads": 4,
        "head_dim": 32,
        "n_groups": 2,
        "chunk_size": 8,
    }
    assert out["num_heads"] * out["head_dim"] == 2 * out["hidden_size"]
    assert "chunk_size" not in size_overrides({"chunk_size": 16})  # not a Mamba-2 scan


def test_size_overrides_hybrid_mamba_heads_derive_their_width() -> None:
    # Bamba-style: mamba_d_head was derived ("auto") from 128 heads; it is derived again
    out = size_overrides({"hidden_size": 4096, "mamba_n_heads": 128, "mamba_d_head": 64,
                          "mamba_d_ssm": 1024, "mamba_chunk_size": 256})  # fmt: skip
    assert out == {"hidden_size": 64, "mamba_n_heads": 4, "mamba_d_head": DROP,
                   "mamba_d_ssm": 128, "mamba_chunk_size": 8}  # fmt: skip


class _Config:
    """A configuration shaped like transformers' (attributes, to_dict, model_type, a per-layer
    list derived in __init__, a nested configuration)."""

    model_type = "fake"

    def __init__(self, hidden_size: int = 512, num_hidden_layers: int = 12,
                 hidden_dropout: float = 0.1, text_config: Any = None, **kwargs: Any) -> None:  # fmt: skip
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.hidden_dropout = hidden_dropout
        self.layer_types = kwargs.pop("layer_types", None) or ["full"] * num_hidden_layers
        self.text_config = _Text(**(text_config or {}))
        for k, v in kwargs.items():
            setattr(self, k, v)

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class _Text(_Config):
    model_type = "fake_text"

    def __init__(self, vocab_size: int = 30000, **kwargs: Any) -> None:
        self.vocab_size = vocab_size
        self.d_model = kwargs.pop("d_model", 256)
        self.n_layer = kwargs.pop("n_layer", 6)
        self.layer_types = kwargs.pop("layer_types", None) or ["x"] * self.n_layer


def test_shrink_config_rebuilds_derived_lists_and_nested_configs() -> None:
    config = shrink_config(_Config, num_labels=2)
    assert (config.hidden_size, config.num_hidden_layers, config.hidden_dropout) == (64, 2, 0.0)
    assert config.layer_types == ["full", "full"]  # derived again from the new depth
    assert config.num_labels == 2
    text = config.text_config
    assert (text.vocab_size, text.d_model, text.n_layer, text.layer_types) == (
        128,
        64,
        2,
        ["x"] * 2,
    )


def test_shrink_config_without_defaults_is_not_shrinkable() -> None:
    class NeedsParts:
        def __init__(self, encoder: Any) -> None:
            pass

    with pytest.raises(NotShrinkable, match=r"NeedsParts\(\) needs arguments: TypeError"):
        shrink_config(NeedsParts)


def test_cause_blanks_what_varies_between_model_types() -> None:
    a = cause("RuntimeError: shape '[2, 12, 64]' is invalid for input of size 3072")
    b = cause("RuntimeError: shape '[2, 12, 32]' is invalid for input of size 1536")
    assert a == b == "RuntimeError: shape '[N, N, N]' is invalid for input of size N"
    assert cause("at transformers.models.gpt2.modeling_gpt2.GPT2Attention") == "at <Model>"
    assert cause("KeyError: 'model.layers.0.mlp.weight' in LlamaForCausalLM", "llama") == (
        "KeyError: '<name>' in <Model>"
    )
    assert cause(
        "EngineBuildError: at operator Where in model.layers.0.self_attn: /src/x.cc:12 in f(pybind11::)"
    ) == ("EngineBuildError: at operator Where in <module>: <file>")


def _result(model_type: str, status: str, error: str = "") -> Result:
    return Result(model_type, "causal-lm", f"{model_type.title()}ForCausalLM", status, error)


def test_report_counts_groups_and_lists_every_type() -> None:
    results = [
        _result("llama", "parity"),
        _result("gpt2", "parity"),
        _result("opt", "engine-error", "ORTModuleError: aten::foo has no symbolic (2 uses)"),
        _result("bloom", "engine-error", "ORTModuleError: aten::foo has no symbolic (5 uses)"),
        _result("swin", "eager-error", "RuntimeError: size mismatch"),
        _result("vision-encoder-decoder", "not-built", "NotShrinkable: needs arguments"),
    ]
    assert coverage(results) == (2, 4)
    text = render(results, total_types=10, date="2026-11-26", machine="a test machine")
    assert "**2 / 4 = 50.0 %**" in text
    assert "6 of the 10 model types" in text
    assert "Measured 2026-11-26 on a test machine." in text
    # one row for the two engine errors that differ only in a number
    assert "| 2 | `ORTModuleError: aten::foo has no symbolic (N uses)` | `bloom`, `opt` |" in text
    for model_type in ("llama", "gpt2", "opt", "bloom", "swin", "vision-encoder-decoder"):
        assert f"| `{model_type}` |" in text


_HAVE_STACK = all(importlib.util.find_spec(m) for m in ("transformers", "ortmodule"))


@pytest.mark.slow
@pytest.mark.skipif(not _HAVE_STACK, reason="needs transformers and ortmodule")
def test_sweep_two_model_types_end_to_end(tmp_path: Path) -> None:
    """gpt2 and bert train with parity (both are in the Hugging Face zoo tests), in a child
    process; the report and the results file say so."""
    from ortmodule_testing.hf_coverage.__main__ import load, main

    out = tmp_path / "models.md"
    argv = ["--out", str(out), "--only", "gpt2", "bert", "--date", "2026-11-26", "--timeout", "600"]
    assert main(argv) == 0
    results = load(out.with_suffix(".jsonl"))
    assert {t: (r.task, r.status) for t, r in results.items()} == {
        "gpt2": ("causal-lm", "parity"),
        "bert": ("causal-lm", "parity"),
    }, {t: r.error for t, r in results.items()}
    assert "**2 / 2 = 100.0 %**" in out.read_text()


class _Sampling(torch.nn.Module):
    """Draws from the global generator in training, as phimoe's router does."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        noise = torch.rand(3)
        return {"loss": (self.weight * x * noise).sum()}


def test_eager_and_engine_runs_draw_the_same_random_numbers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each training run starts from one random state: the engine's run does not see what the
    eager run left (phimoe's 'parity' or 'wrong' depended on it)."""
    from ortmodule_testing.hf_coverage import run_one
    from ortmodule_testing.hf_coverage.tasks import Task

    monkeypatch.setattr(run_one, "build_model", lambda model_type, task: _Sampling())
    task = Task("sampling", "unused", lambda step: ((torch.ones(3),), {}))
    monkeypatch.setattr(Task, "class_name", lambda self, model_type: "_Sampling")
    result = run_one.run_model_type("sampling", task, engine=lambda model: model)
    assert (result.status, result.detail) == ("parity", ""), result.error
