"""ORTModule behaves like the module it wraps, and gradients reach PyTorch with eager semantics."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from ortmodule import EngineBuildError, ORTModule


class TwoHeads(torch.nn.Module):
    """Several outputs: a float used by the loss, one unused, an int and a bool one."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(6, 8)
        self.head_a = torch.nn.Linear(8, 3)
        self.head_b = torch.nn.Linear(8, 2)

    def forward(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        a = self.head_a(h)
        b = self.head_b(h)
        return a, b, a.argmax(-1), a > 0


def _pair(module: torch.nn.Module) -> tuple[torch.nn.Module, ORTModule]:
    return module, ORTModule(copy.deepcopy(module))


def _assert_grads_equal(
    eager: torch.nn.Module, wrapped: ORTModule, rtol: float = 1e-4, atol: float = 1e-5
) -> None:
    for (name, p), (name2, q) in zip(
        eager.named_parameters(), wrapped.named_parameters(), strict=True
    ):
        assert name == name2
        if p.grad is None:
            assert q.grad is None, name
        else:
            assert q.grad is not None, name
            torch.testing.assert_close(
                q.grad, p.grad, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
            )


def test_state_dict_keys_and_round_trip() -> None:
    torch.manual_seed(0)
    plain = TwoHeads()
    wrapped = ORTModule(copy.deepcopy(plain))
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in wrapped.named_children()] == [n for n, _ in plain.named_children()]
    other = TwoHeads()
    other.load_state_dict(wrapped.state_dict())  # wrapped -> plain
    wrapped.load_state_dict(TwoHeads().state_dict())  # plain -> wrapped
    buf = io.BytesIO()
    torch.save(wrapped.state_dict(), buf)
    buf.seek(0)
    plain.load_state_dict(torch.load(buf))
    for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(a, b)


def test_attribute_fallthrough_module_property_and_modes() -> None:
    inner = TwoHeads().eval()
    wrapped = ORTModule(inner)
    assert wrapped.module is inner
    assert wrapped.head_a is inner.head_a
    assert not wrapped.training and not inner.training, (
        "wrapping an eval-mode model keeps eval mode"
    )
    wrapped.train()
    assert wrapped.training and inner.training and inner.body.training
    wrapped.eval()
    assert not inner.body.training
    wrapped.apply(lambda m: setattr(m, "tagged", True))
    assert inner.tagged and inner.body.tagged
    wrapped.to(torch.float64)
    assert inner.body.weight.dtype == torch.float64


def test_bad_inputs_to_the_constructor() -> None:
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        ORTModule(torch.nn.DataParallel(torch.nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        ORTModule(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="already an ORTModule"):
        ORTModule(ORTModule(torch.nn.Linear(2, 2)))


def test_several_outputs_unused_outputs_and_non_differentiable_outputs() -> None:
    torch.manual_seed(0)
    eager, wrapped = _pair(TwoHeads())
    x = torch.randn(5, 6)
    ea, eb, ei, ebool = eager(x)
    wa, wb, wi, wbool = wrapped(x)
    torch.testing.assert_close(wa, ea)
    torch.testing.assert_close(wb, eb)
    assert torch.equal(wi, ei) and wi.dtype == torch.int64
    assert torch.equal(wbool, ebool) and wbool.dtype == torch.bool
    assert not wi.requires_grad and not wbool.requires_grad
    ea.pow(2).sum().backward()  # head_b unused by the loss
    wa.pow(2).sum().backward()
    _assert_grads_equal(eager, wrapped)
    assert wrapped.head_b.weight.grad is None, (
        "as in eager, a head the loss does not use gets no gradient"
    )


def test_input_gradients_and_non_contiguous_inputs() -> None:
    torch.manual_seed(0)
    eager, wrapped = _pair(TwoHeads())
    base = torch.randn(6, 5)
    xe = base.t().clone().requires_grad_(True)
    xw = base.clone().t().requires_grad_(True)
    assert not xw.is_contiguous()
    eager(xe)[0].sum().backward()
    wrapped(xw)[0].sum().backward()
    assert xw.grad is not None
    torch.testing.assert_close(xw.grad, xe.grad)
    _assert_grads_equal(eager, wrapped)


def test_gradient_accumulation_zero_grad_and_hooks() -> None:
    torch.manual_seed(0)
    eager, wrapped = _pair(TwoHeads())
    fired: list[str] = []
    wrapped.body.weight.register_hook(lambda g: fired.append("hook") or g * 2)
    eager.body.weight.register_hook(lambda g: g * 2)
    for i in range(4):
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(i))
        (eager(x)[0].sum() / 4).backward()
        (wrapped(x)[0].sum() / 4).backward()
    assert fired == ["hook"] * 4
    _assert_grads_equal(eager, wrapped)
    wrapped.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in wrapped.parameters())


