"""ortmodule-memory end to end: recompute levels train exactly like eager, the table, the stats."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from ortmodule import ORTModule
from ortmodule.debug_options import DebugOptions
from ortmodule_memory import memory_report
from ortmodule_testing.parity import assert_same_training, clone_model, train_steps
from ortmodule_testing.zoo import ZOO
from ortmodule_testing.zoo.registry import ZooCase


@pytest.fixture(autouse=True)
def _engine_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")


def _applied(model: nn.Module) -> tuple[str, ...]:
    report = memory_report(model)
    assert report is not None, "the memory component made no report: is ortmodule-memory installed?"
    return report.applied


@pytest.mark.parametrize(("level", "fused_attention"), [("1", None), ("2", None), ("1", "0")])
def test_layerwise_recompute_trains_like_eager(
    monkeypatch: pytest.MonkeyPatch, level: str, fused_attention: str | None
) -> None:
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", level)
    if fused_attention is not None:
        monkeypatch.setenv("ORTMODULE_FUSED_ATTENTION", fused_attention)
    case = ZOO["gpt"]
    model = case.build(seed=0)
    eager = train_steps(clone_model(model), case, steps=2)
    wrapped = ORTModule(clone_model(model))
    ours = train_steps(wrapped, case, steps=2)
    assert_same_training(eager, ours, *case.tolerance)
    applied = _applied(wrapped)
    # per-layer checkpointing: the GELU subgraph of every layer, and the attention's
    assert any(p.startswith("Gelu+") for p in applied), applied
    if fused_attention is None:
        # the levels keep the fused attention node: the query/key/value projection feeding
        # it is recomputed, and no decomposed softmax is left to recompute
        assert any("Split" in p for p in applied), applied
        assert not any("Softmax" in p for p in applied), applied
    else:
        assert any("Softmax" in p for p in applied), applied


def test_a_level_keeps_fused_attention_unless_triton_wants_it_decomposed() -> None:
    # every package is installed here: the memory and Triton components declare their options
    from ortmodule.options import RuntimeOptions
    from ortmodule.runner_config import export_config

    def fused(**environ: str) -> bool:
        return export_config(RuntimeOptions.resolve(None, environ=environ)).aten_sdpa_fallback

    assert fused(ORTMODULE_MEMORY_OPT_LEVEL="1")
    assert not fused(ORTMODULE_MEMORY_OPT_LEVEL="1", ORTMODULE_USE_TRITON="1")


def test_user_plans_from_json_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    plans = tmp_path / "plans.json"
    plans.write_text(json.dumps(["Gelu+:1:-1"]))
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "0")
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_CONFIG", str(plans))
    case = ZOO["gpt"]
    model = case.build(seed=0)
    eager = train_steps(clone_model(model), case, steps=2)
    wrapped = ORTModule(clone_model(model))
    assert_same_training(eager, train_steps(wrapped, case, steps=2), *case.tolerance)
    assert _applied(wrapped) == ("Gelu+:1:-1",)


def test_level_from_debug_options() -> None:
    case = ZOO["gpt"]
    model = ORTModule(case.build(seed=0), DebugOptions(memory_opt_level=1))
    args, kwargs = case.make_batch(0)
    case.loss_fn(model(*args, **kwargs), args, kwargs).backward()
    assert "Gelu+:1:-1" in _applied(model)


def test_bad_plan_file_names_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    plans = tmp_path / "plans.json"
    plans.write_text('"Gelu+:1:-1"')  # a string, not a list
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_CONFIG", str(plans))
    case = ZOO["mlp"]
    model = ORTModule(case.build(seed=0))
    args, kwargs = case.make_batch(0)
    with pytest.raises(Exception, match="ORTMODULE_MEMORY_OPT_CONFIG file .*JSON list"):
        model(*args, **kwargs)


class DropoutLayer(nn.Module):
    """``w2(dropout(gelu(w1 x) + 3))``: kept values are at least ~5, dropped ones exactly 0, and
    an orthogonal ``w2`` lets the test read the forward's mask back from the output."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(16, 32)
        self.w2 = nn.Linear(32, 32)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.drop(torch.nn.functional.gelu(self.w1(x)) + 3.0))


