"""Train one model type three AdamW steps in eager and under ORTModule, and say how it went.

    result = run_model_type("llama", TASKS_BY_NAME["causal-lm"])
    result.status  # "parity", "wrong", "engine-error", "eager-error" or "not-built"

Both runs start from the same weights (one model built under a fixed seed, deep-copied) and
see the same batches. Parity is :func:`~ortmodule_testing.parity.assert_same_training` at its
default float32 tolerance (rtol 1e-4, atol 1e-5) on every loss, first-step gradient and final
parameter and buffer; where that fails, a training as close to a float64 eager training as
eager's own float32 one is (:func:`~ortmodule_testing.parity.against_float64`) is parity too
(rounding that AdamW amplified), and its ``detail`` says so. Imports ``transformers`` and ``ortmodule`` when called; ORTModule runs
with ``ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE`` (the caller sets it).
"""

from __future__ import annotations

import inspect
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..parity import (
    TrainRecord,
    against_float64,
    assert_same_training,
    clone_model,
    float64_case,
    train_steps,
)
from ..zoo.registry import Batch, ZooCase
from .shrink import NotShrinkable, shrink_config
from .tasks import Task

__all__ = ["STATUSES", "TRAINS_IN_EAGER", "Result", "adamw", "run_model_type"]

STEPS = 3
#: every status, best first
STATUSES = ("parity", "wrong", "engine-error", "engine-crash", "eager-error", "not-built")
#: the statuses of model types that train in eager (the coverage figure's denominator)
TRAINS_IN_EAGER = ("parity", "wrong", "engine-error", "engine-crash")


@dataclass
class Result:
    """How one model type went. ``error``: the exception's type and first line (for ``wrong``,
    the first difference); ``detail``: the end of the traceback, or every difference."""

    model_type: str
    task: str
    class_name: str
    status: str
    error: str = ""
    detail: str = ""
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def adamw(params: Any) -> torch.optim.Optimizer:
    """AdamW with eps 1e-6: an attention key bias has an analytically zero gradient, both
    engines hand it rounding noise, and eps 1e-8 would turn that noise into steps of random sign
    (the same optimizer as the Hugging Face zoo tests)."""
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def first_line(err: BaseException) -> str:
    """``Type: first line of the message`` (300 characters at most)."""
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0].strip()[:300] if lines else ''}"


def _trace(err: BaseException) -> str:
    return "".join(traceback.format_exception(err)[-8:])[-4000:]


def _loss(out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    loss = out.get("loss") if hasattr(out, "get") else getattr(out, "loss", None)
    if loss is None:
        raise ValueError("the model returned no loss for these labels")
    return loss  # type: ignore[no-any-return]


def _accepted(model: torch.nn.Module, make_batch: Callable[[int], Batch]) -> Callable[[int], Batch]:
    """``make_batch`` without the keyword inputs ``model.forward`` has no parameter for."""
    params = inspect.signature(model.forward).parameters
    named = {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}

    def batch(step: int) -> Batch:
        args, kwargs = make_batch(step)
        return args, {k: v for k, v in kwargs.items() if k in named}

    return batch


def build_model(model_type: str, task: Task) -> torch.nn.Module:
    """The tiny model of ``model_type`` for ``task`` under seed 0 (raises what went wrong)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    class_name = task.class_name(model_type)
    model_cls = getattr(transformers, class_name, None)
    if model_cls is None:
        raise NotShrinkable(f"transformers has no {class_name}")
    config = shrink_config(CONFIG_MAPPING[model_type], **task.config)
    if task.config.get("num_labels") and getattr(config, "pad_token_id", 0) is None:
        # sequence classifiers of decoders find each row's last token through the pad id
        config.pad_token_id = 0
    # training builds no key/value cache (a hybrid model's cache refuses a training forward)
    for part in (config, getattr(config, "text_config", None)):
        if part is not None and getattr(part, "use_cache", None):
            part.use_cache = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return model_cls(config)  # type: ignore[no-any-return]


def _seeded(run: Callable[[], TrainRecord]) -> TrainRecord:
    """``run()`` from the same global random state each time, restored afterwards: a model
    that samples in training (phimoe's router draws experts) then draws the same numbers in
    eager and under the engine, instead of whatever the earlier run left."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return run()


def run_model_type(
    model_type: str,
    task: Task,
    engine: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    on_phase: Callable[[str], None] = lambda phase: None,
) -> Result:
    """Build, train in eager, train under ``engine`` (ORTModule by default), compare.

    ``on_phase`` hears ``"build"``, ``"eager"``, ``"engine"`` and ``"float64"`` as each begins, so that a
    process watching this one knows where a crash or hang happened.
    """
    start = time.monotonic()
    try:
        class_name = task.class_name(model_type)
    except KeyError:
        class_name = "?"

    def result(status: str, error: str = "", detail: str = "") -> Result:
        seconds = round(time.monotonic() - start, 1)
        return Result(model_type, task.name, class_name, status, error, detail, seconds)

    on_phase("build")
    try:
        model = build_model(model_type, task)
    except Exception as err:  # noqa: BLE001 - every reason is recorded
        return result("not-built", first_line(err), _trace(err))
    case = ZooCase(model_type, lambda: model, _accepted(model, task.make_batch), _loss)

    on_phase("eager")
    try:
        eager = _seeded(lambda: train_steps(clone_model(model), case, STEPS, adamw))
    except Exception as err:  # noqa: BLE001
        return result("eager-error", first_line(err), _trace(err))

    on_phase("engine")
    try:
        if engine is None:
            from ortmodule import ORTModule

            engine = ORTModule
        wrapped = engine(clone_model(model))
        record = _seeded(lambda: train_steps(wrapped, case, STEPS, adamw))
    except Exception as err:  # noqa: BLE001
        return result("engine-error", first_line(err), _trace(err))
    try:
        assert_same_training(eager, record)
    except AssertionError as err:
        lines = str(err).splitlines()
        first = lines[1].strip() if len(lines) > 1 else lines[0]
        on_phase("float64")
        problems = _against_float64(model, case, eager, record)
        if problems is None:
            return result("wrong", first, str(err) + "\n(no float64 reference: it did not train)")
        if problems:
            return result("wrong", first, str(err) + "\nagainst float64:\n" + "\n".join(problems))
        # as close to float64 as eager's own float32 training: rounding, not a wrong value
        return result("parity", "", "float32 tolerance exceeded, within float64's:\n" + str(err))
    return result("parity")


def _against_float64(
    model: torch.nn.Module, case: ZooCase, eager: TrainRecord, record: TrainRecord
) -> list[str] | None:
    """:func:`~ortmodule_testing.parity.against_float64` with eager trained in float64 from the
    same weights on the same batches; None when the model does not train in float64."""

    case64 = float64_case(case)
    try:
        reference = _seeded(lambda: train_steps(clone_model(model).double(), case64, STEPS, adamw))
    except Exception:  # noqa: BLE001 - no reference: the float32 comparison stands
        return None
    return against_float64(eager, record, reference)
