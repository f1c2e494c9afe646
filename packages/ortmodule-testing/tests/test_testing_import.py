"""Importing the package pulls in torch and the standard library only."""

from __future__ import annotations

import subprocess
import sys


def test_import_needs_no_pytest_onnx_or_onnxruntime() -> None:
    code = (
        "import sys\n"
        "import ortmodule_testing, ortmodule_testing.zoo, ortmodule_testing.parity\n"
        "import ortmodule_testing.deepspeed_cpu\n"
        "bad = sorted(m for m in ('pytest', 'onnx', 'onnxruntime', 'deepspeed') if m in sys.modules)\n"
        "assert not bad, bad\n"
        "ortmodule_testing.parity.requires_cuda\n"
        "assert 'pytest' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
