"""``ortmodule demo``: both runs train, the table is printed, the plot is written, losses match."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from ortmodule.__main__ import main
from ortmodule.demo import CharTokenizer, DemoConfig, ProgressBar, load_corpus, make_batches

TINY = ["--steps", "4", "--batch-size", "4", "--seq-len", "16", "--layers", "1", "--d-model", "32"]


@pytest.mark.slow
def test_demo_trains_both_runs_and_reports_them(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo"
    code = main(["demo", *TINY, "--generate", "12", "--save-onnx", "--out", str(out)])
    stdout, stderr = capfd.readouterr()
    assert code == 0, stdout + stderr

    for row in (
        "final loss",
        "largest per-step loss difference",
        "median step time (fwd+bwd+AdamW)",
        "time to first step",
        "peak RSS of the run's process",
        "RSS growth during training",
    ):
        assert row in stdout, f"{row!r} missing from the table:\n{stdout}"
    assert "PyTorch eager" in stdout and "ORTModule" in stdout
    assert "The losses match" in stdout
    assert "ORTModule ran every step in ONNX Runtime" in stdout
    # the speed line names the ratio and the settings that produced it
    assert "Speed: ORTModule ran" in stdout and "ORTMODULE_FUSED_ATTENTION=" in stdout
    assert "ORTMODULE_KERNEL_CHOICE=" in stdout and "intra-op threads" in stdout
    # not a terminal here: the progress bar prints plain lines
    assert "PyTorch eager: step 4/4" in stderr and "ORTModule: step 4/4" in stderr

    plot = out / "loss_curve.png"
    assert f"Loss curves: {plot}" in stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    results = json.loads((out / "demo_results.json").read_text())
    eager, ort = results["runs"]["eager"], results["runs"]["ortmodule"]
    assert len(eager["losses"]) == len(ort["losses"]) == 4
    assert eager["losses"][-1] < eager["losses"][0]  # it learns
    assert results["losses_match"] and results["max_loss_difference"] < 1e-4
    assert ort["engine_ran"]
    assert set(ort["phases"]) >= {"export", "graph build", "session creation"}
    # the recompute run (ortmodule-memory, level 1) trains to the same losses
    recompute = results["runs"]["recompute"]
    assert len(recompute["losses"]) == 4
    assert max(abs(a - b) for a, b in zip(recompute["losses"], eager["losses"], strict=True)) < 1e-4
    assert "ORTModule + recompute: RSS growth during training" in stdout
    assert (out / "memory_vs_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the ORTModule model wrote text through its inference graph, and saved its ONNX models
    assert len(ort["text"]) == len("The lamp") + 12 and ort["text"] in stdout
    assert ort["onnx_files"] and all(Path(p).exists() for p in ort["onnx_files"])


def test_demo_refuses_a_bad_option_before_training(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--d-model", "30", "--heads", "4"]) == 2
    assert "--d-model (30) must be divisible by --heads (4)" in capsys.readouterr().out


def test_batches_are_windows_of_the_shipped_corpus() -> None:
    text = load_corpus()
    assert 10_000 < len(text.encode()) < 100_000
    tokenizer = CharTokenizer(text)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    config = DemoConfig(steps=3, batch_size=2, seq_len=8)
    batches = make_batches(torch.tensor(ids), config)
    assert tuple(batches.shape) == (3, 2, 9)
    assert tokenizer.decode(batches[0, 0].tolist()) in text


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_redraws_on_a_terminal_and_prints_lines_elsewhere() -> None:
    tty = _Terminal()
    bar = ProgressBar("ORTModule", total=3, stream=tty)
    bar.start("first step: export + graph build")
    for step in range(3):
        bar.update(step + 1, loss=2.0 - step)
    bar.close()
    assert "\r" in tty.getvalue() and "3/3" in tty.getvalue() and "steps/s" in tty.getvalue()

    pipe = io.StringIO()
    bar = ProgressBar("eager", total=20, stream=pipe)
    for step in range(20):
        bar.update(step + 1, loss=1.0)
    bar.close()
    lines = pipe.getvalue().splitlines()
    assert "\r" not in pipe.getvalue()
    assert lines[0].startswith("eager: step 1/20") and lines[-1].startswith("eager: step 20/20")
    assert len(lines) <= 11  # the first step, then every tenth of the run