def test_frozen_parameters_get_no_gradient() -> None:
    torch.manual_seed(0)
    eager, wrapped = _pair(TwoHeads())
    for m in (eager, wrapped):
        m.body.requires_grad_(False)
    x = torch.randn(4, 6)
    eager(x)[0].sum().backward()
    wrapped(x)[0].sum().backward()
    assert wrapped.body.weight.grad is None and wrapped.body.bias.grad is None
    _assert_grads_equal(eager, wrapped)
    graph = wrapped._runner.transitions.current(True, True)
    assert "body.weight" not in graph.built.config.params_to_train


def test_eval_and_no_grad_use_the_inference_graph_and_reuse_each_mode() -> None:
    torch.manual_seed(0)
    eager, wrapped = _pair(TwoHeads())
    x = torch.randn(4, 6)
    for _ in range(2):
        wrapped.train()
        out = wrapped(x)[0]
        assert out.requires_grad
        with torch.no_grad():
            assert not wrapped(x)[0].requires_grad
        wrapped.eval()
        torch.testing.assert_close(wrapped(x)[0], eager.eval()(x)[0])
    assert wrapped._runner.transitions.builds == 3  # training, training-mode no_grad, eval


class Masked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return torch.relu(self.fc(x)) * mask.to(x.dtype) * scale


def test_re_export_exactly_when_the_schema_changes() -> None:
    wrapped = ORTModule(Masked())
    history = wrapped._runner.transitions.history

    def step(x: torch.Tensor, mask: torch.Tensor, **kw: float) -> None:
        wrapped(x, mask, **kw).sum().backward()

    step(torch.randn(2, 4), torch.ones(2, 4))
    step(torch.randn(7, 4), torch.ones(7, 4))  # batch size only
    step(torch.randn(7, 4), mask=torch.ones(7, 4))  # same argument passed by keyword
    assert len(history) == 1
    step(torch.randn(2, 3, 4), torch.ones(2, 3, 4))  # rank
    assert len(history) == 2
    step(torch.randn(2, 3, 4), torch.ones(2, 3, 4, dtype=torch.bool))  # dtype
    assert len(history) == 3 and "mask" in history[-1] and "bool" in history[-1]
    step(
        torch.randn(2, 3, 4), torch.ones(2, 3, 4, dtype=torch.bool), scale=2.0
    )  # a non-tensor value
    assert len(history) == 4 and "scale" in history[-1]
    wrapped.module.fc.weight.requires_grad_(False)  # a frozen parameter
    step(torch.randn(2, 3, 4), torch.ones(2, 3, 4, dtype=torch.bool), scale=2.0)
    assert len(history) == 5 and "requires_grad" in history[-1]
    assert wrapped._runner.exports == 5


