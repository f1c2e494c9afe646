"""Custom torch.autograd.Function and ATen operators under ORTModule, against PyTorch eager.

Fallback is disabled (conftest): every step here ran in the engine, so a silent PyTorch fallback
cannot make a test pass. ``configure`` is what ``ORTModule._setup()`` calls.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ortmodule import ExportError, ORTModule
from ortmodule.custom_autograd import configure
from ortmodule.options import RuntimeOptions
from ortmodule_exporter import python_op
from ortmodule_exporter.aten import routes as aten_routes
from ortmodule_exporter.callback_errors import user_errors
from ortmodule_exporter.python_op import (
    FunctionRegistry,
    RefusedPythonOpError,
    checks,
    registry,
    shape_inference,
    symbolic,
)
from ortmodule_exporter.python_op import runner as python_op_runner
from ortmodule_testing.parity import assert_same_training, clone_model, train_steps
from ortmodule_testing.zoo.registry import ZooCase


def _sgd(params: Iterator[torch.nn.Parameter]) -> torch.optim.Optimizer:
    # SGD, not AdamW: AdamW turns the rounding noise of analytically-zero gradients (an
    # attention key bias) into full-size steps, in eager as much as in the engine
    return torch.optim.SGD(params, lr=0.05)


def _graph(wrapped: ORTModule) -> Any:
    compiled = wrapped._runner.transitions.current(training=True, build_gradient=True)
    assert compiled is not None
    return compiled.built


def wrap(model: torch.nn.Module) -> ORTModule:
    wrapped = ORTModule(model)
    configure(wrapped.options)  # until ORTModule._setup() makes this call itself
    return wrapped


@pytest.fixture(autouse=True)
def _export_like_ortmodule(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # What export/exporter.py passes to torch.onnx.export once custom autograd is wired in (see
    # python_op / aten.routes); setdefault keeps whatever the exporter already passes.
    original = torch.onnx.export

    def export(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("autograd_inlining", not python_op.custom_autograd_enabled())
        kwargs.setdefault("operator_export_type", aten_routes.operator_export_type())
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", export)
    yield
    configure(RuntimeOptions.defaults())


class Gelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, approximate: str) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.approximate = approximate
        return F.gelu(x, approximate=approximate)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            (g,) = torch.autograd.grad(F.gelu(leaf, approximate=ctx.approximate), leaf, grad)
        return g, None


class Net(torch.nn.Module):
    def __init__(self, act: Any) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _case(act: Any) -> ZooCase:
    def batch(step: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (torch.randn(8, 16, generator=torch.Generator().manual_seed(step)),), {}

    def loss(out: torch.Tensor, args: Any, kwargs: Any) -> torch.Tensor:
        return out.pow(2).mean()

    return ZooCase("custom", lambda: Net(act), batch, loss)


def _same_training_as_eager(act: Any, steps: int = 4) -> ORTModule:
    case = _case(act)
    model = case.build(seed=0)
    eager = train_steps(clone_model(model), case, steps, _sgd)
    wrapped = wrap(clone_model(model))
    ours = train_steps(wrapped, case, steps, _sgd)
    assert_same_training(eager, ours)
    assert wrapped._fallback.cause is None
    return wrapped


def test_custom_function_trains_like_eager() -> None:
    wrapped = _same_training_as_eager(lambda h: Gelu.apply(h, "tanh"))
    assert python_op.REGISTRY.lookup(f"{__name__}.Gelu").cls is Gelu
    (node,) = [n for n in _graph(wrapped).exported.model.graph.node if n.op_type == "PythonOp"]
    assert python_op_runner.live_contexts() == 0


class KeepsItsOutput(torch.autograd.Function):
    """Saves a tensor it made, and notes it (weakly) for the test."""

    made: list[weakref.ref[torch.Tensor]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = x * 2.0
        ctx.save_for_backward(y)
        KeepsItsOutput.made.append(weakref.ref(y))
        return y.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return grad * 2.0 + 0.0 * y


def test_a_forward_dropped_without_backward_frees_the_saved_tensors() -> None:
    """As autograd frees a Function's saved tensors with a graph that never ran backward, the
    engine's context of the call goes once its forward's state is dropped (it stayed for the
    life of the process: 16 MiB a forward for a (4096, 1024) tensor)."""
    model = Net(KeepsItsOutput.apply)
    wrapped = wrap(clone_model(model))
    x = torch.randn(8, 16)
    wrapped(x).sum().backward()  # the first step builds the graph
    pending = python_op_runner.live_contexts()  # other tests may leave some behind
    KeepsItsOutput.made.clear()
    for _ in range(3):
        out = wrapped(x)
        assert python_op_runner.live_contexts() == pending + 1
        del out  # no backward
        gc.collect()
        assert python_op_runner.live_contexts() == pending
    wrapped(x).sum().backward()  # the next forward empties the engine's pool
    assert python_op_runner.live_contexts() == pending
    if pending == 0:
        assert [r() for r in KeepsItsOutput.made] == [None] * 4
    # and training still matches eager afterwards
    torch.testing.assert_close(wrapped(x), model(x), rtol=1e-4, atol=1e-5)


def test_eval_and_no_grad_run_the_function_without_context() -> None:
    model = Net(lambda h: Gelu.apply(h, "none"))
    wrapped = wrap(clone_model(model))
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), model(x), rtol=1e-4, atol=1e-5)
    wrapped.eval()
    torch.testing.assert_close(wrapped(x), model.eval()(x), rtol=1e-4, atol=1e-5)
    assert python_op_runner.live_contexts() == 0


def test_engine_context_entries_of_inference_calls_are_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(python_op_runner, "RELEASE_EVERY", 5)
    model = Net(lambda h: Gelu.apply(h, "none"))
    wrapped = wrap(clone_model(model))
    x = torch.randn(3, 16)
    before = python_op_runner.engine_context_releases()
    with torch.no_grad():
        for _ in range(12):
            wrapped(x)
    assert python_op_runner.engine_context_releases() >= before + 2
    # the Functions are registered with the engine again: training still runs
    wrapped(x).sum().backward()
    assert wrapped.module.fc1.weight.grad is not None


def test_switched_off_exports_the_function_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "0")
    wrapped = _same_training_as_eager(lambda h: Gelu.apply(h, "tanh"), steps=2)
    graph = _graph(wrapped).exported.model.graph
    assert not any(n.op_type == "PythonOp" for n in graph.node)


def test_thousand_steps_leave_nothing_behind() -> None:
    contexts: list[weakref.ref[Any]] = []

    class Tracked(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            contexts.append(weakref.ref(ctx))
            ctx.save_for_backward(x)
            return x.relu()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            return grad * (x > 0)

    wrapped = wrap(Net(Tracked.apply))
    x = torch.randn(8, 16)
    wrapped(x).sum().backward()  # export and build
    sizes = python_op.REGISTRY.sizes()
    kernels = python_op_runner.kernel_count()
    for _ in range(1000):
        wrapped(x).sum().backward()
    gc.collect()
    assert python_op.REGISTRY.sizes() == sizes
    assert python_op_runner.kernel_count() == kernels
    assert python_op_runner.live_contexts() == 0
    assert len(contexts) >= 1000  # one per step, plus the call traced by the export
    assert sum(ref() is not None for ref in contexts) == 0


def test_checkpoint_is_refused_then_runs_when_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.utils.checkpoint as cp

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(32, 32)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return cp.checkpoint(self.inner, h, use_reentrant=True)

    wrapped = wrap(Net(Block()))
    with pytest.raises(ExportError, match="ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT=1"):
        wrapped(torch.randn(8, 16))

    monkeypatch.setenv("ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT", "1")
    # the checkpointed block is passed by reference: without the export copy (or with
    # export/exporter.py's exporting_copy_of) its own parameters are the ones trained
    monkeypatch.setenv("ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT", "0")
    _same_training_as_eager(Block(), steps=3)


def test_cached_model_from_another_process_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path))
    model = Net(lambda h: Gelu.apply(h, "tanh"))
    first = wrap(clone_model(model))
    first(torch.randn(8, 16)).sum().backward()  # exported and stored in the cache

    fresh = FunctionRegistry()  # what a new process holds
    # every module of python_op that reads the registry by name
    for module in (python_op, registry, symbolic, checks, shape_inference):
        monkeypatch.setattr(module, "REGISTRY", fresh)
    second = wrap(clone_model(model))
    try:
        second(torch.randn(8, 16))
    except (
        RefusedPythonOpError
    ) as err:  # export/exporter.py without the cache check: a clear refusal
        assert "did not export in this process" in str(err)
    else:  # export/exporter.py treats such a cache hit as a miss: exported again, never run as loaded
        assert second._runner.exports == 1
        assert python_op.REGISTRY.lookup(f"{__name__}.Gelu").cls is Gelu


def test_user_error_in_a_function_reaches_the_caller() -> None:
    class Checked(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            if not torch.onnx.is_in_onnx_export() and bool((x > 1e6).any()):
                raise OverflowError("activation too large")
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad

    wrapped = wrap(Net(Checked.apply))
    wrapped(torch.randn(8, 16)).sum().backward()
    # engine.py raises it through user_errors once wired; the explicit wrapper is a no-op then
    with pytest.raises(OverflowError, match="activation too large") as info, user_errors():
        wrapped(torch.full((8, 16), 1e9))
    assert any("Checked.forward" in n for n in getattr(info.value, "__notes__", []))


# -- ATen -----------------------------------------------------------------------------------------


class I0eNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch.special.i0e has no ONNX symbolic: without the ATen route, whole-model fallback
        return self.fc2(torch.special.i0e(self.fc1(x)))


def test_operator_without_symbolic_trains_without_fallback() -> None:
    case = ZooCase("i0e", I0eNet, _case(None).make_batch, _case(None).loss_fn)
    model = case.build(seed=0)
    eager = train_steps(clone_model(model), case, 3, _sgd)
    wrapped = wrap(clone_model(model))
    ours = train_steps(wrapped, case, 3, _sgd)
    assert_same_training(eager, ours)
    assert wrapped._fallback.cause is None
    comments = [
        a.s
        for n in _graph(wrapped).exported.model.graph.node
        for a in n.attribute
        if a.name == "comment"
    ]
    assert b"aten::special_i0e.default" in comments  # run by PyTorch inside the engine


def test_sdpa_fallback_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_ATEN_SDPA_FALLBACK", "1")

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)
            self.out = torch.nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(2, 4, 3, 2, 8).permute(2, 0, 3, 1, 4)
            h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(h.transpose(1, 2).reshape(2, 4, 16))

    def batch(step: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(step)),), {}

    case = ZooCase("sdpa", Attention, batch, lambda out, a, k: out.pow(2).mean())
    model = case.build(seed=0)
    eager = train_steps(clone_model(model), case, 3, _sgd)
    wrapped = wrap(clone_model(model))
    assert wrapped.options.aten_sdpa_fallback
    ours = train_steps(wrapped, case, 3, _sgd)
    assert_same_training(eager, ours)
    graph = _graph(wrapped).model.graph
    assert any(
        a.s in (b"_scaled_dot_product_flash_attention_for_cpu", b"_ortmodule_flash_attention_bshd")
        for n in graph.node
        for a in n.attribute
    )