def test_recomputed_dropout_reuses_the_forward_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward of a recomputed Dropout uses the forward's mask: the engine's gradients equal
    eager's computed with the mask read back from the engine's forward output."""
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "1")
    p = 0.5
    torch.manual_seed(0)
    model = DropoutLayer(p)
    nn.init.orthogonal_(model.w2.weight)
    eager = clone_model(model)
    wrapped = ORTModule(model)
    gen = torch.Generator().manual_seed(1)
    x, c = torch.randn(64, 16, generator=gen), torch.randn(64, 32, generator=gen)
    y = wrapped(x)
    (y * c).sum().backward()
    assert any("Dropout" in plan for plan in _applied(wrapped)), _applied(wrapped)

    with torch.no_grad():
        dropped_in = torch.linalg.solve(model.w2.weight, (y - model.w2.bias).T).T
    mask = (dropped_in.abs() > 1.0).float()
    assert 0.3 < float(mask.mean()) < 0.7  # a real mask, not all kept or all dropped
    h = torch.nn.functional.gelu(eager.w1(x)) + 3.0
    (eager.w2(h * mask / (1 - p)) * c).sum().backward()
    for name, param in eager.named_parameters():
        got = dict(wrapped.named_parameters())[name].grad
        torch.testing.assert_close(got, param.grad, rtol=1e-4, atol=1e-5, msg=name)


class Attention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d)) v with a hand-written backward, as a fused attention kernel is."""

    @staticmethod
    def forward(ctx, q, k, v):  # type: ignore[no-untyped-def]
        p = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        ctx.save_for_backward(q, k, v, p)
        return p @ v

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        q, k, v, p = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        dv = p.transpose(-1, -2) @ grad
        dp = grad @ v.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
        return ds @ k, ds.transpose(-1, -2) @ q, dv


class FunctionBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        # no bias: softmax ignores a key bias, so its gradient is rounding noise Adam amplifies
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.ln2 = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        x = x + Attention.apply(q, k, v)
        return x + self.mlp(self.ln2(x))


class FunctionModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(FunctionBlock(16), FunctionBlock(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def test_custom_function_inside_recomputed_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "1")
    case = ZooCase(
        "function",
        FunctionModel,
        lambda step: ((torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(step)),), {}),
        lambda out, args, kwargs: out.pow(2).mean(),
    )
    model = case.build(seed=0)
    eager = train_steps(clone_model(model), case, steps=2)
    wrapped = ORTModule(clone_model(model))
    assert_same_training(eager, train_steps(wrapped, case, steps=2))
    assert any(p.startswith("Gelu+") for p in _applied(wrapped))


def test_opportunity_table_and_recommendation_at_info(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    # the byte count below is the engine's GELU plan: keep GELU on the engine's kernel (with
    # recompute off, ORTMODULE_KERNEL_CHOICE=AUTO may measure PyTorch's GELU faster)
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "ENGINE")
    case = ZOO["gpt"]
    model = ORTModule(case.build(seed=0))
    args, kwargs = case.make_batch(0)
    with caplog.at_level(logging.INFO, logger="ortmodule"):
        case.loss_fn(model(*args, **kwargs), args, kwargs).backward()
    report = memory_report(model)
    assert report is not None and report.applied == ()
    gelu = next(o for o in report.opportunities if o.cluster_id == "Gelu+:1:-1")
    # GELU's input is stashed per layer: batch * seq * 4 * d_model floats
    (ids,) = args
    config = model.module.config
    assert gelu.frequency == config.n_layers
    assert gelu.saving_bytes == config.n_layers * ids.numel() * 4 * config.d_model * 4
    text = caplog.text
    assert "recompute opportunities" in text and "Gelu+:1:-1" in text
    assert "ORTMODULE_MEMORY_OPT_LEVEL=1 would recompute" in text


def test_memory_stats_lines(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ORTMODULE_PRINT_MEMORY_STATS", "1")
    case = ZOO["mlp"]
    model = ORTModule(case.build(seed=0))
    with caplog.at_level(logging.INFO, logger="ortmodule"):
        for step in range(2):
            args, kwargs = case.make_batch(step)
            case.loss_fn(model(*args, **kwargs), args, kwargs).backward()
    lines = [r.getMessage() for r in caplog.records if "memory (MiB)" in r.getMessage()]
    phases = ["pre_forward", "post_forward", "pre_backward", "post_backward"]
    assert [line.split("phase: ")[1].split(" ")[0] for line in lines] == phases * 2
    assert lines[0].startswith("[0/1] step 0 memory (MiB)") and lines[-1].startswith("[0/1] step 1")
    assert all("| rss: " in line and "| peak rss: " in line for line in lines)
