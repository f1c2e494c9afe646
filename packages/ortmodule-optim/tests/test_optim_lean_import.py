"""Importing the package loads neither onnxruntime, triton nor DeepSpeed; CPU steps stay off Triton."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import ortmodule_optim.fused_adam as fused_adam
from ortmodule_optim import FusedAdam


def test_import_is_lean():
    code = (
        "import json, sys, torch, ortmodule_optim\n"
        "ortmodule_optim.supported_fp16_optimizers()\n"
        "roots = ('onnxruntime', 'triton', 'deepspeed')\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in roots)\n"
        "print(json.dumps({'heavy': heavy, 'cuda': torch.cuda.is_initialized()}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"heavy": [], "cuda": False}


def test_cpu_step_never_reaches_triton(monkeypatch: pytest.MonkeyPatch):
    def refuse(*args: object) -> bool:
        raise AssertionError("the CPU path must not load Triton")

    monkeypatch.setattr(fused_adam, "_triton_adam_step", refuse)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    FusedAdam([p]).step()
    assert float(p.detach()[0]) < 1.0
