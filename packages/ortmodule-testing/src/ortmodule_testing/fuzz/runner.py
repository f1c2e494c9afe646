"""Run one program in eager and under an engine wrapper and compare everything.

    outcome = run_program(program, engine=ortmodule_engine)
    outcome.status  # "equal", "wrong", "refused", "error", "invalid"

The module is built from ``program.to_source()`` twice (same seed, same init); both train for
``program.steps`` steps on the same inputs (SGD between steps, so later steps see updated
parameters, and sizes may change between steps). Loss, every output, every parameter gradient
and the gradient of every input that requires one are compared at each step.

Tolerance: fp32 ``rtol=1e-4`` and ``atol=1e-5 * max(1, max|eager value|)`` per tensor. The
absolute part scales with the tensor's magnitude because a composed program sums and cancels
values: an element near zero that came from cancelling values of size ``m`` carries rounding
error of order ``1e-7 * m`` in either implementation, so a fixed atol would report rounding as
a wrong result. Programs keep values in a sane range (``exp`` reads ``tanh`` of its input,
division divides by ``1 + b*b``). A value outside that tolerance still passes when it is as
close to the program's float64 result as eager's float32 value is, within a factor of 4 (see
:func:`compare`).
"""

from __future__ import annotations

import linecache
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..parity import _tensor_mismatch
from .ir import Op
from .program import Program

__all__ = ["ATOL", "RTOL", "Outcome", "build", "run_program"]

RTOL = 1e-4
ATOL = 1e-5

Engine = Callable[[nn.Module], nn.Module]
#: which exceptions of the engine count as a clear refusal (see :mod:`.engine`)
Refusals = tuple[type[BaseException], ...]


@dataclass(frozen=True)
class Outcome:
    """``status``: equal, wrong (a value differs), refused (the engine raised a clear error),
    error (it raised something else), crashed (the process died; set by the worker), invalid
    (eager itself failed: a generator bug). ``detail`` says what and where."""

    status: str
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status in ("wrong", "error", "crashed", "invalid")

    @property
    def signature(self) -> str:
        """What must stay the same while shrinking: the status, and the exception type."""
        if self.status in ("error", "refused", "invalid"):
            return f"{self.status}:{self.detail.split(':', 1)[0]}"
        return self.status


_counter = 0


def build(source: str) -> dict[str, Any]:
    """Execute a program's source as a module of its own (kept in linecache, so tracebacks and
    ``inspect`` see it) and return its namespace."""
    global _counter
    _counter += 1
    filename = f"<fuzz program {_counter}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict[str, Any] = {"__name__": f"fuzz_program_{_counter}"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace


def run_program(
    program: Program,
    engine: Engine,
    refusals: Refusals = (),
    render: Callable[[Op], list[str]] | None = None,
) -> Outcome:
    """Compare eager with ``engine(module)`` on ``program``; ``render`` renders the engine's
    copy differently (tests plant wrong ops with it)."""
    source = program.to_source()
    try:
        namespace = build(source)
        eager = namespace["train"](namespace["Program"]())
    except Exception as err:
        return Outcome("invalid", _describe(err))
    other_ns = namespace if render is None else build(program.to_source(render))
    try:
        got = other_ns["train"](engine(other_ns["Program"]()))
    except refusals as err:
        return Outcome("refused", _describe(err))
    except Exception as err:
        return Outcome("error", _describe(err, with_trace=True))
    problems = compare(got, eager)
    if problems:
        reference = _float64_reference(namespace)
        if reference is not None:
            problems = compare(got, eager, reference)
    return Outcome("wrong", "\n".join(problems)) if problems else Outcome("equal")


def _float64_reference(namespace: dict[str, Any]) -> list[Any] | None:
    """The program's records in float64 (eager), or None when it does not run so."""
    make_inputs = namespace["make_inputs"]

    def inputs64(step: int) -> tuple[Any, ...]:
        return tuple(
            t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            for t in make_inputs(step)
        )

    namespace["make_inputs"] = inputs64
    try:
        records: list[Any] = namespace["train"](namespace["Program"]().double())
        return records
    except Exception:  # noqa: BLE001 - no reference: the float32 comparison stands
        return None
    finally:
        namespace["make_inputs"] = make_inputs


def compare(got: list[Any], want: list[Any], reference: list[Any] | None = None) -> list[str]:
    """Every difference between two ``train`` records (the second is eager).

    With ``reference`` (the same program in float64), a value also passes when it is as close
    to the reference as eager's own float32 value is, within a factor of 4: a program can be
    ill-conditioned (``sin`` of a value SGD made large), and then two correct float32
    computations differ by more than the fixed tolerance.
    """
    problems = []
    refs = reference if reference is not None else [None] * len(want)
    for step, ((lg, og, gg), (lw, ow, gw), ref) in enumerate(zip(got, want, refs, strict=True)):
        pairs: list[tuple[str, Any, Any, Any]] = [("loss", lg, lw, ref[0] if ref else None)]
        pairs += [
            (f"output[{i}]", o, w, ref[1][i] if ref else None)
            for i, (o, w) in enumerate(zip(og, ow, strict=True))
        ]
        pairs += [
            (f"grad of {name!r}", gg.get(name), g, ref[2].get(name) if ref else None)
            for name, g in gw.items()
        ]
        for what, a, b, r in pairs:
            if a is None or b is None:
                if (a is None) != (b is None):
                    problems.append(
                        f"step {step} {what}: {'None' if a is None else 'a tensor'} vs eager"
                    )
                continue
            mismatch = _tensor_mismatch(a, b, RTOL, ATOL * _scale(b))
            if mismatch and not _as_close_as_eager(a, b, r):
                problems.append(f"step {step} {what}: {mismatch}")
    return problems


def _as_close_as_eager(got: torch.Tensor, eager: torch.Tensor, ref: Any) -> bool:
    """Whether ``got`` is within 4 times eager's own distance from the float64 value."""
    if not isinstance(ref, torch.Tensor) or ref.shape != eager.shape or got.shape != eager.shape:
        return False
    ref = ref.double()
    bound = 4 * (eager.double() - ref).abs() + RTOL * ref.abs() + ATOL * _scale(ref)
    err = (got.double() - ref).abs()
    same_nan = got.isnan() == ref.isnan()
    return bool(same_nan.all() and ((err <= bound) | got.isnan()).all())


def _scale(t: torch.Tensor) -> float:
    finite = t.detach().abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return max(1.0, float(finite.max())) if finite.numel() else 1.0


def _describe(err: BaseException, with_trace: bool = False) -> str:
    first = (str(err).strip().splitlines() or [""])[0][:300]
    text = f"{type(err).__name__}: {first}"
    if with_trace:
        text += "\n" + "".join(traceback.format_exception(err)[-6:])
    return text
