"""ORTMODULE_TORCH_THREADS_IN_ENGINE: PyTorch's thread count while the engine runs PyTorch code.

The engine calls back into PyTorch for ATen nodes and custom autograd Functions; those calls run
with the option's thread count, and PyTorch's own setting is back once the run returns. Graphs
without such nodes leave PyTorch's setting alone. ``AUTO`` (the default) measures per graph
which of 1 and PyTorch's count makes the step faster.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ortmodule import ORTModule
from ortmodule_exporter.aten.parallel import ThreadTrial, TorchThreadsInEngine


class _SeesThreads(torch.autograd.Function):
    """Identity that records PyTorch's thread count each time its forward or backward runs."""

    seen: list[tuple[str, int]] = []
    #: seconds the forward sleeps when it runs at this thread count (a slow setting)
    slow_at: tuple[int, float] = (0, 0.0)

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        threads = torch.get_num_threads()
        _SeesThreads.seen.append(("forward", threads))
        if threads == _SeesThreads.slow_at[0]:
            time.sleep(_SeesThreads.slow_at[1])
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
        _SeesThreads.slow_at = (0, 0.0)


def _steps(model: torch.nn.Module, n: int = 2) -> None:
    for _ in range(n):
        model(torch.randn(3, 4)).sum().backward()


@pytest.mark.usefixtures("two_threads")
def test_pytorch_code_in_the_engine_runs_on_one_thread_and_the_setting_comes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ORTMODULE_TORCH_THREADS_IN_ENGINE", "1")
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


def _forward_threads() -> list[int]:
    return [threads for phase, threads in _SeesThreads.seen if phase == "forward"]


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize(("slow", "kept"), [(2, 1), (1, 2)])
def test_auto_keeps_the_thread_count_whose_steps_were_faster(slow: int, kept: int) -> None:
    """The default measures the graph's engine runs: 2 warm-up steps at 1 thread, then 1 and
    PyTorch's 2 take turns for 5 steps each; the faster stays, for forward and backward."""
    _SeesThreads.slow_at = (slow, 0.02)
    model = ORTModule(_Net())
    trial = ThreadTrial.WARMUP + 2 * ThreadTrial.ROUNDS
    _steps(model, trial + 3)
    seen = _forward_threads()[-(trial + 3) :]
    assert seen[: ThreadTrial.WARMUP] == [1] * ThreadTrial.WARMUP
    assert seen[ThreadTrial.WARMUP : trial] == [1, 2] * ThreadTrial.ROUNDS
    assert seen[trial:] == [kept] * 3
    assert _SeesThreads.seen[-2:] == [("forward", kept), ("backward", kept)]
    assert torch.get_num_threads() == 2
    (graph,) = [value for _key, value in model._runner.transitions._slots.values()]
    assert graph.session._trial is None  # decided: nothing more is timed


@pytest.mark.usefixtures("two_threads")
def test_auto_measures_an_inference_graph_too() -> None:
    """Without gradients the engine runs the inference graph; each forward is a step."""
    _SeesThreads.slow_at = (1, 0.02)
    model = ORTModule(_Net()).eval()
    trial = ThreadTrial.WARMUP + 2 * ThreadTrial.ROUNDS
    with torch.no_grad():
        for _ in range(trial + 2):
            model(torch.randn(3, 4))
    seen = _forward_threads()[-(trial + 2) :]
    assert seen[ThreadTrial.WARMUP : trial] == [1, 2] * ThreadTrial.ROUNDS
    assert seen[trial:] == [2, 2]
    assert torch.get_num_threads() == 2


@pytest.mark.usefixtures("two_threads")
def test_auto_under_deterministic_algorithms_stays_at_one_thread() -> None:
    """A choice made by timing could differ between two runs, and the thread count changes
    how PyTorch's kernels sum: deterministic runs keep 1 thread, measured or not."""
    _SeesThreads.slow_at = (1, 0.02)  # the trial would pick PyTorch's 2
    torch.use_deterministic_algorithms(True)
    try:
        model = ORTModule(_Net())
        _steps(model, ThreadTrial.WARMUP + 2 * ThreadTrial.ROUNDS + 2)
    finally:
        torch.use_deterministic_algorithms(False)
    assert set(_forward_threads()[1:]) == {1}  # the first forward is the export's, in eager
    (graph,) = [value for _key, value in model._runner.transitions._slots.values()]
    assert graph.session._trial is None


@pytest.mark.usefixtures("two_threads")
def test_auto_with_one_pytorch_thread_has_nothing_to_measure() -> None:
    torch.set_num_threads(1)
    model = ORTModule(_Net())
    _steps(model, 3)
    (graph,) = [value for _key, value in model._runner.transitions._slots.values()]
    assert graph.session._trial is None
    assert graph.session._threads.threads == 1


def test_thread_trial_schedule_and_choice() -> None:
    trial = ThreadTrial("graph")
    picked = []
    # a step's engine runs take 3 s at 1 thread, 2 s at PyTorch's count (one outlier of 9 s);
    # the forward and the backward are added into one sample
    for step in range(ThreadTrial.WARMUP + 2 * ThreadTrial.ROUNDS + 2):
        setting = trial.next()
        picked.append(setting.threads)
        seconds = 9.0 if step == ThreadTrial.WARMUP + 1 else (3.0 if setting.threads == 1 else 2.0)
        trial.add(seconds / 2)
        trial.add(seconds / 2)
    assert picked[: ThreadTrial.WARMUP] == [1] * ThreadTrial.WARMUP
    assert picked[ThreadTrial.WARMUP : -2] == [1, 0] * ThreadTrial.ROUNDS
    assert trial.chosen is trial.candidates[1]
    assert picked[-2:] == [0, 0]


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
def test_attention_gelu_and_the_loss_run_in_pieces_with_the_same_bits(
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
    # 2 layers x (attention, GELU) forward and backward, and the loss (the cross-entropy
    # route) forward and backward, 2 steps, each in 2 pieces
    assert counts == [2] * 20
    assert cut[0] == whole[0]
    assert len(cut[1]) == len(whole[1])
    assert all(torch.equal(a, b) for a, b in zip(cut[1], whole[1], strict=True))


def test_only_threads_inside_the_engine_stop_the_engine_context_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The release of the engine's Function contexts waits for another thread inside an engine
    call, which may have filed a context there; the piece threads and threads that never enter
    the engine (a progress bar's monitor) do not hold it back. Counting every live thread, as
    before, left a dropped forward's saved tensors in the pool for good once such a thread
    lived (tqdm's monitor, started by a torch_export test, did it in this suite)."""
    from ortmodule_exporter.aten import parallel
    from ortmodule_exporter.python_op import runner

    assert parallel.run_pieces([lambda: 1, lambda: 2]) == [1, 2]  # the helpers exist now
    monkeypatch.setattr(runner, "_LIVE", {})
    idle, inside, entered = threading.Event(), threading.Event(), threading.Event()

    def in_an_engine_call() -> None:
        with runner.in_engine():
            entered.set()
            inside.wait()

    bystander = threading.Thread(target=idle.wait)
    bystander.start()
    try:
        before = runner.engine_context_releases()
        assert runner.release_engine_contexts()
        assert runner.engine_context_releases() == before + 1
        caller = threading.Thread(target=in_an_engine_call)
        caller.start()
        entered.wait()
        try:
            assert not runner.release_engine_contexts()
            with runner.in_engine():  # held back still: the other thread is inside one
                assert not runner.release_engine_contexts()
        finally:
            inside.set()
            caller.join()
        with runner.in_engine():
            assert runner.release_engine_contexts()
    finally:
        idle.set()
        bystander.join()
