"""What a trace cannot see: Python values taken from tensors, in-place writes, global state.

Each case gave a result different from eager with no error before guards, written-state
outputs and the trace state in the graph key. Every comparison is against eager on the same
inputs, with fallback disabled (conftest) unless a test sets the policy itself.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch

from ortmodule import ORTModule
from ortmodule_exporter import GuardError


def _pair(cls: type[torch.nn.Module]) -> tuple[torch.nn.Module, ORTModule]:
    torch.manual_seed(0)
    eager = cls()
    return eager, ORTModule(copy.deepcopy(eager))


def _step(eager: torch.nn.Module, wrapped: ORTModule, x: torch.Tensor) -> None:
    """One forward and backward in both; losses and every gradient equal."""
    want = eager(x.clone())
    got = wrapped(x.clone())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    want.backward()
    got.backward()
    for (name, p), (_, q) in zip(
        eager.named_parameters(), wrapped.module.named_parameters(), strict=True
    ):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
        p.grad = None
        q.grad = None


class Branch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:
            return (y * 2).sum()
        return (y * -3).pow(2).sum()


def _signed(sign: float) -> torch.Tensor:
    torch.manual_seed(1)
    return sign * (torch.rand(3, 4) + 2.0)


def test_data_dependent_branch_follows_eager_and_reuses_graphs() -> None:
    eager, wrapped = _pair(Branch)
    with torch.no_grad():  # make the branch follow the input's sign
        eager.lin.weight.copy_(torch.eye(4))
        wrapped.module.lin.weight.copy_(torch.eye(4))
    for sign in (1.0, -1.0, 1.0, -1.0, -1.0):
        _step(eager, wrapped, _signed(sign))
    runner = wrapped._runner
    # one graph per branch; going back to a branch takes its graph again, no third export
    assert runner.exports == 2
    assert runner.transitions.builds == 2


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum() * float(self.scale)


def test_python_float_that_does_not_change_trains() -> None:
    eager, wrapped = _pair(Scaled)
    for seed in range(3):
        torch.manual_seed(seed)
        _step(eager, wrapped, torch.randn(3, 4))
    assert wrapped._runner.exports == 1


class FloatOfData(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum() * float(x.abs().max())


def test_python_float_of_data_is_an_error_naming_the_line() -> None:
    eager, wrapped = _pair(FloatOfData)
    _step(eager, wrapped, torch.ones(2, 4))
    with pytest.raises(GuardError, match=r"float\(\) at .*test_guards.py:\d+: .*float\(x.abs"):
        wrapped(torch.ones(2, 4) * 3)


def test_python_float_of_data_falls_back_under_the_default_policy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY")
    eager, wrapped = _pair(FloatOfData)
    _step(eager, wrapped, torch.ones(2, 4))
    with pytest.warns(UserWarning, match="float"):
        _step(eager, wrapped, torch.ones(2, 4) * 3)
    _step(eager, wrapped, torch.ones(2, 4) * 5)  # in PyTorch from now on, as eager


class CountPositive(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int((x > 0).sum())
        return self.lin(x).sum() * n + n


def test_python_int_of_data_builds_a_graph_per_value() -> None:
    eager, wrapped = _pair(CountPositive)
    base = -torch.ones(2, 4)
    for positives in (1, 3, 1, 3):
        x = base.clone()
        x.view(-1)[:positives] = 1.0
        _step(eager, wrapped, x)
    assert wrapped._runner.exports == 2


def test_a_value_that_keeps_changing_stops_with_an_error() -> None:
    from ortmodule.execution import GUARDED_GRAPHS_PER_KEY

    eager, wrapped = _pair(CountPositive)
    base = -torch.ones(3, 4)
    with pytest.raises(GuardError, match="keeps changing"):
        for positives in range(GUARDED_GRAPHS_PER_KEY + 2):
            x = base.clone()
            x.view(-1)[:positives] = 1.0
            _step(eager, wrapped, x)
    assert wrapped._runner.exports == GUARDED_GRAPHS_PER_KEY


class IterateRows(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(self.lin(row).sum() for row in x)


def test_tracer_warnings_reach_the_user_with_the_line(caplog: pytest.LogCaptureFixture) -> None:
    eager, wrapped = _pair(IterateRows)
    with caplog.at_level(logging.WARNING, logger="ortmodule"):
        _step(eager, wrapped, torch.randn(3, 4))
    text = caplog.text
    assert "may not follow the Python at" in text
    assert "test_guards.py" in text and "Iterating over a tensor" in text


class Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.lin(x).sum() * self.count


@pytest.mark.parametrize("level", ["0", "1"])
def test_buffer_written_in_place_is_written_every_call(
    monkeypatch: pytest.MonkeyPatch, level: str
) -> None:
    """At recompute level 1 the engine's backward recomputed ``count + 1`` from the count fed
    to the forward, which the write-back had already changed: gradients 2, 3/2 and 4/3 times
    eager's. A written buffer is fed as a copy."""
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", level)
    eager, wrapped = _pair(Counter)
    for seed in range(3):
        torch.manual_seed(seed)
        _step(eager, wrapped, torch.randn(3, 4))
    assert float(wrapped.module.count) == float(eager.count) == 3.0
    wrapped.eval()
    eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(wrapped(torch.ones(1, 4)), eager(torch.ones(1, 4)))
    assert float(wrapped.module.count) == 4.0


