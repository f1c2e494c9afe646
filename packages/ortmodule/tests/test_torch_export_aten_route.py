"""The ATen route of ORTMODULE_EXPORTER=torch_export (``export/torch_export_aten.py``): an
operator the dynamo translator cannot lower, or lowers to ONNX the engine has no gradient for,
runs in PyTorch inside the engine and trains as eager does. Fallback is disabled (conftest)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortmodule import DebugOptions, ORTModule
from ortmodule_exporter.aten.executor import ATEN_DOMAIN
from ortmodule_testing.parity import clone_model

pytest.importorskip("onnxscript")

TORCH_EXPORT = DebugOptions(exporter="torch_export")


class _Op(nn.Module):
    def __init__(self, op: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.op = op
        self.weight = nn.Parameter(torch.randn(4, 5, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x * self.weight) * 1.5


#: operators whose torch_lib lowering the engine cannot differentiate (1.19.2: no gradient
#: builder for Atan, CumSum, ReduceMax)
NO_ENGINE_GRADIENT = {
    "atan": torch.atan,
    "cumsum": lambda t: torch.cumsum(t, 1),
    "max_dim": lambda t: torch.max(t, 1)[0],
}
#: operators the translator cannot lower: torch_lib's amax needs a dim, copysign has no
#: translation and its decomposition (prims.signbit) none either
NO_TRANSLATION = {
    "amax": lambda t: torch.amax(t) * t,
    "copysign": lambda t: torch.copysign(t, t.flip(0)),
}


class _Fn(nn.Module):
    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.fn(*xs)


def _two_steps_as_eager(model: torch.nn.Module, wrapped: ORTModule, shape: tuple[int, ...]) -> None:
    """Two steps of ``model`` and ``wrapped`` on the same inputs: outputs and input gradients."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(shape, generator=gen, requires_grad=True)
        y = x.detach().clone().requires_grad_(True)
        want, got = model(x), wrapped(y)
        want.square().sum().backward()
        got.square().sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(y.grad, x.grad, rtol=1e-4, atol=1e-5)


def _trains_as_eager(op: Callable[[torch.Tensor], torch.Tensor]) -> None:
    model = _Op(op)
    wrapped = ORTModule(_Op(op), TORCH_EXPORT)
    wrapped.load_state_dict(model.state_dict())
    _two_steps_as_eager(model, wrapped, (4, 5))
    torch.testing.assert_close(wrapped.weight.grad, model.weight.grad, rtol=1e-4, atol=1e-5)
    assert wrapped._runner.config.export_config.frontend == "torch_export"  # type: ignore[union-attr]
    # PyTorch ran it inside the engine: an ATen node, or a PythonOp running it (AtenOp)
    compiled = wrapped._runner.transitions.current(True, True)
    assert compiled is not None
    ops = {(n.domain, n.op_type) for n in compiled.built.exported.model.graph.node}
    assert (ATEN_DOMAIN, "ATen") in ops or any(op == "PythonOp" for _d, op in ops), ops


@pytest.mark.parametrize("name", sorted(NO_ENGINE_GRADIENT))
def test_op_without_engine_gradient_takes_the_aten_route(name: str) -> None:
    _trains_as_eager(NO_ENGINE_GRADIENT[name])


@pytest.mark.parametrize("name", sorted(NO_TRANSLATION))
def test_op_without_translation_takes_the_aten_route(name: str) -> None:
    _trains_as_eager(NO_TRANSLATION[name])


def test_constants_of_a_dropped_lowering_are_not_reused() -> None:
    """The translator caches the Constant nodes a lowering writes for Python values (cumsum's
    dim 1) for later lowerings to read (select's index 1): when the route drops the lowering,
    a later node must not read a constant no longer in the graph (a SerdeError at
    serialization: bamba and falcon_h1 hit it)."""
    _trains_as_eager(lambda t: torch.cumsum(t, 1)[:, 1] * t.select(1, 1))


