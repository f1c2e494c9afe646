"""Bugs the differential fuzzer (ortmodule_testing.fuzz) found, each as its shrunk program.

Each test trains its program for the steps the fuzzer ran, in eager and under ORTModule
(fallback disabled), and compares loss, outputs and every gradient. Each failed before its
fix (named in the test's docstring).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortmodule import ORTModule
from ortmodule_testing.parity import assert_tree_close

torch.set_num_threads(1)


def _train(model: nn.Module, batches: list[torch.Tensor]) -> list[object]:
    """Loss, output and parameter gradients of each step (SGD between steps)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    records: list[object] = []
    for x in batches:
        optimizer.zero_grad(set_to_none=True)
        out = model(x)
        weights = torch.linspace(-1.0, 1.0, out.numel()).reshape(out.shape) + 0.5
        loss = (out * weights).sum()
        loss.backward()  # type: ignore[no-untyped-call]
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        records.append((loss.detach(), out.detach().clone(), grads))
        optimizer.step()
    return records


def _parity(make: type[nn.Module], batches: list[torch.Tensor]) -> None:
    torch.manual_seed(0)
    eager = _train(make(), batches)
    torch.manual_seed(0)
    got = _train(ORTModule(make()), batches)
    assert_tree_close(got, eager)


class VectorTimesBatched(nn.Module):
    """torch.matmul(v, x) with v of shape (k,) and x of shape (..., k, m): the engine's MatMul
    gradient for a 1-D left operand was wrong (fixed by ``symbolics/matmul.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.tensor([0.3, -0.5, 0.8]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self.v, x)


def test_vector_times_batched_matrix() -> None:
    g = torch.Generator().manual_seed(0)
    _parity(VectorTimesBatched, [torch.randn(2, 3, 4, generator=g) for _ in range(2)])


def test_vector_times_matrix_is_right() -> None:
    """The 2-D case of the same op is right (so the bug is the batched gradient only)."""
    g = torch.Generator().manual_seed(0)
    _parity(VectorTimesBatched, [torch.randn(3, 4, generator=g) for _ in range(2)])


class VectorTimesSlicedMatrix(nn.Module):
    """torch.matmul(v, x[:, -2:]) (fuzzer seed 4416): the graph knows no rank for the Slice's
    output, and the engine's gradient for it took the dot product of the two vectors, whose
    Reshape to (k, 2) failed in the backward (fixed by ``symbolics/matmul.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.tensor([0.3, -0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self.v, x[:, -2:])


def test_vector_times_a_sliced_matrix() -> None:
    g = torch.Generator().manual_seed(0)
    # the input's gradient is the one the engine got wrong
    batches = [torch.randn(2, 6, generator=g).requires_grad_() for _ in range(2)]
    _parity(VectorTimesSlicedMatrix, batches)
    assert all(x.grad is not None for x in batches)


class ExpandAfterStepSlice(nn.Module):
    """x[:, 1::2] of a (3, 3) input has one column; expand(-1, 2) repeats it. The engine's
    optimizer dropped the Expand (fixed by ``symbolics/expand.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 1::2].expand(-1, 2) * self.p


def test_expand_after_a_stepped_slice() -> None:
    g = torch.Generator().manual_seed(0)
    _parity(ExpandAfterStepSlice, [torch.randn(3, 3, generator=g) for _ in range(2)])


class LoopOverDim(nn.Module):
    """A Python loop over a dim whose size changes between steps (a scan): the trace replayed
    the first call's trip count (fixed by the size guards, ``export/shape_guards.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.decay = nn.Parameter(torch.tensor([0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros_like(x.select(1, 0))
        steps = []
        for i in range(x.shape[1]):
            h = torch.tanh(h * self.decay + x.select(1, i))
            steps.append(h)
        return torch.stack(steps, dim=1)


def test_loop_over_a_dim_that_grows() -> None:
    g = torch.Generator().manual_seed(0)
    _parity(LoopOverDim, [torch.randn(2, 3, 4, generator=g), torch.randn(2, 5, 4, generator=g)])


class ReturnedAndUsed(nn.Module):
    """An intermediate both returned and read by the next op of forward: the engine gave its
    buffer to a backward value (fixed by copying such outputs, ``execution._viewed_outputs``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(0.7))
        self.kind = kind

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kept = _KINDS[self.kind](x * 2.0)
        return kept * 1.5 * self.p, kept


_KINDS = {
    "unsqueeze": lambda t: t.unsqueeze(0),
    "reshape": lambda t: t.reshape(-1),
    "tril": lambda t: torch.tril(t, diagonal=1),
    "relu": torch.relu,
    "tanh": torch.tanh,
    "clamp": lambda t: t.clamp(-1.0, 1.0),
    "softmax": lambda t: t.softmax(-1),
    "log_softmax": lambda t: t.log_softmax(-1),
    "leaky_relu": torch.nn.functional.leaky_relu,
}


@pytest.mark.parametrize(
    ("kind", "shape"), [*((k, (4, 3)) for k in _KINDS), ("tril", (1, 6, 3, 1))]
)
def test_a_returned_intermediate_survives_backward(kind: str, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = ORTModule(ReturnedAndUsed(kind))
    x = torch.randn(*shape)
    out, kept = model(x)
    before = kept.detach().clone()
    weights = torch.linspace(-1.0, 1.0, kept.numel()).reshape(kept.shape)
    (out.sum() + (kept * weights).sum()).backward()  # type: ignore[no-untyped-call]
    assert_tree_close(kept.detach(), before)


class WrittenAtAnIndex(nn.Module):
    """``t = tanh(x).clone(); t[..., 0] = 0.25`` returned beside ``t * p`` (fuzz seed 45140, the
    torch_export frontend): the indexed write is a ScatterElements that may run in the buffer of
    the intermediate ``tanh(x)``, which the engine then gave to a backward value; ``t`` held
    values of 1e32 after ``backward()``. Copied since (``execution._viewed_outputs``)."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.tanh(x).clone()
        t[..., 0] = 0.25
        return t * self.p, t


@pytest.mark.parametrize("frontend", ["torchscript", "torch_export"])
def test_a_tensor_written_at_an_index_survives_backward(
    monkeypatch: pytest.MonkeyPatch, frontend: str
) -> None:
    monkeypatch.setenv("ORTMODULE_EXPORTER", frontend)
    torch.manual_seed(0)
    x = torch.randn(6, 1, 2, 2)
    eager_out, eager_t = WrittenAtAnIndex()(x)
    model = ORTModule(WrittenAtAnIndex())
    out, t = model(x)
    (out.sum() + t.sum()).backward()  # type: ignore[no-untyped-call]
    assert_tree_close((out.detach(), t.detach()), (eager_out.detach(), eager_t.detach()))


class ExpandOfAnInputThatRequiresGrad(nn.Module):
    """gelu(tanh(x)).expand(-1, 2) of a (2, 1) input that requires grad: symbolic shape
    inference took x's dynamic dim 1 for the expanded 2, the engine's builder dropped the
    reduction of x's gradient (wrong under ENGINE, a oneDNN error under AUTO). Such graphs are
    built without named dims (``GraphConfig.broadcast_grad_inputs``)."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(torch.tanh(x)).expand(-1, 2) * self.p


@pytest.mark.parametrize("log_level", ["WARNING", "INFO"])
@pytest.mark.parametrize("choice", ["AUTO", "ENGINE"])
def test_input_gradient_through_expand(
    monkeypatch: pytest.MonkeyPatch, choice: str, log_level: str
) -> None:
    """At ``ORTMODULE_LOG_LEVEL=INFO`` (and at every recompute level) the memory component's
    pass named the graph's dims regardless, and the fix above did not hold (a oneDNN error in
    the backward under ``AUTO``); that pass is gone, the build names dims under its checks."""
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", choice)
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", log_level)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 1, generator=g) for _ in range(2)]
    grads = []
    for model in (ExpandOfAnInputThatRequiresGrad(), ORTModule(ExpandOfAnInputThatRequiresGrad())):
        got = []
        for x in xs:
            x = x.clone().requires_grad_()
            out = model(x)
            (out * torch.tensor([[1.0, -2.0], [0.5, 3.0]])).sum().backward()
            got.append(x.grad)
        grads.append(got)
    assert_tree_close(grads[1], grads[0])


class GatherOfAReturnedValue(nn.Module):
    """t returned, and t[1] (or (t + 1)[1]) read inside (fuzzer seed 9091): the engine's compute
    optimiser moved the Gather above the node making t and the returned t came back gathered,
    (1, 6) for (4, 6), with no error (fixed in ``passes/engine_graph_fixes.py``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(0.7))
        self.w = nn.Parameter(torch.linspace(-1.0, 1.0, 24).reshape(4, 6))
        self.kind = kind

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "transpose":
            t = x.transpose(0, 1)
            return t[1] * self.p, t
        t = x.transpose(0, 1) @ self.w.t()  # (4, 4)
        return (t + 1.0)[1] * self.p, t


@pytest.mark.parametrize("kind", ["transpose", "matmul_then_add"])
@pytest.mark.parametrize("frontend", ["torchscript", "torch_export"])
def test_a_returned_value_read_by_a_gather(
    monkeypatch: pytest.MonkeyPatch, frontend: str, kind: str
) -> None:
    monkeypatch.setenv("ORTMODULE_EXPORTER", frontend)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(6, 4, generator=g) for _ in range(2)]
    records = []
    for model in (GatherOfAReturnedValue(kind), ORTModule(GatherOfAReturnedValue(kind))):
        got = []
        for x in xs:
            model.zero_grad(set_to_none=True)
            out, t = model(x)
            weights = torch.linspace(-1.0, 1.0, t.numel()).reshape(t.shape)
            (out.sum() + (t * weights).sum()).backward()
            got.append((out.detach(), t.detach(), [p.grad for p in model.parameters()]))
        records.append(got)
    assert_tree_close(records[1], records[0])


