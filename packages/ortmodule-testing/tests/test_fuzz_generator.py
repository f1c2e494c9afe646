"""The fuzzer's own tests: programs are valid in eager, their source is the program, the
declared shapes are the real ones, shrinking finds a planted bug, the worker records crashes.

No engine runs here (integration_tests/test_fuzz.py runs programs through ORTModule).
"""

from __future__ import annotations

import dataclasses
import os
import random
import time

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from torch import nn

from ortmodule_testing.fuzz import GenConfig, generate_program, replay
from ortmodule_testing.fuzz.generate import programs
from ortmodule_testing.fuzz.ir import Op
from ortmodule_testing.fuzz.ops import render_op
from ortmodule_testing.fuzz.program import Program
from ortmodule_testing.fuzz.runner import Outcome, build, run_program
from ortmodule_testing.fuzz.shrink import shrink
from ortmodule_testing.fuzz.worker import Worker

EVERYTHING = GenConfig(
    data_dependent=True, linspace_by_shape=True, input_inplace=True, dynamic_loops=True
)


def _eager(module: nn.Module) -> nn.Module:
    return module


def _all_outputs(program: Program) -> Program:
    """The program returning every op's result, so that every declared shape is checked."""
    return dataclasses.replace(
        program, outputs=tuple(op.out for op in program.ops) or program.outputs
    )


@pytest.mark.parametrize("config", [GenConfig(), EVERYTHING], ids=["default", "everything"])
def test_programs_run_in_eager_with_the_declared_shapes(config: GenConfig) -> None:
    for seed in range(40):
        program = _all_outputs(generate_program(seed, config))
        namespace = build(program.to_source())
        records = namespace["train"](namespace["Program"]())
        assert len(records) == program.steps
        for step, (loss, outputs, grads) in enumerate(records):
            assert torch.isfinite(loss), (seed, step, program.to_source())
            for name, out in zip(program.outputs, outputs, strict=True):
                shape = next(op.shape for op in program.ops if op.out == name)
                want = program.concrete_shape(shape, step)
                assert tuple(out.shape) == want, (seed, step, name, program.to_source())
            assert any(g is not None for g in grads.values()), (seed, program.to_source())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(EVERYTHING))
def test_hypothesis_programs_are_valid(program: Program) -> None:
    assert run_program(program, _eager).status == "equal", program.to_source()


def test_same_seed_same_program_and_choices_replay_it() -> None:
    for seed in range(30):
        program = generate_program(seed)
        assert generate_program(seed) == program
        assert replay(program.choices, seed=seed) == program
        assert replay(program.choices, seed=seed).to_source() == program.to_source()


def test_shapes_change_between_steps_and_switches_hold() -> None:
    programs_ = [generate_program(seed) for seed in range(200)]
    assert any(len({dict(s).get("B") for s in p.sizes}) > 1 for p in programs_)
    kinds = {op.kind for p in programs_ for op in p.ops}
    assert {"loop", "matmul", "reduce", "inplace", "create", "conv1d", "gather"} <= kinds
    assert {"data_dependent", "input_inplace", "grad_cut"} <= kinds  # on by default
    off = GenConfig(
        data_dependent=False, input_inplace=False, linspace_by_shape=False, grad_cuts=False
    )
    programs_off = [generate_program(seed, off) for seed in range(200)]
    assert not {op.kind for p in programs_off for op in p.ops} & {
        "data_dependent", "input_inplace", "grad_cut"
    }  # fmt: skip
    sources = [p.to_source() for p in programs_off]
    assert not any(
        "torch.linspace(-1.0, 1.0, t" in s or "linspace(-1.0, 1.0, x" in s for s in sources
    )


def _planted(op: Op) -> list[str]:
    """A wrong 'engine': cumsum is off by one percent, everything else is right."""
    lines = render_op(op)
    if op.kind == "along" and op.attr("fn") == "cumsum":
        lines[-1] += " * 1.01"
    return lines


def _wrong_on_cumsum(program: Program) -> bool:
    return run_program(program, _eager, render=_planted).status == "wrong"


def test_shrinking_finds_the_planted_op() -> None:
    failing = next(
        p
        for p in (generate_program(seed) for seed in range(500))
        if len(p.live_ops()) >= 4 and _wrong_on_cumsum(p)
    )
    small = shrink(failing, _wrong_on_cumsum, budget=300)
    live = small.live_ops()
    assert _wrong_on_cumsum(small)
    # the cumsum, and at most the parameter the loss needs a gradient through
    assert [op.kind for op in live if op.kind != "binary"] == ["along"], small.to_source()
    assert len(live) <= 2, small.to_source()
    assert len(live) < len(failing.live_ops())


def test_hypothesis_shrinks_to_the_planted_op() -> None:
    # a fixed seed: unseeded, the search missed every cumsum in 500 examples once in a while
    small = find(
        programs(),
        _wrong_on_cumsum,
        settings=settings(max_examples=500, database=None, deadline=None),
        random=random.Random(0),
    )
    assert [op.kind for op in small.live_ops() if op.kind != "binary"] == ["along"]


def _crashing() -> tuple[object, tuple[type[BaseException], ...]]:
    def engine(module: nn.Module) -> nn.Module:
        os.abort()

    return engine, ()


def _hanging() -> tuple[object, tuple[type[BaseException], ...]]:
    def engine(module: nn.Module) -> nn.Module:
        time.sleep(60)
        return module

    return engine, ()


def test_worker_records_a_crash_and_a_hang_and_goes_on() -> None:
    program = generate_program(0)
    with Worker(timeout=30, factory=_crashing) as worker:  # type: ignore[arg-type]
        first = worker.run(program)
        assert first.status == "crashed" and "exit code" in first.detail
    with Worker(timeout=3, factory=_hanging) as worker:  # type: ignore[arg-type]
        assert worker.run(program) == Outcome("crashed", "no result after 3 s (killed)")


def test_the_summary_breaks_refusals_down_by_error() -> None:
    import argparse
    import collections

    from ortmodule_testing.fuzz.__main__ import _summary

    summary = _summary(
        argparse.Namespace(seed=7),
        GenConfig(),
        collections.Counter({"equal": 5, "refused": 3}),
        [],
        1.0,
        {
            "GuardError": ([7, 9], "GuardError: float() at line 3 | more"),
            "EngineBuildError": ([11], "EngineBuildError: the engine could not build"),
        },
    )
    rows = [line for line in summary.splitlines() if line.startswith("| Guard")]
    assert rows == ["| GuardError | 2 | 7, 9 | GuardError: float() at line 3 \\| more |"]
    assert "| EngineBuildError | 1 | 11 |" in summary
