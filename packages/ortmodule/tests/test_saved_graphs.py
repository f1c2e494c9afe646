"""DebugOptions(save_onnx=True): every graph's files are kept, and the one the engine runs is there.

Issue #13 item 6 (a re-export overwrote the files of the earlier graph) and issue #20 B5 (the
execution model was missing).
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import torch

from ortmodule import DebugOptions, ORTModule


def test_each_graph_keeps_its_files_and_the_execution_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    model = ORTModule(
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)),
        DebugOptions(save_onnx=True, onnx_prefix="mlp"),
    )
    model(torch.randn(3, 4)).sum().backward()
    model(torch.randn(3, 5, 4)).sum().backward()  # a new rank: a second training graph
    with torch.no_grad():
        model(torch.randn(3, 4))  # an inference graph
    names = sorted(p.name for p in tmp_path.iterdir())
    stages = ["1_exported", "2_pre_gradient", "3_gradient", "4_execution"]
    expected = [f"mlp_training_v{v}_{s}.onnx" for v in (1, 2) for s in stages]
    # an inference graph has no pre-gradient stage
    expected += [f"mlp_training_v3_{s}.onnx" for s in ("1_exported", "3_built", "4_execution")]
    assert names == sorted(expected)
    first = onnx.load(str(tmp_path / "mlp_training_v1_1_exported.onnx"))
    second = onnx.load(str(tmp_path / "mlp_training_v2_1_exported.onnx"))
    rank = [
        len(vi.type.tensor_type.shape.dim) for vi in (first.graph.input[0], second.graph.input[0])
    ]
    assert rank == [2, 3]
    # the execution model is the gradient graph after the session's optimisations
    execution = onnx.load(str(tmp_path / "mlp_training_v1_4_execution.onnx"))
    gradient = onnx.load(str(tmp_path / "mlp_training_v1_3_gradient.onnx"))
    assert [o.name for o in execution.graph.output] == [o.name for o in gradient.graph.output]


def test_a_new_run_does_not_overwrite_an_earlier_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", str(tmp_path))
    for _ in range(2):
        model = ORTModule(torch.nn.Linear(4, 2), DebugOptions(save_onnx=True, onnx_prefix="lin"))
        model(torch.randn(3, 4)).sum().backward()
    assert (tmp_path / "lin_training_v1_1_exported.onnx").exists()
    assert (tmp_path / "lin_training_v2_1_exported.onnx").exists()
