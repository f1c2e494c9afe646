"""Importing ortmodule_pytree costs torch and nothing heavier."""

from __future__ import annotations

import subprocess
import sys

import ortmodule_pytree


def test_import_is_lean() -> None:
    # Only torch and the standard library: no onnx, onnxruntime, triton or the like.
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import ortmodule_pytree\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "extra = sorted(m for m in new if m != 'ortmodule_pytree' and m not in sys.stdlib_module_names)\n"
        "heavy = sorted(m for m in ('onnx', 'onnxruntime', 'triton') if m in sys.modules)\n"
        "print(extra, heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] []", out.stdout + out.stderr
    assert ortmodule_pytree.__version__ == "0.1.0"
