"""FP16_Optimizer: registry, refusal, delegation (no DeepSpeed needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ortmodule_optim import FP16_Optimizer, register_fp16_modifier, supported_fp16_optimizers
from ortmodule_optim.fp16_optimizer import _MODIFIERS


def test_supported_optimizers_are_deepspeeds():
    assert supported_fp16_optimizers() == [
        "deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer",
        "deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer",
        "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer",
    ]


def test_unknown_optimizer_is_refused_with_the_supported_list():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    with pytest.raises(TypeError) as info:
        FP16_Optimizer(opt)
    message = str(info.value)
    assert "does not know torch.optim.sgd.SGD" in message
    for path in supported_fp16_optimizers():
        assert path in message


class LossScaled:
    """Stands in for a third-party mixed-precision optimizer."""

    def __init__(self) -> None:
        self.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.5)
        self.loss_scale = 128.0
        self.steps = 0

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        self.steps += 1
        return "stepped"

    def zero_grad(self, set_to_none=True):
        self.zeroed = set_to_none

    def has_overflow(self, params):
        raise AssertionError("the modifier should have replaced this")


class Engine:
    def __init__(self) -> None:
        self.optimizer = LossScaled()


@pytest.fixture
def registered():
    calls = []

    def modifier(opt):
        calls.append(opt)
        opt.has_overflow = lambda params: False

    register_fp16_modifier(f"{__name__}.LossScaled", modifier)
    yield calls
    del _MODIFIERS[f"{__name__}.LossScaled"]


def test_registered_modifier_runs_once_and_attributes_delegate(registered):
    inner = LossScaled()
    wrapped = FP16_Optimizer(inner)
    again = FP16_Optimizer(inner)
    assert registered == [inner], "a second wrap must not modify twice"
    assert inner.has_overflow([]) is False
    assert wrapped.step() == "stepped" and again.step() == "stepped" and inner.steps == 2
    wrapped.zero_grad(set_to_none=False)
    assert inner.zeroed is False
    assert wrapped.loss_scale == 128.0 and wrapped.wrapped is inner
    wrapped.loss_scale = 64.0
    assert inner.loss_scale == 64.0
    assert wrapped.param_groups is inner.param_groups
    assert "FP16_Optimizer(" in repr(wrapped)


def test_an_engine_is_refused_with_a_hint(registered):
    with pytest.raises(TypeError, match=r"pass that \(Engine.optimizer\) instead"):
        FP16_Optimizer(Engine())


def test_a_registration_for_a_deepspeed_class_wins_over_the_builtin_one():
    # In a fresh process: the built-in modifiers are in the registry from the import on, so a
    # user's registration made before the first FP16_Optimizer is not replaced by them later.
    code = (
        "import ortmodule_optim\n"
        "path = 'deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer'\n"
        "calls = []\n"
        "ortmodule_optim.register_fp16_modifier(path, calls.append)\n"
        "Fake = type('FP16_Optimizer', (), {'__module__': path.rpartition('.')[0]})\n"
        "fake = Fake()\n"
        "ortmodule_optim.FP16_Optimizer(fake)\n"
        "print(calls == [fake])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