def test_deepcopy_and_pickle_rebuild_the_engine_lazily() -> None:
    torch.manual_seed(0)
    wrapped = ORTModule(TwoHeads())
    x = torch.randn(3, 6)
    ref = wrapped(x)[0].detach()
    clone = copy.deepcopy(wrapped)
    assert clone.module is not wrapped.module
    torch.testing.assert_close(clone(x)[0], ref)
    loaded = pickle.loads(pickle.dumps(wrapped))
    torch.testing.assert_close(loaded(x)[0], ref)
    loaded(x)[0].sum().backward()
    assert loaded.body.weight.grad is not None


def test_wrapper_forward_hooks_fire_and_submodule_hooks_warn() -> None:
    wrapped = ORTModule(TwoHeads())
    seen = []
    wrapped.register_forward_hook(lambda m, i, o: seen.append(len(o)))
    wrapped(torch.randn(2, 6))
    assert seen == [4]
    hooked = ORTModule(TwoHeads())
    hooked.module.body.register_forward_hook(lambda m, i, o: None)
    with pytest.warns(UserWarning, match="hooks on submodules"):
        hooked(torch.randn(2, 6))


def test_unsupported_parameter_dtype_gets_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    wrapped = ORTModule(torch.nn.Linear(2, 2).to(torch.complex64))
    with pytest.raises(Exception, match="complex|dtype"):
        wrapped(torch.randn(2, 2, dtype=torch.complex64))


def test_float16_trains_on_cpu() -> None:
    torch.manual_seed(0)
    eager = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    ).half()
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(3, 4).half()
    eager(x).float().sum().backward()
    wrapped(x).float().sum().backward()
    # fp16 accumulation order differs between the two kernels: one fp16 ulp at these magnitudes
    _assert_grads_equal(eager, wrapped, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float64])
def test_dtypes_without_cpu_kernels_get_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """Where the CPU engine lacks a float64 kernel the error says what to do (GELU: ReLU's
    gradient runs as Where nodes, which have float64 kernels, since NaN propagation). bfloat16
    and float16 train: test_mixed_precision.py."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)).to(
        dtype
    )
    wrapped = ORTModule(model)
    with pytest.raises(EngineBuildError, match="no kernel.*train in float32"):
        wrapped(torch.randn(3, 4, dtype=dtype)).sum().backward()


class Switchable(torch.nn.Module):
    """A flag read by forward, and a user method that calls the module itself."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.use_tanh = True

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        y = self.linear(x) * scale
        return torch.tanh(y) if self.use_tanh else y

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return self(x) + 1


def test_attribute_writes_reach_the_wrapped_module_and_re_export() -> None:
    torch.manual_seed(0)
    eager, wrapped = _pair(Switchable())
    x = torch.randn(2, 4)
    torch.testing.assert_close(wrapped(x), eager(x))
    wrapped.use_tanh = False
    eager.use_tanh = False
    assert wrapped.module.use_tanh is False and "use_tanh" not in wrapped.__dict__
    torch.testing.assert_close(wrapped(x), eager(x))  # a new graph, without tanh
    assert wrapped._runner.transitions.builds == 2
    wrapped.use_tanh = True
    eager.use_tanh = True
    torch.testing.assert_close(wrapped(x), eager(x))
    assert wrapped._runner.transitions.builds == 3  # one graph per mode: the tanh one again
    wrapped.use_tanh = True  # the same value: the key is unchanged
    torch.testing.assert_close(wrapped(x), eager(x))
    assert wrapped._runner.transitions.builds == 3
    # submodules and parameters written through the wrapper land in the wrapped module
    wrapped.extra = torch.nn.Linear(2, 2)
    assert "extra" in dict(wrapped.module.named_children())
    assert any(n.startswith("extra.") for n, _ in wrapped.named_parameters())
    del wrapped.extra
    assert not hasattr(wrapped.module, "extra")


