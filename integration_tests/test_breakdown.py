"""``python -m benchmarks.breakdown``: eager's and ORTModule's step time sorted by kind of kernel.

Nothing here asserts a speed: the test checks that both sides were measured and sorted, so a
change to the engine profile's format or to the ATen executor's entry point (both of which the
tool reads) fails here instead of printing an empty table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.breakdown import KINDS, kind_of  # noqa: E402


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("aten::mm", "GEMM"),
        ("aten::addmm", "GEMM"),
        ("FusedMatMul", "GEMM"),
        ("Gemm", "GEMM"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
        ("_ortmodule_flash_attention_bshd", "attention"),
        ("aten::convolution_backward", "convolution"),
        ("ConvGrad", "convolution"),
        ("aten::max_pool2d_with_indices", "pooling"),
        ("aten::native_layer_norm_backward", "normalization"),
        ("_ortmodule_layer_norm", "normalization"),
        ("BatchNormalizationGrad", "normalization"),
        ("aten::gelu_backward", "activation"),
        ("_ortmodule_gelu", "activation"),
        ("ReluGrad", "activation"),
        ("aten::threshold_backward", "activation"),
        ("SoftmaxCrossEntropyLossGrad", "loss"),
        ("_ortmodule_cross_entropy_backward", "loss"),
        ("aten::_log_softmax_backward_data", "loss"),
        ("GatherGrad", "embedding"),
        ("embedding_backward", "embedding"),
        ("aten::add_", "other"),
        ("Concat", "other"),
        ("Softmax", "other"),
        ("_ortmodule_row_sum", "other"),
    ],
)
def test_kind_of_sorts_pytorch_and_engine_names(name: str, kind: str) -> None:
    assert kind_of(name) == kind


def test_breakdown_measures_both_modes(tmp_path: Path) -> None:
    out = tmp_path / "breakdown.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.breakdown",
            "--model",
            "mlp_many_small",
            "--steps",
            "3",
            "--warmup",
            "2",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env={**os.environ, "ORTMODULE_FALLBACK_POLICY": "FALLBACK_DISABLE"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    # the engine's Gemm nodes and eager's addmm were both found and sorted as GEMMs
    assert result["kinds_ms"]["eager"]["GEMM"] > 0
    assert result["kinds_ms"]["ortmodule"]["GEMM"] > 0
    assert set(result["kinds_ms"]["ortmodule"]) == set(KINDS)
    # the engine calls were timed, and the run trained the same model in both modes
    assert result["engine_calls_ms"] > 0
    assert result["max_loss_diff"] < 1e-4
    assert 0 < result["arithmetic_floor_ratio"] <= result["best_of_both_ratio"]
    assert "| GEMM |" in proc.stdout
    assert "Floors" in proc.stdout
