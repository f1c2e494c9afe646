"""The component: discovered through its entry point, registers the pass, imports nothing heavy."""

from __future__ import annotations

import subprocess
import sys

from ortmodule_exporter.components import handled_options, load_components
from ortmodule_exporter.passes.registry import _PASSES
from ortmodule_triton.graph_pass import PASS_NAME
from ortmodule_triton.options import OPTION_NAMES


def test_entry_point_registers_the_pass_and_its_options():
    components = load_components()
    assert "ortmodule-triton" in components
    assert components["ortmodule-triton"].problem() is None  # triton is installed
    assert PASS_NAME in _PASSES
    assert set(OPTION_NAMES) <= handled_options()


def test_import_loads_neither_triton_nor_the_engine():
    code = (
        "import sys, ortmodule_triton, ortmodule_triton.component; "
        "print('triton' in sys.modules, 'onnxruntime' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
