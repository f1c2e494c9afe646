"""The oracle harness: train or evaluate the same model twice and compare against PyTorch eager.

    case = ZOO["gpt"]
    model = case.build(seed=0)
    eager = train_steps(clone_model(model), case, steps=3)
    other = train_steps(ORTModule(clone_model(model)), case, steps=3)
    assert_same_training(eager, other, *case.tolerance)

    assert_tree_close(eval_outputs(ORTModule(clone_model(model)), case),
                      eval_outputs(clone_model(model), case), *case.tolerance)

Failures name the thing that differs (``grad of 'blocks.0.attn.qkv.weight' after step 1``,
``output[0]['logits']``) with the largest absolute and relative errors. The second argument is
always the reference (eager): tolerances are relative to it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from ortmodule_testing.zoo.registry import ZooCase

__all__ = [
    "TrainRecord",
    "against_float64",
    "float64_case",
    "assert_same_mixed_precision_training",
    "assert_same_training",
    "assert_tree_close",
    "clone_model",
    "eval_outputs",
    "train_steps",
]

M = TypeVar("M", bound=nn.Module)
OptimizerFactory = Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]

RTOL = 1e-4
ATOL = 1e-5
# A failure lists every difference up to this many, then counts the rest.
MAX_REPORTED = 20


def clone_model(model: M) -> M:
    """An independent deep copy: same parameters, buffers and training mode."""
    return copy.deepcopy(model)


@dataclass(frozen=True)
class TrainRecord:
    """What :func:`train_steps` saw.

    ``losses``: the loss of each optimizer step (the sum of its micro-batch losses).
    ``first_step_grads``: every named parameter's ``.grad`` just before the first optimizer
    step, cloned; ``None`` where the parameter got no gradient.
    ``final_state``: ``state_dict()`` after the last step, cloned (parameters and buffers).
    """

    losses: list[float]
    first_step_grads: dict[str, torch.Tensor | None]
    final_state: dict[str, torch.Tensor]


def _adamw(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def train_steps(
    model: nn.Module,
    case: ZooCase,
    steps: int,
    make_optimizer: OptimizerFactory = _adamw,
    grad_accum: int = 1,
    forward_context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> TrainRecord:
    """Train ``model`` in train mode for ``steps`` optimizer steps on ``case``'s batches.

    Optimizer step ``s`` runs ``grad_accum`` forward/backward passes on batches
    ``s * grad_accum + i``, each with ``loss / grad_accum``. ``model`` is trained in place.
    Each forward and loss runs inside ``forward_context()`` (backward outside it, as with
    ``torch.autocast``).

        record = train_steps(clone_model(model), ZOO["mlp"], steps=3, grad_accum=2)
        record = train_steps(model, case, 3, forward_context=lambda: torch.autocast("cpu"))
    """
    if steps < 1:
        raise ValueError(f"train_steps needs steps >= 1, got {steps}")
    if grad_accum < 1:
        raise ValueError(f"train_steps needs grad_accum >= 1, got {grad_accum}")
    model.train()
    optimizer = make_optimizer(model.parameters())
    losses: list[float] = []
    first_step_grads: dict[str, torch.Tensor | None] = {}
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for micro in range(grad_accum):
            args, kwargs = case.make_batch(step * grad_accum + micro)
            with forward_context():
                loss = case.loss_fn(model(*args, **kwargs), args, kwargs) / grad_accum
            loss.backward()  # type: ignore[no-untyped-call]
            step_loss += float(loss.detach())
        losses.append(step_loss)
        if step == 0:
            first_step_grads = {
                name: None if p.grad is None else p.grad.detach().clone()
                for name, p in model.named_parameters()
            }
        optimizer.step()
    final_state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    return TrainRecord(losses, first_step_grads, final_state)


def eval_outputs(model: nn.Module, case: ZooCase, steps: int = 2) -> list[Any]:
    """``model``'s outputs on batches ``0 .. steps-1`` under ``eval()`` and ``no_grad``, copied.

    The model's training mode is restored afterwards.
    """
    was_training = model.training
    model.eval()
    try:
        outputs = []
        with torch.no_grad():
            for step in range(steps):
                args, kwargs = case.make_batch(step)
                # Copied so that an engine reusing its output buffers cannot change them later.
                outputs.append(_detached_copy(model(*args, **kwargs)))
        return outputs
    finally:
        model.train(was_training)


def assert_same_training(
    eager: TrainRecord,
    other: TrainRecord,
    rtol: float = RTOL,
    atol: float = ATOL,
    *,
    check_buffers: bool = True,
) -> None:
    """Raise ``AssertionError`` listing every loss, first-step gradient and final parameter of
    ``other`` that is not within ``atol + rtol * |eager|`` of ``eager``.

    Gradients must be ``None`` for the same parameters. Integer tensors (such as BatchNorm's
    ``num_batches_tracked``) must match exactly. ``check_buffers=False`` compares only the
    parameters of the final state.
    """
    problems: list[str] = []
    if len(eager.losses) != len(other.losses):
        problems.append(f"{len(other.losses)} losses recorded vs {len(eager.losses)} in eager")
    for step, (got, want) in enumerate(zip(other.losses, eager.losses, strict=False)):
        if not _scalars_close(got, want, rtol, atol):
            problems.append(
                f"loss at step {step}: {got!r} vs eager {want!r} "
                f"(abs err {abs(got - want):.3g}, rel err {_rel(got, want):.3g})"
            )

    problems += _key_problems("gradients", other.first_step_grads, eager.first_step_grads)
    for name, want_grad in eager.first_step_grads.items():
        if name not in other.first_step_grads:
            continue
        got_grad = other.first_step_grads[name]
        where = f"grad of {name!r} after step 1"
        if want_grad is None or got_grad is None:
            if (want_grad is None) != (got_grad is None):
                got_kind = "None" if got_grad is None else "a tensor"
                want_kind = "None" if want_grad is None else "a tensor"
                problems.append(f"{where}: {got_kind} vs {want_kind} in eager")
            continue
        mismatch = _tensor_mismatch(got_grad, want_grad, rtol, atol)
        if mismatch:
            problems.append(f"{where}: {mismatch}")

    def selected(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if check_buffers:
            return state
        return {k: v for k, v in state.items() if k in eager.first_step_grads}

    got_state, want_state = selected(other.final_state), selected(eager.final_state)
    problems += _key_problems("final state", got_state, want_state)
    for name, want_value in want_state.items():
        if name in got_state:
            mismatch = _tensor_mismatch(got_state[name], want_value, rtol, atol)
            if mismatch:
                problems.append(f"final {name!r}: {mismatch}")

    if problems:
        raise AssertionError(
            _report(f"training differs from eager (rtol={rtol}, atol={atol})", problems)
        )


#: Mixed-precision parity (docs/mixed_precision.md). Each gradient within GRAD_RTOL of its
#: tensor's largest element: 8 units in the last place of a bfloat16 number (2**-8 apart), room
#: for a few roundings that land differently where the engine sums in another order; eager alone
#: moves LayerNorm weight gradients by 1.1 % of their largest element between 1 and 2 threads
#: (PyTorch's bfloat16 LayerNorm backward, measured 2026-11-26). A gradient that is analytically
#: zero (an attention key bias: softmax ignores a per-query shift) holds rounding noise only, so
#: a tensor's scale is at least GRAD_FLOOR of the model's largest gradient.
GRAD_RTOL = 2**-5
GRAD_FLOOR = 1e-3
LOSS_RTOL = 1e-3


def float64_case(case: ZooCase) -> ZooCase:
    """``case`` with its batches' floating-point tensors in float64 (for a float64 model)."""

    def double(value: Any) -> Any:
        is_float = isinstance(value, torch.Tensor) and value.is_floating_point()
        return value.double() if is_float else value

    def batch64(step: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, kwargs = case.make_batch(step)
        return tuple(double(a) for a in args), {k: double(v) for k, v in kwargs.items()}

    return ZooCase(case.name, case.make_model, batch64, case.loss_fn, case.tolerance)


def against_float64(
    eager: TrainRecord, other: TrainRecord, reference: TrainRecord, factor: float = 4.0
) -> list[str]:
    """Every value of ``other`` farther from ``reference`` (the same training in float64) than
    ``factor`` times eager's own float32 distance from it plus the float32 tolerance (rtol
    1e-4 of the tensor's largest value, atol 1e-5), tensor by tensor. Losses, first-step
    gradients and final floating-point state.

    For a training that :func:`assert_same_training` finds apart: AdamW divides each gradient
    element by its own size, so an element whose gradient is rounding-level moves by up to
    ``lr`` a step in either engine, and after a few steps two correct float32 trainings differ
    by more than any fixed tolerance in a few elements. A wrong gradient is still far from
    float64 where eager is close.
    """
    problems: list[str] = []

    def check(what: str, got: Any, want: Any, ref: Any) -> None:
        # a Python float (a loss) must not pass through float32 on its way
        got, want, ref = (
            torch.as_tensor(v, dtype=torch.float64).detach() for v in (got, want, ref)
        )
        if got.shape != ref.shape or want.shape != ref.shape:
            problems.append(f"{what}: shape {tuple(got.shape)} vs {tuple(ref.shape)} in float64")
            return
        if not torch.equal(got.isnan(), ref.isnan()):
            problems.append(f"{what}: NaN where float64 has none, or the reverse")
            return
        got, want, ref = (t.nan_to_num(0.0) for t in (got, want, ref))
        # the float32 tolerance, against float64 instead of eager (as the fuzzer's runner)
        floor = RTOL * float(ref.abs().max()) + ATOL if ref.numel() else 0.0
        err = float((got - ref).abs().max()) if ref.numel() else 0.0
        eager_err = float((want - ref).abs().max()) if ref.numel() else 0.0
        if err > factor * eager_err + floor:
            problems.append(
                f"{what}: {err:.3g} from float64, eager float32 {eager_err:.3g} (x{factor:g} allowed)"
            )

    for step, (loss, eager_loss, ref_loss) in enumerate(
        zip(other.losses, eager.losses, reference.losses, strict=True)
    ):
        check(f"loss at step {step}", loss, eager_loss, ref_loss)
    for name, eager_grad in eager.first_step_grads.items():
        grad, ref_grad = other.first_step_grads.get(name), reference.first_step_grads.get(name)
        if eager_grad is None or grad is None or ref_grad is None:
            if not (eager_grad is None and grad is None):
                problems.append(f"grad of {name!r} after step 1: None in one of the trainings")
            continue
        check(f"grad of {name!r} after step 1", grad, eager_grad, ref_grad)
    noise = _rounding_noise_gradients(eager, reference)
    for name, eager_value in eager.final_state.items():
        value, ref_value = other.final_state.get(name), reference.final_state.get(name)
        if value is None or ref_value is None:
            problems.append(f"final {name!r}: missing")
        elif name in noise:
            # its true first-step gradient is below float32's rounding: every float32 training
            # moves it by noise that AdamW scales up to whole steps (its gradient is checked)
            continue
        elif eager_value.is_floating_point():
            check(f"final {name!r}", value, eager_value, ref_value)
        elif not torch.equal(value, eager_value):
            problems.append(f"final {name!r}: differs (not floating point)")
    return problems


def _rounding_noise_gradients(eager: TrainRecord, reference: TrainRecord) -> set[str]:
    """The parameters whose first-step gradient in float64 is smaller than eager's own float32
    error on it by 10x or more (a bias the softmax is invariant to: 2e-17 in float64, 5.6e-09
    off in eager float32). A gradient that is exactly 0 in both (a zero-initialised LoRA
    factor's) is not noise: its parameter is checked."""
    found: set[str] = set()
    for name, eager_grad in eager.first_step_grads.items():
        ref_grad = reference.first_step_grads.get(name)
        if eager_grad is None or ref_grad is None or not eager_grad.is_floating_point():
            continue
        error = float((eager_grad.double() - ref_grad.double()).norm())
        if error > 0.0 and error >= 10.0 * float(ref_grad.double().norm()):
            found.add(name)
    return found


def assert_same_mixed_precision_training(
    eager: TrainRecord, other: TrainRecord, param_atol: float
) -> None:
    """Like :func:`assert_same_training`, at the tolerances of bfloat16/float16 training:
    losses within :data:`LOSS_RTOL`, first-step gradients as :data:`GRAD_RTOL` says, final
    parameters within ``param_atol`` (an Adam step moves an element by about its learning rate
    whatever its gradient's size, so noise-level gradients of opposite sign part by up to
    2 * lr a step: pass ``2 * steps * lr``). Gradients keep eager's dtype."""
    problems: list[str] = []
    for step, (got_loss, want_loss) in enumerate(zip(other.losses, eager.losses, strict=True)):
        if not _scalars_close(got_loss, want_loss, LOSS_RTOL, 0.0):
            problems.append(f"loss at step {step}: {got_loss!r} vs eager {want_loss!r}")
    problems += _key_problems("gradients", other.first_step_grads, eager.first_step_grads)
    scale = max(
        (float(g.detach().float().abs().max()) for g in eager.first_step_grads.values()
         if g is not None and g.numel()),
        default=0.0,
    )  # fmt: skip
    for name, want in eager.first_step_grads.items():
        got = other.first_step_grads.get(name)
        if want is None or got is None:
            if (want is None) != (got is None):
                problems.append(f"grad of {name!r}: None in one run only")
            continue
        if got.dtype != want.dtype:
            problems.append(f"grad of {name!r}: dtype {got.dtype} vs eager {want.dtype}")
            continue
        bound = GRAD_RTOL * max(float(want.float().abs().max()), GRAD_FLOOR * scale)
        err = float((got.float() - want.float()).abs().max())
        if not err <= bound:
            problems.append(f"grad of {name!r} after step 1: max abs err {err:.3g} > {bound:.3g}")
    for name, want_value in eager.final_state.items():
        got_value = other.final_state.get(name)
        if got_value is None or not want_value.is_floating_point():
            continue
        err = float((got_value.float() - want_value.float()).abs().max())
        if not err <= param_atol:
            problems.append(f"final {name!r}: max abs err {err:.3g} > {param_atol:.3g}")
    if problems:
        raise AssertionError(_report("mixed-precision training differs from eager", problems))


def assert_tree_close(
    a: Any, b: Any, rtol: float = RTOL, atol: float = ATOL, path: str = "output"
) -> None:
    """Raise ``AssertionError`` unless nested outputs ``a`` and ``b`` (the reference) match.

    Walks tensors, mappings (dict, OrderedDict, ModelOutput look-alikes), lists, tuples
    (namedtuples too) and dataclasses; containers must have the same type and keys, tensors the
    same shape and dtype and close values, other leaves must be equal (floats within tolerance).

        assert_tree_close(ort_out, eager_out, 1e-4, 1e-5)
        # AssertionError: ... output['logits']: 3 of 64 elements differ ...
    """
    problems = _tree_problems(a, b, rtol, atol, path)
    if problems:
        raise AssertionError(_report(f"outputs differ (rtol={rtol}, atol={atol})", problems))


def __getattr__(name: str) -> Any:
    # ``requires_cuda`` is built on first use so that importing this module never needs pytest.
    if name == "requires_cuda":
        import pytest

        return pytest.mark.skipif(
            not torch.cuda.is_available(), reason="needs a CUDA device (none is available)"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _detached_copy(obj: Any) -> Any:
    """A deep copy in which every tensor is a detached clone (deepcopy refuses non-leaf ones)."""
    memo: dict[int, Any] = {}

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            memo[id(x)] = x.detach().clone()
        elif isinstance(x, Mapping):
            for value in x.values():
                visit(value)
        elif isinstance(x, (list, tuple)):
            for value in x:
                visit(value)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for field in dataclasses.fields(x):
                visit(getattr(x, field.name))

    visit(obj)
    return copy.deepcopy(obj, memo)


# --- comparison ---------------------------------------------------------------------------------


def _report(title: str, problems: list[str]) -> str:
    lines = problems[:MAX_REPORTED]
    if len(problems) > MAX_REPORTED:
        lines.append(f"... and {len(problems) - MAX_REPORTED} more")
    return "\n  ".join([f"{title}:", *lines])


def _rel(got: float, want: float) -> float:
    return abs(got - want) / abs(want) if want else math.inf


def _scalars_close(got: float, want: float, rtol: float, atol: float) -> bool:
    if math.isnan(got) and math.isnan(want):
        return True
    return abs(got - want) <= atol + rtol * abs(want)


def _key_problems(what: str, got: Mapping[str, Any], want: Mapping[str, Any]) -> list[str]:
    missing = [k for k in want if k not in got]
    extra = [k for k in got if k not in want]
    problems = []
    if missing:
        problems.append(f"{what}: missing {missing} (present in eager)")
    if extra:
        problems.append(f"{what}: unexpected {extra} (absent in eager)")
    return problems


def _tensor_mismatch(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> str | None:
    """``None`` when close, else what differs: shape, dtype, or the worst element."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} vs {tuple(want.shape)} in eager"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} vs {want.dtype} in eager"
    got, want = got.detach().cpu(), want.detach().cpu()
    if not (want.is_floating_point() or want.is_complex()):
        if torch.equal(got, want):
            return None
        count = int((got != want).sum())
        return f"{count} of {want.numel()} elements differ (integer and bool tensors must be equal)"
    wide = torch.complex128 if want.is_complex() else torch.float64
    got64, want64 = got.to(wide), want.to(wide)
    close = torch.isclose(got64, want64, rtol=rtol, atol=atol, equal_nan=True)
    if bool(close.all()):
        return None
    abs_err = torch.nan_to_num((got64 - want64).abs(), nan=math.inf).masked_fill(close, 0.0)
    rel_err = (abs_err / want64.abs()).nan_to_num(nan=math.inf).masked_fill(close, 0.0)
    flat = int(abs_err.flatten().argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), want.shape))
    return (
        f"{int((~close).sum())} of {want.numel()} elements differ; "
        f"max abs err {float(abs_err.max()):.3g} at index {list(index)} "
        f"({got.flatten()[flat].item()!r} vs {want.flatten()[flat].item()!r} in eager), "
        f"max rel err {float(rel_err.max()):.3g}"
    )


def _tree_problems(a: Any, b: Any, rtol: float, atol: float, path: str) -> list[str]:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        mismatch = _tensor_mismatch(a, b, rtol, atol)
        return [f"{path}: {mismatch}"] if mismatch else []
    if type(a) is not type(b):
        return [f"{path}: type {type(a).__qualname__} vs {type(b).__qualname__} in eager"]
    if isinstance(b, Mapping):
        keys_a, keys_b = list(a.keys()), list(b.keys())
        if keys_a != keys_b:
            return [f"{path}: keys {keys_a} vs {keys_b} in eager"]
        return [p for k in keys_b for p in _tree_problems(a[k], b[k], rtol, atol, f"{path}[{k!r}]")]
    if isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)} in eager"]
        return [
            p
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for p in _tree_problems(x, y, rtol, atol, f"{path}[{i}]")
        ]
    if dataclasses.is_dataclass(b) and not isinstance(b, type):
        return [
            p
            for f in dataclasses.fields(b)
            for p in _tree_problems(
                getattr(a, f.name), getattr(b, f.name), rtol, atol, f"{path}.{f.name}"
            )
        ]
    if isinstance(b, float):
        return [] if _scalars_close(a, b, rtol, atol) else [f"{path}: {a!r} vs {b!r} in eager"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r} in eager"]