class RangeTracker(torch.nn.Module):
    """I-BERT's QuantAct: the forward gives a buffer a new tensor (``self.x_min = ...``)
    instead of writing into it, and picks the update by the buffer's value."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("x_min", torch.zeros(1))
        self.register_buffer("x_max", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        low, high = y.detach().min(), y.detach().max()
        if self.x_min.min() > -1e-5 and self.x_max.max() < 1e-5:
            self.x_min = self.x_min + low
            self.x_max = self.x_max + high
        else:
            self.x_min = self.x_min * 0.9 + low * 0.1
            self.x_max = torch.max(self.x_max, high)
        return ((y - self.x_min) * (self.x_max - y)).sum()


def test_buffer_given_a_new_tensor_is_updated_every_call() -> None:
    # before: the trace saw no in-place write, the buffers kept their first value and every
    # later step took the first branch again (silently wrong ranges and outputs)
    eager, wrapped = _pair(RangeTracker)
    buffers = [wrapped.module.x_min, wrapped.module.x_max]
    for seed in range(4):
        torch.manual_seed(seed)
        _step(eager, wrapped, torch.randn(3, 4))
        torch.testing.assert_close(wrapped.module.x_min, eager.x_min)
        torch.testing.assert_close(wrapped.module.x_max, eager.x_max)
    # the new values went into the module's own buffers (the engine's feeds)
    assert [wrapped.module.x_min, wrapped.module.x_max] == buffers
    assert not wrapped.module.x_min.requires_grad


class Regrow(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.seen = torch.cat([self.seen, y.detach().sum().reshape(1)])
        return y.sum()


def test_buffer_given_a_tensor_of_another_shape_is_refused() -> None:
    from ortmodule_exporter import ExportError

    wrapped = ORTModule(Regrow())
    with pytest.raises(ExportError, match="buffer 'seen'.*shape"):
        wrapped(torch.randn(3, 4))


class ScaleByData(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return (y * y.data.abs().mean()).sum()


def test_tensor_data_is_traced_not_a_constant() -> None:
    # the tracer does not record .data: what is computed from it was the traced call's value,
    # a constant, on every later call (I-BERT's activation ranges, x.data.min())
    eager, wrapped = _pair(ScaleByData)
    for seed in range(3):
        torch.manual_seed(seed)
        _step(eager, wrapped, torch.randn(3, 4))


class AddToInput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return self.lin(x).sum()


def test_input_written_in_place_is_written_every_call() -> None:
    eager, wrapped = _pair(AddToInput)
    for seed in range(3):
        torch.manual_seed(seed)
        x = torch.randn(3, 4)
        x_eager, x_wrapped = x.clone(), x.clone()
        want, got = eager(x_eager), wrapped(x_wrapped)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(x_wrapped, x_eager)  # written once, as eager writes it
        torch.testing.assert_close(x_wrapped, x + 1)


def test_input_written_in_place_that_requires_grad_is_refused() -> None:
    from ortmodule_exporter import ExportError

    wrapped = ORTModule(AddToInput())
    x = torch.randn(3, 4, requires_grad=True).clone()
    with pytest.raises(ExportError, match="writes in place to its input 'input.x'"):
        wrapped(x)


class Deterministic(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if torch.are_deterministic_algorithms_enabled():
            y = y * 2
        return y.sum()


def test_global_state_the_trace_reads_is_part_of_the_key() -> None:
    eager, wrapped = _pair(Deterministic)
    x = torch.randn(3, 4)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        for flag in (False, True, False):
            torch.use_deterministic_algorithms(flag)
            _step(eager, wrapped, x)
    finally:
        torch.use_deterministic_algorithms(before)
    # each value exports once: the graph left for another trace state is kept, and going back
    # to the flag's first value switches to it
    assert wrapped._runner.exports == 2


def test_autocast_entered_after_the_first_call_is_not_the_float32_graph() -> None:
    eager, wrapped = _pair(Deterministic)
    x = torch.randn(3, 4)
    wrapped(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = eager(x)
        got = wrapped(x)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)


class LoopOverSequence(torch.nn.Module):
    """A Python loop over a traced size: ``range`` bakes the length into the trace."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = torch.zeros_like(x[:, 0])
        outs = []
        for i in range(x.shape[1]):
            state = torch.tanh(self.lin(x[:, i]) + state)
            outs.append(state)
        return torch.stack(outs, dim=1).pow(2).sum()


