"""The benchmark report's interval for an interleaved median ratio and its speed-goal verdicts.

Timing is never asserted; these check the arithmetic that decides whether a run shows a goal
met, missed or not resolved.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import SPEED_GOALS, Report  # noqa: E402
from benchmarks.stats import goal_verdict, median_interval  # noqa: E402


def test_interval_is_the_textbook_order_statistics() -> None:
    # 20 values: the 6th and 15th smallest (95.9%); 5 values cannot reach 95%: whole range
    low, high, coverage = median_interval([float(v) for v in reversed(range(1, 21))])
    assert (low, high) == (6.0, 15.0)
    assert coverage == pytest.approx(0.9586, abs=1e-4)
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0, 0.9375)
    with pytest.raises(ValueError, match="at least one value"):
        median_interval([])


def test_interval_holds_the_median_as_often_as_it_says() -> None:
    # a skewed distribution (lognormal, as step-time ratios on a busy machine are): the
    # interval must hold the true median in at least 95% of 2000 draws of 20 rounds
    rng = random.Random(0)
    true_median = 1.0  # exp(0) for lognormvariate(0, s)
    hits = 0
    for _ in range(2000):
        low, high, _ = median_interval([rng.lognormvariate(0.0, 0.08) for _ in range(20)])
        hits += low <= true_median <= high
    assert hits / 2000 >= 0.945


def test_verdicts_and_the_report_section() -> None:
    assert goal_verdict((0.90, 1.00), 1.0) == "met"
    assert goal_verdict((1.01, 1.10), 1.0) == "missed"
    assert goal_verdict((0.97, 1.04), 1.0) == "not resolved"

    def run(ratio: float, interval: tuple[float, float]) -> dict[str, object]:
        return {
            "rounds": 20,
            "ratio": {"eager": 1.0, "ortmodule": ratio},
            "interval": {"eager": (1.0, 1.0, 0.96), "ortmodule": (*interval, 0.96)},
            "median_step_s": {"eager": 0.2},
            "max_loss_diff": {"ortmodule": 1e-6},
        }

    report = Report(info={}, full=False, command="", load_before=(0.0, 0.0, 0.0))
    report.interleaved = {
        "gpt": run(0.99, (0.95, 1.03)),
        "masked_lm": run(0.55, (0.52, 0.58)),
        "cnn": run(1.08, (1.03, 1.12)),
        "bert_classifier, padding elimination on": run(0.5, (0.45, 0.55)),
    }
    lines = report.goals_section()
    rows = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith("| ")}
    assert f"{SPEED_GOALS['gpt']:.2f}x" in rows["gpt"] and rows["gpt"].endswith("| missed |")
    assert rows["masked_lm"].endswith("| met |")
    assert rows["cnn"].endswith("| missed |") and "1.00x" in rows["cnn"]
    assert "bert_classifier, padding elimination on" not in rows, "only the default models"
    table = report.interleaved_section()
    assert any("0.99x (0.95-1.03)" in line for line in table)
