"""ortmodule-zero announces itself to the runtime and stays out of the way without ZeRO-3.

The training parity with DeepSpeed ZeRO stage 3 runs in integration_tests/test_deepspeed_stack.py
(it needs the runtime, the optimizers and gloo processes).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from ortmodule_zero import OPTION, ZeroStage3Hook, zero_parameters

from ortmodule_exporter.components import StepContext, load_components, step_hooks


def test_the_entry_point_registers_the_stage3_hook() -> None:
    found = load_components()
    assert found["ortmodule-zero"].option_names == (OPTION,)
    assert any(isinstance(h, ZeroStage3Hook) for h in step_hooks())


def test_import_does_not_load_deepspeed() -> None:
    code = (
        "import json, sys, ortmodule_zero\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("enabled", [False, True])
def test_plain_parameters_are_left_alone(enabled: bool) -> None:
    module = torch.nn.Linear(3, 2)
    ctx = StepContext(module, {OPTION: enabled})
    hook = ZeroStage3Hook()
    assert zero_parameters(module) == []
    hook.pre_forward(ctx)  # no ZeRO-3 parameters: nothing to gather, no error either way
    with hook.exporting(ctx):
        pass
    hook.post_forward(ctx, (module(torch.randn(1, 3)),))
    hook.post_backward(ctx)
    assert module.weight.shape == (2, 3)


def test_a_stage3_module_is_traced_in_place_not_copied() -> None:
    # Under stage 3 every parameter is gathered to full size for the export: a deep copy held
    # the whole model a second time (measured: +1.1x the parameters' bytes per rank at peak,
    # and still resident after the export). The export must trace the module itself.
    from ortmodule_exporter.export import copy_for_export

    module = torch.nn.Linear(3, 2)
    for p in module.parameters():
        p.ds_status = object()  # type: ignore[attr-defined]  # what marks a ZeRO-3 parameter
    hook = ZeroStage3Hook()
    with hook.exporting(StepContext(module, {OPTION: True})):
        assert copy_for_export(module) is module
    assert copy_for_export(module) is not module  # outside the export: copied as configured


def test_a_plain_module_is_still_copied_for_export() -> None:
    from ortmodule_exporter.export import copy_for_export

    module = torch.nn.Linear(3, 2)
    with ZeroStage3Hook().exporting(StepContext(module, {OPTION: True})):
        assert copy_for_export(module) is not module
