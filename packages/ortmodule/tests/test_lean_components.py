"""Components import their heavy dependencies lazily: a plain model never loads them.

bitsandbytes alone costs 6-15 s at import (it compiles kernels with ``torch.compile``), so a
component that imported it, triton or DeepSpeed while registering would make every first
``ORTModule(...)`` that slow, whether or not the model uses them.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

HEAVY = ("bitsandbytes", "triton", "deepspeed")

_PROGRAM = """
import json, sys
import ortmodule, torch
from ortmodule import ORTModule
from ortmodule_exporter.components import loaded_components

model = ORTModule(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)))
model(torch.randn(5, 4)).sum().backward()
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[1:]))
loaded = {name: c.problem() for name, c in loaded_components().items()}
print(json.dumps({"heavy": heavy, "loaded": loaded}))
"""


def test_a_plain_model_loads_no_heavy_dependency_of_a_component() -> None:
    installed = [name for name in HEAVY if importlib.util.find_spec(name) is not None]
    if not installed:
        pytest.skip(f"none of {HEAVY} is installed, so no component could import one")
    out = subprocess.run(
        [sys.executable, "-c", _PROGRAM, *installed], capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    # the components that use them did register (their checks passed): the test saw them load
    if "bitsandbytes" in installed:
        assert result["loaded"].get("ortmodule-qlora", "missing") is None
    if "triton" in installed:
        assert result["loaded"].get("ortmodule-triton", "missing") is None
