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