def test_user_methods_call_the_engine() -> None:
    torch.manual_seed(0)
    eager, wrapped = _pair(Switchable())
    x = torch.randn(2, 4)
    calls = []
    runner = wrapped._runner
    original = type(runner).__call__

    def counting(self, args, kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return original(self, args, kwargs)

    type(runner).__call__ = counting  # type: ignore[method-assign]
    try:
        out = wrapped.run(x)
    finally:
        type(runner).__call__ = original  # type: ignore[method-assign]
    assert calls, "ORTModule(net).run(x) must reach the engine through self(x)"
    out.sum().backward()
    eager.run(x).sum().backward()
    _assert_grads_equal(eager, wrapped)


class ChecksItsSignature(Switchable):
    """Like Hugging Face's generate: a method that reads its own forward's signature."""

    def forward_parameters(self) -> list[str]:
        import inspect

        return list(inspect.signature(self.forward).parameters)


def test_methods_see_the_forward_signature_while_routed() -> None:
    wrapped = ORTModule(ChecksItsSignature())
    assert wrapped.forward_parameters() == ["x", "scale"]


def test_forward_signature_is_the_wrapped_modules() -> None:
    import inspect

    wrapped = ORTModule(Switchable())
    assert str(inspect.signature(wrapped.forward)) == str(inspect.signature(Switchable().forward))
    assert list(inspect.signature(wrapped.forward).parameters) == ["x", "scale"]
    clone = copy.deepcopy(wrapped)
    assert list(inspect.signature(clone.forward).parameters) == ["x", "scale"]
    assert clone(torch.randn(1, 4), scale=2.0).shape == (1, 3)


def test_data_parallel_around_ortmodule_is_refused() -> None:
    model = ORTModule(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"DataParallel\(ORTModule\(model\)\) is not supported"):
        torch.nn.DataParallel(model)
    # the replication DataParallel runs on GPUs refuses too
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        model._replicate_for_data_parallel()
    # other containers still take an ORTModule
    assert isinstance(torch.nn.Sequential(model)[0], ORTModule)


@pytest.mark.parametrize("aliased", [True, False], ids=["engine-wrote-the-buffer", "engine-copy"])
def test_batchnorm_buffer_updates_follow_eager_arithmetic(aliased: bool) -> None:
    """The engine's running variance (population variance folded in) becomes eager's (the
    unbiased one), bitwise what ``kept + (engine - kept) * n / (n - 1)`` gives, whether the
    engine wrote into the module's buffers (its feeds) or handed back copies."""
    from ortmodule.compiled_graph import BufferUpdate, apply_buffer_updates, kept_variances

    torch.manual_seed(0)
    layers = [torch.nn.BatchNorm2d(c) for c in (3, 5)]
    outputs: list[torch.Tensor] = []
    updates = []
    expected = []
    for bn, n in zip(layers, (12, 1), strict=True):
        bn.running_var.uniform_(0.5, 2.0)
        m = 1.0 - bn.momentum
        new_mean = torch.randn_like(bn.running_mean)
        new_var = bn.running_var * m + torch.rand_like(bn.running_var) * (1 - m)
        kept = bn.running_var * m
        expected.append(
            (
                new_mean.clone(),
                kept + (new_var - kept) * (n / (n - 1)) if n > 1 else new_var.clone(),
            )
        )
        base = len(outputs)
        outputs += [new_mean, new_var, torch.tensor(n)]
        updates += [
            BufferUpdate(base, bn, "running_mean"),
            BufferUpdate(base + 1, bn, "running_var", base + 2, m),
        ]
    kept_before = kept_variances(updates)
    if aliased:  # as the CPU engine does: its BatchNorm updates its feeds in place
        for bn, base in zip(layers, (0, 3), strict=True):
            bn.running_mean.copy_(outputs[base])
            bn.running_var.copy_(outputs[base + 1])
            outputs[base], outputs[base + 1] = bn.running_mean, bn.running_var
    apply_buffer_updates(updates, outputs, kept_before)
    for bn, (mean, var) in zip(layers, expected, strict=True):
        assert torch.equal(bn.running_mean, mean)
        assert torch.equal(bn.running_var, var)
        assert int(bn.num_batches_tracked) == 1
