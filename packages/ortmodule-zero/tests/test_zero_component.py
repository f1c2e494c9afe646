"""ortmodule-zero announces itself to the runtime and stays out of the way without ZeRO-3.

The training parity with DeepSpeed ZeRO stage 3 runs in integration_tests/test_deepspeed_stack.py
(it needs the runtime, the optimizers and gloo processes).
"""

from __future__ import annotations

import json
import subprocess
import sys
import types

import onnx
import pytest
import torch
from ortmodule_zero import OPTION, ZeroStage3Hook, zero_parameters

from ortmodule_exporter.components import (
    SessionContext,
    StepContext,
    load_components,
    session_contribution,
    step_hooks,
)


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


class _Gathered:
    """A ZeRO-3 parameter status that needs no gather (DeepSpeed's ``ZeroParamStatus``)."""

    name = "AVAILABLE"


def _session_context(device: str) -> SessionContext:
    return SessionContext(
        model=onnx.ModelProto(), training=True, device=torch.device(device), options={}
    )


def test_sessions_built_inside_a_stage3_step_go_without_the_cpu_arena(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The arena keeps a step's peak of engine buffers between steps; at 360M parameters on 2
    # ranks a rank was killed at 12.2 GiB with it and peaked at 11314 MiB without.
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    stage3, plain = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    for p in stage3.parameters():
        p.ds_status = _Gathered()  # type: ignore[attr-defined]
    hook = ZeroStage3Hook()
    cpu = _session_context("cpu")
    assert hook.session_contribution(cpu) is None  # no step under way

    hook.pre_forward(StepContext(plain, {OPTION: True}))
    assert hook.session_contribution(cpu) is None  # a plain module's step keeps the arena
    hook.post_forward(StepContext(plain, {OPTION: True}), ())

    ctx = StepContext(stage3, {OPTION: True})
    hook.pre_forward(ctx)
    got = hook.session_contribution(cpu)
    assert got is not None and got.release_cpu_memory and not got.config_entries
    assert hook.session_contribution(_session_context("meta")) is None  # CPU only
    hook.post_forward(ctx, ())
    assert hook.session_contribution(cpu) is None


def test_the_registered_hook_contributes_to_every_session(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    load_components()
    (hook,) = [h for h in step_hooks() if isinstance(h, ZeroStage3Hook)]
    module = torch.nn.Linear(3, 2)
    for p in module.parameters():
        p.ds_status = _Gathered()  # type: ignore[attr-defined]
    ctx = StepContext(module, {OPTION: True})
    assert not session_contribution(_session_context("cpu")).release_cpu_memory
    hook.pre_forward(ctx)
    try:
        assert session_contribution(_session_context("cpu")).release_cpu_memory
    finally:
        hook.post_forward(ctx, ())


def test_sessions_built_inside_a_stage12_step_go_without_the_cpu_arena(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # ZeRO-2 at 368M on 2 ranks: the rank's peak 9346 MiB with the arena, 8257 without it
    # (eager 7950), steps no slower
    from ortmodule_zero.partitioned_optimizer import (
        ZeroOptimizerSessions,
        linked_to_zero_optimizer,
    )

    linked, plain = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    for p in linked.parameters():
        p._hp_mapping = None  # type: ignore[attr-defined]  # another rank's partition holds it
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    assert not linked_to_zero_optimizer(linked)  # without DeepSpeed imported: never asked
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    assert linked_to_zero_optimizer(linked) and not linked_to_zero_optimizer(plain)
    hook, cpu = ZeroOptimizerSessions(), _session_context("cpu")
    hook.pre_forward(StepContext(plain, {}))
    assert hook.session_contribution(cpu) is None
    hook.post_forward(StepContext(plain, {}), ())
    hook.pre_forward(StepContext(linked, {}))
    got = hook.session_contribution(cpu)
    assert got is not None and got.release_cpu_memory
    assert hook.session_contribution(_session_context("meta")) is None
    hook.post_forward(StepContext(linked, {}), ())
    assert hook.session_contribution(cpu) is None
    load_components()
    assert any(isinstance(h, ZeroOptimizerSessions) for h in step_hooks())
