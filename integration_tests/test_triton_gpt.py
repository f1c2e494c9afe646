"""The GPT zoo model trains with Triton-fused subgraphs (the verification route: generated kernels
as PythonOps inside the CPU engine, under Triton's interpreter), losses equal to eager; then again
with ORTMODULE_USE_FLASH_ATTENTION=1 (attention through the flash-attention kernels).

Runs in a subprocess: Triton picks interpreter or GPU mode when it is first imported, and other
tests in the same pytest session may import it (through torch.compile) without the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("ortmodule_triton")

SCRIPT = r"""
import json, os
os.environ["TRITON_INTERPRET"] = "1"
os.environ["ORTMODULE_USE_TRITON"] = "1"
os.environ["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"
import torch
torch.set_num_threads(1)
from ortmodule import ORTModule
from ortmodule_testing.parity import assert_same_training, clone_model, train_steps
from ortmodule_testing.zoo import ZOO
from ortmodule_triton import last_report, verification_mode

case = ZOO["gpt"]
model = case.build(seed=0)
eager = train_steps(clone_model(model), case, steps=2)
with verification_mode():
    wrapped = ORTModule(clone_model(model))
    record = train_steps(wrapped, case, steps=2)
report = last_report()
assert_same_training(eager, record)
os.environ["ORTMODULE_USE_FLASH_ATTENTION"] = "1"
with verification_mode():
    flash = train_steps(ORTModule(clone_model(model)), case, steps=2)
assert_same_training(eager, flash)
print(json.dumps({
    "flash_attention": last_report().attention,
    "flash_losses": flash.losses,
    "route": report.route,
    "subgraphs": len(report.runners),
    "forward_calls": sum(r.calls for r in report.runners),
    "backward_kernels": sum(r._backward is not None for r in report.runners),
    "ops": sorted({n.op_type for r in report.runners for n in r.sub.model.graph.node}),
    "losses": record.losses,
    "eager_losses": eager.losses,
}))
"""


def test_gpt_trains_with_triton_subgraphs_like_eager():
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORTMODULE_")}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["route"] == "verification"
    assert result["subgraphs"] >= 4, result  # per block: residual Add + LayerNorm, GELU chain, ...
    # 2 steps, every fused kernel ran in every forward and every gradient kernel was built
    assert result["forward_calls"] >= 2 * result["subgraphs"], result
    assert result["backward_kernels"] >= 1, result
    assert {"LayerNormalization", "Softmax", "Erf"} <= set(result["ops"]), result
    # ORTMODULE_USE_FLASH_ATTENTION=1: both blocks' attention ran the flash-attention kernels
    assert result["flash_attention"] == 2, result
