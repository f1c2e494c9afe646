"""FP16_Optimizer against the real DeepSpeed optimizers it wraps, on CPU.

Each test trains two identical fp16 models, one under the DeepSpeed optimizer as is and one under
``FP16_Optimizer(that optimizer)``, through loss-scale overflows (the first steps of a large
initial scale, and injected inf losses), and requires the same skipped steps, the same loss-scale
schedule and the same parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import ortmodule_optim.deepspeed_modifiers as modifiers
from ortmodule_optim import FP16_Optimizer

pytestmark = pytest.mark.usefixtures("deepspeed_cpu")

INF_STEPS = (5, 9)


def tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 2)
    )


def batches(steps: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, generator=gen).to(dtype) for _ in range(steps)]


def loss_at(step: int, out: torch.Tensor) -> torch.Tensor:
    loss = out.float().pow(2).mean()
    return loss * float("inf") if step in INF_STEPS else loss


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts calls of the multi-tensor helpers, to prove the wrapped optimizer uses them."""
    counts = {"has_inf_or_nan": 0, "tensor_norms": 0, "scale_": 0}

    def counting(name: str) -> Callable[..., Any]:
        original = getattr(modifiers, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return original(*args, **kwargs)

        return wrapper

    for name in counts:
        monkeypatch.setattr(modifiers, name, counting(name))
    return counts


def run_fp16(cls: type, wrap: bool, clip_grad: float, steps: int = 14) -> tuple[list, Any, Any]:
    model = tiny().half()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    opt = cls(
        inner,
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**20, "scale_window": 3, "min_scale": 1.0},
        clip_grad=clip_grad,
        verbose=False,
    )
    if wrap:
        opt = FP16_Optimizer(opt)
    history = []
    for step, x in enumerate(batches(steps, torch.float16)):
        opt.zero_grad()
        opt.backward(loss_at(step, model(x)))
        overflow = opt.step()
        history.append((bool(overflow), float(opt.loss_scale_config.cur_scale)))
    return history, model, opt


def fp16_classes() -> list[type]:
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer as Fused
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer as Unfused

    return [Fused, Unfused]


@pytest.mark.parametrize("clip_grad", [0.0, 0.05])
@pytest.mark.parametrize("which", [0, 1], ids=["FP16_Optimizer", "FP16_UnfusedOptimizer"])
def test_deepspeed_fp16_optimizers(which: int, clip_grad: float, calls: dict[str, int]) -> None:
    cls = fp16_classes()[which]
    ref_history, ref_model, ref_opt = run_fp16(cls, wrap=False, clip_grad=clip_grad)
    assert calls["has_inf_or_nan"] == 0
    history, model, opt = run_fp16(cls, wrap=True, clip_grad=clip_grad)
    assert calls["has_inf_or_nan"] == len(history)
    assert calls["scale_"] > 0 and (which == 0 or calls["tensor_norms"] > 0)

    assert history == ref_history
    skipped = [step for step, (overflow, _) in enumerate(history) if overflow]
    assert len(skipped) >= 4 and set(INF_STEPS) <= set(skipped), history
    assert len({scale for _, scale in history}) >= 3, "the loss scale should move both ways"
    # The fused optimizer keeps DeepSpeed's own norm, so its steps are bitwise equal; the unfused
    # one sums per-tensor norms in another order, which only matters where clipping applies.
    exact = which == 0 or clip_grad == 0.0
    masters = [
        (a, b)
        for a, b in zip(
            ref_opt.optimizer.param_groups[0]["params"],
            opt.wrapped.optimizer.param_groups[0]["params"],
            strict=True,
        )
    ]
    for a, b in masters:
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    if exact:
        assert all(
            torch.equal(p, q)
            for p, q in zip(ref_model.parameters(), model.parameters(), strict=True)
        )


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_zero(deepspeed_cpu: Any, stage: int, calls: dict[str, int]) -> None:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.05,
        "steps_per_print": 10**9,
        "fp16": {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 20,
            "loss_scale_window": 3,
            "hysteresis": 1,
            "min_loss_scale": 1,
        },
        "zero_optimization": {"stage": stage},
    }
    base = tiny()

    def make(wrap: bool) -> tuple[Any, Any]:
        model = copy.deepcopy(base)
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine, opt, _, _ = deepspeed_cpu.initialize(model=model, optimizer=adamw, config=config)
        assert type(opt).__name__ == "DeepSpeedZeroOptimizer"
        return engine, FP16_Optimizer(opt) if wrap else opt

    (ref_engine, ref_opt), (engine, opt) = make(False), make(True)
    histories: tuple[list, list] = ([], [])
    for step, x in enumerate(batches(12, torch.float16)):
        for (e, o), history in zip(((ref_engine, ref_opt), (engine, opt)), histories, strict=True):
            e.backward(loss_at(step, e(x)))
            e.step()
            history.append((bool(o.overflow), float(o.loss_scale)))
    assert histories[0] == histories[1]
    assert sum(overflow for overflow, _ in histories[1]) >= 3
    assert calls["has_inf_or_nan"] == 12 and calls["tensor_norms"] > 0
    for a, b in zip(ref_engine.parameters(), engine.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(
        ref_opt.single_partition_of_fp32_groups, opt.single_partition_of_fp32_groups, strict=True
    ):
        assert torch.equal(a, b)


def test_multi_tensor_checks_agree_with_deepspeed_helpers() -> None:
    from deepspeed.runtime.utils import CheckOverflow, get_weight_norm, has_inf_or_nan

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen).half() for s in (3, 17, 64, 1)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    checker = CheckOverflow()
    ours = CheckOverflow()
    modifiers._replace(ours, "has_overflow_serial", modifiers._check_overflow_has_overflow_serial)
    assert ours.has_overflow_serial(params) is checker.has_overflow_serial(params) is False
    grads[2][5] = float("nan")
    assert ours.has_overflow_serial(params) is checker.has_overflow_serial(params) is True
    assert bool(modifiers.has_inf_or_nan(grads)) == any(bool(has_inf_or_nan(g)) for g in grads)
    grads[2][5] = 1.0
    assert modifiers._unfused_weight_norm(grads) == pytest.approx(get_weight_norm(grads), rel=1e-6)
