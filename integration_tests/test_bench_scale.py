"""``python -m benchmarks --scale``: the real-size rows (issue #41), checked at a tiny size.

Nothing here runs a real size (those are benchmarks, not tests): the test checks which worker
processes ``--scale`` starts and with what environment, that the model factories build at a
tiny config, and that the eager-checkpointing mode and the RSS sampler work.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

pytest.importorskip("transformers")

from benchmarks.__main__ import run_scale  # noqa: E402
from benchmarks.models import SCALE_MODELS, WORKLOADS, causal_lm_batch, gpt2_model, llama_model  # noqa: E402
from benchmarks.report import SCALE_MODES, Report  # noqa: E402
from benchmarks.worker import MODES, RssSampler, _wrap, timed_step  # noqa: E402

TINY_GPT2 = {"vocab_size": 97, "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 2}
TINY_LLAMA = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
}


class _Recorder:
    """Stands in for :class:`benchmarks.__main__.Runner`: records the processes it would start."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.calls: list[tuple[str, list[str], dict[str, str]]] = []

    def run(self, label: str, args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
        self.calls.append((label, args, env or {}))
        return {}


def test_scale_starts_one_process_per_mode(tmp_path: Path) -> None:
    runner = _Recorder(tmp_path)
    report = Report(info={}, full=False, command="", load_before=(0.0, 0.0, 0.0))
    run_scale(runner, report, ["gpt2_124m"], list(SCALE_MODES), ["--steps", "1", "2"])  # type: ignore[arg-type]
    assert [key for key in report.runs] == [("gpt2_124m", mode) for mode in SCALE_MODES]
    by_label = {label: (args, env) for label, args, env in runner.calls}
    args, env = by_label["ortmodule (warm: prefilled cache)"]
    assert args[-2:] == ["0", "1"]
    # every process is a worker mode (the rows are report keys)
    assert all(args[args.index("--mode") + 1] in MODES for _, args, _ in runner.calls)
    assert (
        env["ORTMODULE_CACHE_DIR"]
        == by_label["ortmodule (cold, fills the cache)"][1]["ORTMODULE_CACHE_DIR"]
    )
    levels = [
        (env.get("ORTMODULE_MEMORY_OPT_LEVEL"), env.get("ORTMODULE_KERNEL_CHOICE"))
        for _, _, env in runner.calls
    ]
    assert [level for level in levels if level[0]] == [("1", None), ("1", "AUTO"), ("2", None)]
    assert all("--sample-rss" in args for _, args, _ in runner.calls)
    assert by_label["eager-checkpoint"][0][4] == "eager-checkpoint"


def test_scale_is_on_request_only() -> None:
    from benchmarks.models import DEFAULT_MODELS

    assert set(SCALE_MODELS) <= set(WORKLOADS)
    assert not set(SCALE_MODELS) & set(DEFAULT_MODELS)


def test_scale_rejects_unknown_modes() -> None:
    from benchmarks.__main__ import main

    with pytest.raises(SystemExit):
        main(["--scale", "--scale-modes", "ortmodule-level3"])


@pytest.mark.parametrize("make", [lambda: gpt2_model(TINY_GPT2), lambda: llama_model(TINY_LLAMA)])
@pytest.mark.parametrize("mode", ["eager", "eager-checkpoint"])
def test_tiny_models_train_in_eager_and_with_checkpointing(make: Any, mode: str) -> None:
    torch.manual_seed(0)
    base = make()
    model = _wrap(base, mode)
    model.train()
    workload = WORKLOADS["gpt2_124m"]
    batch = causal_lm_batch(97, (2, 8))(0, False)
    optimizer = torch.optim.AdamW(base.parameters(), lr=1e-3)
    _, _, loss = timed_step(model, optimizer, workload, batch)
    assert loss == loss and loss > 0  # finite, not NaN


def test_rss_sampler_sees_the_resident_set() -> None:
    sampler = RssSampler(interval=0.001)
    assert sampler.stop() > 0


def test_the_scale_report_states_the_warm_start_beyond_one_step() -> None:
    report = Report(info={}, full=False, command="", load_before=(0.0, 0.0, 0.0))
    report.runs = {
        ("gpt2_124m", "ortmodule"): {"first_step_s": 9.0, "median_step_s": 4.0},
        ("gpt2_124m", "ortmodule-warm"): {"first_step_s": 5.0},
    }
    (line, _) = report._warm_start_lines("gpt2_124m")
    # 5 / 9 of the first step; beyond the 4 s step, 1 s against 5 s
    assert "56% of the cold one's 9.00 s" in line and "(20%)" in line, line
    del report.runs[("gpt2_124m", "ortmodule-warm")]
    assert report._warm_start_lines("gpt2_124m") == []