class SelectReadTwice(nn.Module):
    """``t.select(3, 0)`` read twice, ``t`` a matrix product (fuzzer seed 42065): the engine's
    compute optimiser moved the rank-dropping Gather above the MatMul and handed one reader the
    unsqueezed value: (2, 2, 1, 1) for (2, 1, 1), wrong gradients, no error (fixed in
    ``passes/engine_graph_fixes.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor([0.3, -0.8]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t1 = torch.matmul(self.p, x)  # (2, 1, 1, 1)
        t = torch.matmul(t1, t1.transpose(-1, -2))
        return torch.tanh(torch.zeros_like(t.select(3, 0)) * self.p[0] + t.select(3, 0))


@pytest.mark.parametrize("level", ["0", "1"])
@pytest.mark.parametrize("frontend", ["torchscript", "torch_export"])
def test_a_selected_value_read_twice(
    monkeypatch: pytest.MonkeyPatch, frontend: str, level: str
) -> None:
    """At recompute level 1 on torch_export the session was refused: nodes without a name,
    recomputed, were all named ``_recompute`` (``onnx_graph.name_unnamed_nodes``)."""
    monkeypatch.setenv("ORTMODULE_EXPORTER", frontend)
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", level)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 1, 1, 2, 1, generator=g) for _ in range(2)]
    records = []
    for model in (SelectReadTwice(), ORTModule(SelectReadTwice())):
        got = []
        for x in xs:
            model.zero_grad(set_to_none=True)
            x = x.clone().requires_grad_()
            out = model(x)
            (out * torch.linspace(-1.0, 1.0, out.numel()).reshape(out.shape)).sum().backward()
            got.append((out.detach(), x.grad, [p.grad for p in model.parameters()]))
        records.append(got)
    assert_tree_close(records[1], records[0])


class SoftplusOfSizeOne(nn.Module):
    """``softplus`` of a parameter of shape (1,) and of one of shape (3, 1), times a batch: the
    engine has no ``Softplus`` gradient, so the op is PyTorch's (an ATen node), whose output dims
    the exporter could only name or leave unknown; the build failed (``GetShape(input_grad)``).
    Fixed by declaring the traced sizes where they cannot change
    (``passes/aten_nodes._fix_static_sizes``)."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor([0.4]))
        self.q = nn.Parameter(torch.tensor([[0.2], [-0.7], [1.1]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softplus(self.p) * x + F.softplus(self.q) * x


def test_softplus_of_a_size_one_parameter_times_a_batch() -> None:
    g = torch.Generator().manual_seed(0)
    _parity(SoftplusOfSizeOne, [torch.randn(3, 5, generator=g) for _ in range(2)])


@pytest.mark.parametrize("frontend", ["torchscript", "torch_export"])
def test_softplus_of_a_size_one_input_times_a_batch(
    monkeypatch: pytest.MonkeyPatch, frontend: str
) -> None:
    """Seed 49409: ``softplus(x1) * x0``, ``x1`` of shape (1,) requiring grad, ``x0`` of shape
    (4, 1, 2). The engine took the softplus output's named dim for equal to ``x0``'s last one
    and did not reduce ``x1``'s gradient over it (a Reshape error in the backward: "Input
    shape:{1,1,2}, requested shape:{1}"). Fixed as above."""
    monkeypatch.setenv("ORTMODULE_EXPORTER", frontend)

    class Program(nn.Module):
        def forward(self, x0: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
            return F.softplus(x1) * x0

    g = torch.Generator().manual_seed(49409)
    batches = [(torch.randn(4, 1, 2, generator=g), torch.randn(1, generator=g)) for _ in range(3)]
    records = []
    for model in (Program(), ORTModule(Program())):
        got = []
        for x0, x1 in batches:
            x1 = x1.clone().requires_grad_()
            out = model(x0, x1)
            (out * torch.linspace(-1.0, 1.0, out.numel()).reshape(out.shape)).sum().backward()
            got.append((out.detach(), x1.grad))
        records.append(got)
    assert_tree_close(records[1], records[0])
