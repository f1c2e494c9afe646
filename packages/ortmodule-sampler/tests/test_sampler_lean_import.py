"""Importing the package loads neither onnxruntime nor triton (nor initializes CUDA)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_import_is_lean():
    code = (
        "import json, sys, ortmodule_sampler, torch\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('onnxruntime', 'triton'))\n"
        "print(json.dumps({'heavy': heavy, 'cuda': torch.cuda.is_initialized()}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"heavy": [], "cuda": False}