def test_size_turned_into_a_python_int_is_checked_before_the_run() -> None:
    eager, wrapped = _pair(LoopOverSequence)
    for length in (3, 5, 3, 5):
        torch.manual_seed(length)
        _step(eager, wrapped, torch.randn(2, length, 4))
    graph = wrapped._runner.transitions.current(True, True)
    assert graph is not None and graph.shape_guards and not graph.guards
    assert wrapped._runner.exports == 2  # one per length, each found again
    _step(eager, wrapped, torch.randn(7, 3, 4))  # a new batch size keeps the graph
    assert wrapped._runner.exports == 2


class SliceByLength(torch.nn.Module):
    """A buffer sliced by the input's length (CLIP's ``position_ids[:, :seq_length]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("positions", torch.linspace(0, 1, 16)[None, :, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        return (self.lin(x) * self.positions[:, :length]).pow(2).sum()


def test_a_size_used_as_a_slice_bound_follows_the_input_without_a_guard() -> None:
    # the tracer keeps a tensor slice bound as a graph value: one graph serves every length
    eager, wrapped = _pair(SliceByLength)
    for length in (3, 5, 9, 3):
        torch.manual_seed(length)
        _step(eager, wrapped, torch.randn(2, length, 4))
    assert wrapped._runner.exports == 1, wrapped._runner.transitions.history


class LoopOverAnIntermediatesDim(torch.nn.Module):
    """A loop over a dim of an intermediate whose size shape inference cannot name: its guard
    is read after the run, and on a smaller size the run fails in a Gather first (fuzzer seed
    40093)."""

    def __init__(self) -> None:
        super().__init__()
        self.p0 = torch.nn.Parameter(torch.tensor([0.3]))
        self.p1 = torch.nn.Parameter(torch.tensor([-0.4]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.where(self.p0 > 0, self.p0, x[-2])
        h = torch.zeros_like(t.select(1, 0))
        steps = []
        for i in range(t.shape[1]):
            h = torch.tanh(h * self.p1 + t.select(1, i))
            steps.append(h)
        return torch.stack(steps, dim=1).sum()


def test_a_run_that_fails_before_its_guards_exports_for_the_call() -> None:
    eager, wrapped = _pair(LoopOverAnIntermediatesDim)
    for size in (3, 4, 2):
        torch.manual_seed(size)
        _step(eager, wrapped, torch.randn(4, 6, size))


class ExpertLoop(torch.nn.Module):
    """Mixtral's eager experts in small: a loop over the experts a batch hit (``nonzero``, a
    count of data that the trace bakes into a Split) with a branch on each expert (a guard)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert = x[:, 0].detach().long().clamp(0, 2)
        hit = (torch.nn.functional.one_hot(expert, 3).sum(0) > 0).nonzero()
        out = torch.zeros_like(x[:, 0])
        for e in hit:
            e = e[0]
            if e == 2:
                continue
            rows = torch.where(expert == e)[0]
            out = out.index_add(0, rows, (x[rows] * self.w[e]).sum(1))
        return out.square().sum()


def test_a_run_that_fails_on_a_baked_count_takes_the_graph_built_for_that_count() -> None:
    eager, wrapped = _pair(ExpertLoop)

    def routed(*experts: int) -> torch.Tensor:
        x = torch.randn(len(experts), 4)
        x[:, 0] = torch.tensor(experts, dtype=torch.float)
        return x

    for experts in ((0, 1, 1), (2, 0, 1, 0), (1, 0, 0), (0, 2, 1)):
        _step(eager, wrapped, routed(*experts))
    # one graph per count of experts hit: the third and fourth calls failed in the other
    # graph's Split and ran on the one built for their count (once, each was exported again)
    assert wrapped._runner.exports == 2


