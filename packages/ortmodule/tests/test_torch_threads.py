"""ORTMODULE_TORCH_THREADS_IN_ENGINE: PyTorch's thread count while the engine runs PyTorch code.

The engine calls back into PyTorch for ATen nodes and custom autograd Functions; those calls run
with the option's thread count, and PyTorch's own setting is back once the run returns. Graphs
without such nodes leave PyTorch's setting alone.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ortmodule import ORTModule
from ortmodule_exporter.aten.parallel import TorchThreadsInEngine


class _SeesThreads(torch.autograd.Function):
    """Identity that records PyTorch's thread count each time its forward or backward runs."""

    seen: list[tuple[str, int]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        _SeesThreads.seen.append(("forward", torch.get_num_threads()))
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _SeesThreads.seen.append(("backward", torch.get_num_threads()))
        return grad


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SeesThreads.apply(self.linear(x))


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    _SeesThreads.seen.clear()
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _steps(model: torch.nn.Module, n: int = 2) -> None:
    for _ in range(n):
        model(torch.randn(3, 4)).sum().backward()


@pytest.mark.usefixtures("two_threads")
def test_pytorch_code_in_the_engine_runs_on_one_thread_and_the_setting_comes_back() -> None:
    model = ORTModule(_Net())
    _steps(model)
    # the export traced the Function once in eager (2 threads); every engine run saw 1
    engine_runs = _SeesThreads.seen[-4:]
    assert engine_runs == [("forward", 1), ("backward", 1)] * 2
    assert torch.get_num_threads() == 2


@pytest.mark.usefixtures("two_threads")
def test_zero_keeps_pytorchs_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_TORCH_THREADS_IN_ENGINE", "0")
    model = ORTModule(_Net())
    _steps(model)
    assert _SeesThreads.seen[-4:] == [("forward", 2), ("backward", 2)] * 2


def test_a_failing_run_restores_the_setting() -> None:
    before = torch.get_num_threads()
    threads = TorchThreadsInEngine(before + 1)
    with pytest.raises(RuntimeError, match="engine failed"), threads:
        assert torch.get_num_threads() == before + 1
        raise RuntimeError("engine failed")
    assert torch.get_num_threads() == before


def test_nested_runs_restore_in_order() -> None:
    before = torch.get_num_threads()
    threads = TorchThreadsInEngine(before + 1)
    with threads:
        with threads:  # a Function that calls the same model again
            assert torch.get_num_threads() == before + 1
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before


def test_graphs_without_pytorch_nodes_leave_the_setting_alone() -> None:
    model = ORTModule(torch.nn.Linear(4, 4))
    _steps(model)
    (graph,) = [value for _key, value in model._runner.transitions._slots.values()]
    assert graph.session._threads.threads == 0


def _gpt_steps(
    monkeypatch: pytest.MonkeyPatch, cut: bool
) -> tuple[list[float], list[torch.Tensor]]:
    from ortmodule_exporter.aten import parallel
    from ortmodule_testing.zoo import GPTConfig, GPTDecoder

    size = 0 if cut else 1 << 62
    monkeypatch.setattr(parallel, "MIN_ATTENTION_WORK", size)
    monkeypatch.setattr(parallel, "MIN_ELEMENTWISE", size)
    torch.manual_seed(0)
    model = ORTModule(GPTDecoder(GPTConfig.small()))
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss, _logits = model(ids, labels=ids.clone())
        loss.backward()
        losses.append(loss.item())
    return losses, [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.usefixtures("two_threads")
def test_attention_and_gelu_run_in_pieces_with_the_same_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ortmodule_exporter.aten import parallel

    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "TORCH")  # GELU in PyTorch at any size
    counts: list[int] = []
    real = parallel.run_pieces
    monkeypatch.setattr(parallel, "run_pieces", lambda p: counts.append(len(p)) or real(p))
    whole = _gpt_steps(monkeypatch, cut=False)
    assert counts == []
    cut = _gpt_steps(monkeypatch, cut=True)
    # 2 layers x (attention, GELU) forward and backward, 2 steps, each in 2 pieces
    assert counts == [2] * 16
    assert cut[0] == whole[0]
    assert len(cut[1]) == len(whole[1])
    assert all(torch.equal(a, b) for a, b in zip(cut[1], whole[1], strict=True))


def test_piece_threads_do_not_stop_the_engine_context_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The release of the engine's Function contexts waits for other Python threads, which could
    be inside the engine; the piece threads never are."""
    from ortmodule_exporter.aten import parallel
    from ortmodule_exporter.python_op import runner

    assert parallel.run_pieces([lambda: 1, lambda: 2]) == [1, 2]  # the helpers exist now
    assert parallel.helper_threads() >= 1
    # this thread and the helpers alone (other tests may have left threads of their own)
    monkeypatch.setattr(threading, "active_count", lambda: 1 + parallel.helper_threads())
    monkeypatch.setattr(runner, "_LIVE", {})
    before = runner.engine_context_releases()
    assert runner.release_engine_contexts()
    assert runner.engine_context_releases() == before + 1