# A torch.library custom operator with a registered autograd whose backward is not the
# derivative of its forward (round, straight-through): torch.export keeps it as one node, which
# the translator cannot lower; the engine must run it and its registered backward in PyTorch.
@torch.library.custom_op("ortmodule_test::round_ste", mutates_args=())
def _round_ste(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.round(x * scale) / scale


@_round_ste.register_fake
def _round_ste_fake(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


def _round_ste_backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad * 0.5, None


_round_ste.register_autograd(_round_ste_backward)


class _CustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.weight = nn.Parameter(torch.randn(5, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(_round_ste(x * self.weight, 4.0)) * 1.5


def test_custom_operator_trains_with_its_registered_autograd() -> None:
    """Its autograd runs as the Function GeneratedBackwardFor_ortmodule_test_round_ste_default,
    which the frontend used to refuse as a user's Function; the engine runs the operator, found
    by its qualified name, and its registered backward (a half straight-through gradient: the
    derivative of round would be zero)."""
    model = _CustomOp()
    wrapped = ORTModule(_CustomOp(), TORCH_EXPORT)
    wrapped.load_state_dict(model.state_dict())
    _two_steps_as_eager(model, wrapped, (3, 5))
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(
            wrapped.get_parameter(name).grad, parameter.grad, rtol=1e-4, atol=1e-5
        )
    assert model.weight.grad is not None and model.weight.grad.abs().sum() > 0
    compiled = wrapped._runner.transitions.current(True, True)
    assert compiled is not None
    graph = compiled.built.exported.model.graph
    assert any(n.op_type in ("ATen", "PythonOp") for n in graph.node)


class _ZeroGateRouter(nn.Module):
    """A Mixture-of-Experts router with a zero-initialized gate (AFMoE's): every expert scores
    the same, and which ones topk picks among the ties decides where each token goes."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 6, bias=False)
        nn.init.zeros_(self.gate.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(self.gate(x))
        top, picked = torch.topk(scores, k=2, dim=1)
        return top / top.sum(-1, keepdim=True) * x[:, picked[0]].sum(), picked


def test_topk_breaks_ties_as_eager() -> None:
    """ONNX TopK puts the lower index first among equal values, PyTorch's CPU kernel does not
    (indices [2, 3] of four equal scores): PyTorch runs topk."""
    model = _ZeroGateRouter()
    wrapped = ORTModule(_ZeroGateRouter(), TORCH_EXPORT)
    wrapped.load_state_dict(model.state_dict())
    x = torch.randn(5, 8)
    (want, want_picked), (got, got_picked) = model(x), wrapped(x)
    assert torch.equal(got_picked, want_picked)
    torch.testing.assert_close(got, want)
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(wrapped.gate.weight.grad, model.gate.weight.grad)


@torch.library.custom_op("ortmodule_test::scaled_in", mutates_args=())
def _scaled_in(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    assert isinstance(dtype, torch.dtype), dtype  # a dtype, not its scalar-type code
    return (x.to(dtype) * 3).to(x.dtype)


@_scaled_in.register_fake
def _scaled_in_fake(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_like(x)


_scaled_in.register_autograd(lambda ctx, grad: (grad * 3, None))


def test_custom_operator_gets_its_dtype_argument_as_a_dtype() -> None:
    """A ScalarType argument of a custom operator has the JIT type int: the executor reads it by
    its real type (OpInfo's linear_cross_entropy chunked_none passes acc_dtype)."""
    _trains_as_eager(lambda t: _scaled_in(t, torch.float64))


class _Experts(nn.Module):
    """Tokens grouped by expert with sizes read from the data (HF jetmoe's routing): torch_lib
    writes the split as SplitToSequence + SequenceAt, which the engine does not differentiate
    through (the projection before it was "unreachable")."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.pre = nn.Linear(4, 4)
        self.weight = nn.Parameter(torch.randn(3, 4, 4, generator=gen))

    def forward(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        gates = torch.zeros(x.shape[0], 3).scatter(1, expert[:, None], 1)
        sizes = gates.long().sum(0).tolist()
        _, order = expert.sort(0)
        parts = self.pre(x)[order].split(sizes, 0)
        out = torch.cat([F.linear(p, w) for p, w in zip(parts, self.weight, strict=True)], 0)
        return torch.zeros_like(x).index_add(0, order, out)


def test_split_of_sizes_from_the_data_takes_the_aten_route() -> None:
    model = _Experts()
    wrapped = ORTModule(_Experts(), TORCH_EXPORT)
    wrapped.load_state_dict(model.state_dict())
    for step, expert in enumerate(([2, 0, 1, 2, 0, 2], [1, 1, 0, 2, 2, 2])):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
        want, got = model(x, torch.tensor(expert)), wrapped(x, torch.tensor(expert))
        torch.testing.assert_close(got, want)
        want.square().sum().backward()
        got.square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), wrapped.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, msg=f"step {step}: grad of {name}")


@pytest.mark.parametrize(
    "op",
    [
        # Pad mode=edge / reflect: the engine's Pad gradient is for constant mode only; the
        # negative pad (a crop) on one side as in OpInfo's replicate_negative
        lambda t: nn.functional.pad(t, (-2, 3), mode="replicate"),
        lambda t: nn.functional.pad(t, (2, 3), mode="reflect"),
    ],
    ids=["replicate_negative", "reflect"],
)
def test_pad_in_a_mode_without_engine_gradient_takes_the_aten_route(
    op: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    _trains_as_eager(op)


class _Gumbel(nn.Module):
    """Gumbel sampling of experts (PhiMoE's router in training): ``exponential_`` noise."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.gate(x)
        noise = torch.empty_like(scores).exponential_().log()
        picked = (scores - noise).argmax(-1, keepdim=True)
        return scores.softmax(-1).gather(-1, picked)


def test_exponential_draws_from_pytorchs_generator() -> None:
    """torch_lib draws it from the engine's generator (another sample than eager's under the
    same seed); PyTorch runs it, as on the TorchScript frontend: same seed, same experts."""
    model = _Gumbel()
    wrapped = ORTModule(_Gumbel(), TORCH_EXPORT)
    wrapped.load_state_dict(model.state_dict())
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(2))
    for seed in (1, 2):
        torch.manual_seed(seed)
        want = model(x)
        torch.manual_seed(seed)
        got = wrapped(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        want.sum().backward()
        got.sum().backward()
        torch.testing.assert_close(wrapped.gate.weight.grad, model.gate.weight.grad)


# -- operators whose decomposition checks its result (with_effects) ----------------------------


def _positive_definite(t: torch.Tensor) -> torch.Tensor:
    return t @ t.mT + torch.eye(t.shape[-1])


#: operators decomposed into an ``_ex`` variant and ``_linalg_check_errors(info)``, an effectful
#: operator that the translator cannot lower (``with_effects`` and its token)
CHECKED_DECOMPOSITIONS = {
    "cholesky": lambda t: torch.linalg.cholesky(_positive_definite(t[:, :4])),
    "tensorsolve": lambda t: torch.linalg.tensorsolve(
        _positive_definite(t[:, :4]).reshape(2, 2, 4), t[:2, :2]
    ),
}


@pytest.mark.parametrize("name", sorted(CHECKED_DECOMPOSITIONS))
def test_op_decomposed_with_an_error_check_runs_whole(name: str) -> None:
    """linalg_cholesky decomposes into linalg_cholesky_ex and with_effects(token,
    aten._linalg_check_errors, info): the operator is kept whole and PyTorch runs it."""
    _trains_as_eager(CHECKED_DECOMPOSITIONS[name])


def test_error_check_of_a_decomposition_still_raises() -> None:
    """Kept whole, the check runs: a matrix that is not positive definite fails as in eager,
    not a silent result of cholesky_ex."""
    wrapped = ORTModule(_Fn(torch.linalg.cholesky), TORCH_EXPORT)
    good = _positive_definite(torch.randn(3, 3))
    torch.testing.assert_close(wrapped(good), torch.linalg.cholesky(good))
    with pytest.raises(Exception, match="positive-definite"):
        wrapped(-good)


# -- gradients the engine's CPU build cannot run, or gets wrong -------------------------------


#: the engine has a gradient builder, but its ResizeGrad and ConvTransposeGrad have no CPU kernel
#: (the session was refused); its AveragePoolGrad sizes the input's gradient from static shapes ([0, 0, 0] for a
#: dynamic [4, 5, 9] input)
ENGINE_GRADIENT_UNUSABLE = {
    "interpolate_nearest": lambda t: nn.functional.interpolate(
        t.unsqueeze(0), scale_factor=2.0, mode="nearest"
    )[0],
    "avg_pool1d": lambda t: nn.functional.avg_pool1d(t.unsqueeze(0), 2)[0],
    "avg_pool2d_ceil": lambda t: nn.functional.avg_pool2d(
        t.unsqueeze(0), 2, ceil_mode=True, count_include_pad=False, padding=1
    )[0],
    # ConvTransposeGrad is CUDA-only: the CPU session was refused
    "conv_transpose1d": lambda t: nn.functional.conv_transpose1d(
        t.unsqueeze(0), t[:, :2].unsqueeze(1) * 0.5
    )[0],
}


@pytest.mark.parametrize("name", sorted(ENGINE_GRADIENT_UNUSABLE))
def test_op_whose_engine_gradient_is_unusable_takes_the_aten_route(name: str) -> None:
    _trains_as_eager(ENGINE_GRADIENT_UNUSABLE[name])


class _BatchNormWithUpdate(nn.Module):
    """``aten._batch_norm_with_update`` (what ``F.batch_norm`` in training calls inside
    torch.export), called directly: its decomposition does not translate, so it is kept whole,
    and on CPU it writes an empty uint8 ``reserve`` beside its non-empty outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, generator=torch.Generator().manual_seed(0)))
        self.bias = nn.Parameter(torch.randn(5, generator=torch.Generator().manual_seed(1)))
        self.register_buffer("running_mean", torch.zeros(5))
        self.register_buffer("running_var", torch.ones(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, mean, invstd, _reserve = torch.ops.aten._batch_norm_with_update(
            x, self.weight, self.bias, self.running_mean, self.running_var, 0.1, 1e-5
        )
        return out * 2 + (mean * invstd).sum()


def test_aten_node_with_an_empty_integer_output_runs() -> None:
    """An ATen node's empty integer values carry no gradient: the zero-element rewrite keeps
    it (it refused the graph: "writes a zero-element tensor beside a non-empty one")."""
    model = _BatchNormWithUpdate()
    wrapped = ORTModule(_BatchNormWithUpdate(), TORCH_EXPORT)
    wrapped.load_state_dict(model.state_dict())
    _two_steps_as_eager(model, wrapped, (4, 5, 3))
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(
            wrapped.get_parameter(name).grad, parameter.grad, rtol=1e-4, atol=1e-5
        )
    for name, buffer in model.named_buffers():
        torch.testing.assert_close(wrapped.state_dict()[name], buffer, rtol=1e-4, atol=1e-5)


class _MaskedSelect(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 5, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.masked_select(x * self.weight, x > 0) * 1.5


def test_output_of_data_dependent_size() -> None:
    """masked_select's output size depends on the mask (an unbacked size for torch.export):
    the output schema leaves it dynamic instead of asking whether it is 0 or 1 (export failed:
    "Could not guard on data-dependent expression"); each step's own size comes back."""
    model = _MaskedSelect()
    wrapped = ORTModule(_MaskedSelect(), TORCH_EXPORT)
    wrapped.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(3)
    sizes = set()
    for _ in range(3):
        x = torch.randn(4, 5, generator=gen)
        want, got = model(x), wrapped(x)
        sizes.add(want.numel())
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        want.square().sum().backward()
        got.square().sum().backward()
        torch.testing.assert_close(wrapped.weight.grad, model.weight.grad, rtol=1e-4, atol=1e-5)
    assert len(sizes) > 1, sizes


@pytest.mark.parametrize(
    "embedding",
    [
        lambda: nn.Embedding(7, 3, padding_idx=0),
        lambda: nn.Embedding(7, 3, padding_idx=-2),
        lambda: nn.Embedding(7, 3, scale_grad_by_freq=True),
    ],
    ids=["padding_idx", "negative_padding_idx", "scale_grad_by_freq"],
)
def test_embedding_with_padding_or_frequency_scaling_runs_in_pytorch(
    embedding: Callable[[], nn.Embedding], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch_lib's Gather gave the padding row a gradient (eager keeps it at zero) and did not
    scale by frequency: silently wrong on the engine's own kernels."""
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "ENGINE")
    torch.manual_seed(0)
    model = embedding()
    wrapped = ORTModule(clone_model(model), TORCH_EXPORT)
    tokens = torch.tensor([[0, 1, 5, 0], [5, 5, 2, 0]])
    weights = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(3))
    for m in (model, wrapped):
        (m(tokens) * weights).sum().backward()
    torch.testing.assert_close(wrapped.module.weight.grad, model.weight.grad)


def test_registered_aten_route_runs_in_pytorch() -> None:
    """``register_aten_route`` applies on this frontend too: the operator is an ATen node
    whatever its translation (``erf`` has one, with an engine gradient)."""
    from ortmodule_exporter.aten.routes import register_aten_route
    from ortmodule_exporter.symbolics.registry import unregister_symbolic

    register_aten_route("aten::erf")
    try:
        wrapped = ORTModule(_Op(lambda t: torch.erf(t) * 2), TORCH_EXPORT)
        model = _Op(lambda t: torch.erf(t) * 2)
        wrapped.load_state_dict(model.state_dict())
        _two_steps_as_eager(model, wrapped, (4, 5))
        compiled = wrapped._runner.transitions.current(True, True)
        assert compiled is not None
        ops = {n.op_type for n in compiled.built.exported.model.graph.node}
        # PyTorch runs it: an ATen node, or the PythonOp running it (AtenOp); no ONNX Erf
        assert "Erf" not in ops and ("ATen" in ops or "PythonOp" in ops), ops
    finally:
        unregister_symbolic("aten::erf")