class LabelsForSelectedRows(torch.nn.Module):
    """CLIP-like labels ``arange(len(rows))`` for rows picked by a data mask: no shape
    inference can name the count, so its guard is read after the run, and on another count the
    run fails first (in SoftmaxCrossEntropyLoss)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.lin(x[x[:, 0] > 0])
        labels = torch.arange(len(rows)) % 8
        return torch.nn.functional.cross_entropy(rows, labels)


def test_a_failed_run_finds_the_graph_an_earlier_count_built() -> None:
    eager, wrapped = _pair(LabelsForSelectedRows)
    for count in (4, 3, 4, 3):  # a count that comes back runs the graph built for it
        x = torch.randn(6, 4)
        x[:, 0] = torch.tensor([1.0] * count + [-1.0] * (6 - count))
        _step(eager, wrapped, x)
    assert wrapped._runner.exports == 2, wrapped._runner.transitions.history


class LabelsForGatheredRows(torch.nn.Module):
    """CLIP's pooling and loss: one row per sequence gathered with ``arange`` (ONNX's shape
    inference loses the count there), then labels ``arange(len(rows))``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.lin(x[torch.arange(x.shape[0]), x[:, :, 0].argmax(-1)])
        return torch.nn.functional.cross_entropy(rows, torch.arange(len(rows)) % 8)


def test_a_count_of_gathered_rows_is_checked_from_the_input_shapes() -> None:
    torch.manual_seed(0)
    eager = LabelsForGatheredRows()
    wrapped = ORTModule(copy.deepcopy(eager))
    for batch in (4, 3, 4):
        x = torch.randn(batch, 5, 4)
        want, got = eager(x), wrapped(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        want.backward()
        got.backward()
        for p, q in zip(eager.parameters(), wrapped.module.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5)
            p.grad = q.grad = None
    graph = wrapped._runner.transitions.current(True, True)
    # named by ONNX Runtime's symbolic shape inference: checked before the run, never a
    # failed run
    assert graph is not None and graph.shape_guards and not graph.guards
    assert wrapped._runner.exports == 2, wrapped._runner.transitions.history


class SizeOfAnUnflattenedValue(torch.nn.Module):
    """A size read from a value whose shape ONNX inference cannot work out (``unflatten`` writes
    a ``Reshape`` with a computed target): torch.onnx folded the traced size into a constant, and
    the slice kept the first call's length on every later call, with no error."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x).unflatten(-1, (2, 4))
        n = y.shape[1]
        return y[:, : n - 1].pow(2).sum()


def test_a_size_shape_inference_cannot_name_follows_the_input() -> None:
    eager, wrapped = _pair(SizeOfAnUnflattenedValue)
    for length in (4, 6, 3):
        torch.manual_seed(length)
        _step(eager, wrapped, torch.randn(2, length, 8))
    assert wrapped._runner.exports == 1, wrapped._runner.transitions.history


class LoopAfterRoutedLayerNorm(torch.nn.Module):
    """A loop over the size of a LayerNorm's output added to its input (a residual). With the
    LayerNorm routed to PyTorch, ONNX Runtime's symbolic shape inference knew no shape for the
    ATen node's output, merged its fresh dims into the input's at the ``Add`` and restarted from
    the first node (a pass over the graph per LayerNorm: 25 on GPT-2 small, most of its export
    time); the merged input dims counted as unsure and the guard stayed a graph output."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.norm(h) + h
        steps = [self.lin(h[:, i]) for i in range(h.shape[1])]
        return torch.stack(steps, dim=1).pow(2).sum()


def test_a_size_after_a_layer_norm_run_by_pytorch_is_checked_before_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "torch")
    eager, wrapped = _pair(LoopAfterRoutedLayerNorm)
    for length in (3, 5, 3):
        torch.manual_seed(length)
        _step(eager, wrapped, torch.randn(2, length, 4))
    graph = wrapped._runner.transitions.current(True, True)
    assert graph is not None
    model = graph.built.exported.model
    assert any(n.op_type == "ATen" for n in model.graph.node), "the LayerNorm is not routed"
    assert graph.shape_guards and not graph.guards
    assert wrapped._runner.exports == 2, wrapped._runner.transitions.history


class EncoderLayer(torch.nn.Module):
    """``nn.TransformerEncoderLayer``: its attention's ``k.view(k.shape[0], ...)`` used to
    become ``Reshape(k, [first length, ...])``, which failed on the next sequence length."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).pow(2).sum()


def test_multihead_attention_trains_on_new_sequence_lengths_and_batches() -> None:
    eager, wrapped = _pair(EncoderLayer)
    for batch, length in ((3, 12), (2, 10), (4, 7), (3, 12)):
        torch.manual_seed(length)
        _step(eager, wrapped, torch.randn(batch, length, 16))
    assert wrapped._runner.exports == 1, wrapped._runner.transitions.history


class BroadcastInput(torch.nn.Module):
    """An input with a dim of size 1 broadcast against a parameter: as a dynamic dim, the
    engine's gradient builder took it for the parameter's size, and the input's gradient read
    past its buffer (``-inf``, ``7e18``) or was wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.sigmoid(x) + self.w).pow(2).sum()


def test_the_gradient_of_an_input_broadcast_from_size_one_is_eagers() -> None:
    eager, wrapped = _pair(BroadcastInput)
    for rows in (1, 2, 1):
        torch.manual_seed(rows)
        x = torch.randn(rows, 6)
        want, got = x.clone().requires_grad_(), x.clone().requires_grad_()
        eager(want).backward()
        wrapped(got).backward()
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(wrapped.module.w.grad, eager.w.grad, rtol=1e-5, atol=1e-6)
        eager.w.grad = wrapped.module.w.grad = None
    assert wrapped._runner.exports == 2  # one graph per pattern of size-1 dims, found again


class SignBranch(torch.nn.Module):
    """``if x.sum() > 0``: a guard on data, a graph output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return (y * 2 if bool(x.sum() > 0) else y).pow(2).sum()


@pytest.mark.parametrize(
    ("cls", "inputs"),
    [
        (SignBranch, [torch.ones(2, 4), -torch.ones(2, 4), torch.ones(2, 4)]),
        (LoopOverSequence, [torch.ones(2, 3, 4), torch.ones(2, 5, 4), torch.ones(2, 3, 4)]),
    ],
)
def test_a_cached_graph_whose_guard_fails_is_exported_again(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    cls: type[torch.nn.Module],
    inputs: list[torch.Tensor],
) -> None:
    # guarded graphs are kept in the export cache; the entry's key does not hold the guards'
    # values, so a graph for a new value must not come from it (it would fail the same guard)
    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path / "cache"))
    for process in range(2):  # the second as a warm start on the first's cache
        eager, wrapped = _pair(cls)
        for x in inputs:
            _step(eager, wrapped, x)
        assert wrapped._runner.cache is not None
        assert wrapped._runner.cache.hits == process
        assert wrapped._runner.exports == 2 - process


class SplitAfterRoutedLayerNorms(torch.nn.Module):
    """``split(width)`` after a LayerNorm in each of four layers, as the zoo GPT's attention:
    the traced width is a guard output per layer but the first (whose width is the input's,
    checked from the fed shape). With the LayerNorms on PyTorch's kernel and a graph whose
    input width symbolic shape inference fixed, the engine folds every one of them into a
    constant."""

    def __init__(self, width: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(width) for _ in range(layers))
        self.lins = torch.nn.ModuleList(torch.nn.Linear(width, 2 * width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, lin in zip(self.norms, self.lins, strict=True):
            h = norm(x)
            a, b = lin(h).split(h.shape[-1], dim=-1)
            x = x + a * torch.sigmoid(b)
        return x.pow(2).sum()


def test_guards_the_engine_folds_are_dropped_in_one_probe(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    import ortmodule.execution as execution
    from ortmodule_exporter import named_dims
    from ortmodule_exporter.passes import registry

    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "TORCH")

    # The exported graph named even though inference fixes the input's width (the build
    # refuses that: a user's other width would fail the engine's input check; this test feeds
    # one width). It is how the engine came to fold these guards: until 2026-11-29 the memory
    # component had such a pass, run at ORTMODULE_LOG_LEVEL=INFO.
    def name_all(exported, _options):  # type: ignore[no-untyped-def]
        exported.model = named_dims.infer_symbolic_shapes(exported.model)

    registry.register_post_export_pass("test.name_all", name_all, order=90)
    request.addfinalizer(lambda: registry.unregister_post_export_pass("test.name_all"))
    builds: list[int] = []
    build_graph = execution.build_graph

    def counted(exported, config):  # type: ignore[no-untyped-def]
        builds.append(len(exported.guards))
        return build_graph(exported, config)

    monkeypatch.setattr(execution, "build_graph", counted)
    eager, wrapped = _pair(SplitAfterRoutedLayerNorms)
    for batch in (2, 3):
        torch.manual_seed(batch)
        _step(eager, wrapped, torch.randn(batch, 5, 16))
    assert wrapped._runner.exports == 1, wrapped._runner.transitions.history
    # the failed build, the probe that reads the engine's optimized forward graph, the build
    # without the three guards (one build per guard before: [3, 2, 1, 0])
    assert builds == [3, 3, 0], builds
