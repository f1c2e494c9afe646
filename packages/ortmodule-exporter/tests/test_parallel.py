"""PyTorch-run nodes in pieces across the engine's threads (``aten/parallel.py``).

Each piece must compute exactly what the whole node computes for its rows: every comparison
here is bitwise (``torch.equal``), against the same operator run in one call.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import pytest
import torch

from ortmodule_exporter.aten import executor, parallel
from ortmodule_exporter.aten.kernel_choice import _gelu, _gelu_backward

FLASH = "_scaled_dot_product_flash_attention_for_cpu"
FLASH_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"


@pytest.fixture
def two_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """PyTorch at two threads, as an engine run with the default option would cut in two;
    every node is large enough to cut."""
    monkeypatch.setattr(parallel, "MIN_ATTENTION_WORK", 0)
    monkeypatch.setattr(parallel, "MIN_ELEMENTWISE", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def pieces_run(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many pieces each cut node ran in."""
    counts: list[int] = []
    real = parallel.run_pieces

    def counting(pieces):  # type: ignore[no-untyped-def]
        counts.append(len(pieces))
        return real(pieces)

    monkeypatch.setattr(parallel, "run_pieces", counting)
    return counts


def _t(value: object) -> torch.Tensor:
    return torch.tensor(value)


def _attention(batch: int = 4, heads: int = 2, seq: int = 24, dim: int = 16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(batch, heads, seq, dim, generator=gen) for _ in range(3)]


MASKS = {
    "causal": None,
    "per_batch_4d": lambda b, s: torch.randn(b, 1, s, s),
    "broadcast_4d": lambda b, s: torch.randn(1, 1, s, s),
    "padding_per_batch": lambda b, s: torch.where(torch.rand(b, 1, 1, s) > 0.2, 0.0, -1e4),
    "two_d": lambda b, s: torch.randn(s, s),
}


def _flash_inputs(mask_name: str, batch: int = 4, seq: int = 24) -> list[torch.Tensor | None]:
    q, k, v = _attention(batch=batch, seq=seq)
    make = MASKS[mask_name]
    mask = None if make is None else make(batch, seq)
    return [q, k, v, _t(0.0), _t(make is None), mask, None]


def _forward_and_backward(inputs: list[torch.Tensor | None]) -> list[torch.Tensor]:
    out, lse = executor.call_aten(FLASH, "", inputs)
    assert out is not None and lse is not None
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    q, k, v, dropout, causal, mask, scale = inputs
    grads = executor.call_aten(
        FLASH_BACKWARD, "", [grad, q, k, v, out, lse, dropout, causal, mask, scale]
    )
    return [out, lse, *(g for g in grads if g is not None)]


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_flash_attention_in_pieces_is_bitwise_the_whole(
    mask_name: str, pieces_run: list[int]
) -> None:
    inputs = _flash_inputs(mask_name)
    whole = _forward_and_backward(inputs)
    assert not pieces_run  # outside an engine run nothing is cut
    with parallel.TorchThreadsInEngine(1):
        assert parallel.width() == 2
        cut = _forward_and_backward(inputs)
    assert pieces_run == [2, 2]
    assert len(cut) == len(whole) == 5
    for a, b in zip(cut, whole, strict=True):
        assert a.shape == b.shape
        assert torch.equal(a, b)


@pytest.mark.usefixtures("two_threads")
def test_odd_batch_and_a_batch_of_one(pieces_run: list[int]) -> None:
    for batch, expected in ((3, [2, 2]), (1, [])):
        pieces_run.clear()
        inputs = _flash_inputs("per_batch_4d", batch=batch)
        whole = _forward_and_backward(inputs)
        with parallel.TorchThreadsInEngine(1):
            cut = _forward_and_backward(inputs)
        assert pieces_run == expected
        assert all(torch.equal(a, b) for a, b in zip(cut, whole, strict=True))


@pytest.mark.usefixtures("two_threads")
def test_dropout_runs_whole(pieces_run: list[int]) -> None:
    inputs = _flash_inputs("causal")
    inputs[3] = _t(0.1)
    # PyTorch's CPU kernel refuses dropout itself; the node reached it whole
    with parallel.TorchThreadsInEngine(1), pytest.raises(RuntimeError, match="dropout"):
        executor.call_aten(FLASH, "", inputs)
    assert pieces_run == []


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("numel", [64 * 40, 64 * 40 + 37, 5])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_in_pieces_is_bitwise_the_whole(numel: int, approximate: str) -> None:
    gen = torch.Generator().manual_seed(0)
    x, grad = torch.randn(numel, generator=gen) * 3, torch.randn(numel, generator=gen)
    whole = [_gelu(approximate, [x])[0], _gelu_backward(approximate, [grad, x])[0]]
    with parallel.TorchThreadsInEngine(1):
        cut = [_gelu(approximate, [x])[0], _gelu_backward(approximate, [grad, x])[0]]
    assert all(torch.equal(a, b) for a, b in zip(cut, whole, strict=True))


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("rows", [37, 1])
def test_cross_entropy_in_pieces_is_bitwise_the_whole(
    rows: int, pieces_run: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cross-entropy route's logsumexp and gradient, cut into row pieces and worked a
    block of rows at a time, equal the rows computed in one call; ignored rows, a row with a
    +inf logit (NaN, as in eager) and a last block shorter than the others included."""
    from ortmodule_exporter.aten.kernel_choice import cross_entropy as ce

    # blocks of 4 rows of 1000 classes: 37 rows make pieces of 19 and 18, each a few blocks
    monkeypatch.setattr(ce, "_BLOCK", 4000)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, 1000, generator=gen) * 4
    target = torch.randint(0, 1000, (rows,), generator=gen)
    target[::5] = -1
    if rows > 3:
        logits[3, 7] = float("inf")
    params = torch.tensor([ce._MEAN, -1])

    def run() -> list[torch.Tensor | None]:
        loss, lse, total = ce._cross_entropy("", [logits, target, params])
        grad = ce._cross_entropy_backward(
            "", [torch.tensor(0.5), logits, lse, target, total, params]
        )
        return [loss, lse, *grad]

    top = logits.amax(1, keepdim=True)
    unblocked = torch.sub(logits, top).exp_().sum(1).log_().add_(top.squeeze(1))
    whole = run()
    assert pieces_run == []
    with parallel.TorchThreadsInEngine(1):
        cut = run()
    assert pieces_run == ([2, 2] if rows > 1 else [])
    for a, b in zip(cut, whole, strict=True):
        assert a is not None and b is not None
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
        assert torch.equal(a.isnan(), b.isnan())
    # the blocks compute each row as the one-pass form did (the route before the blocks)
    assert whole[1] is not None
    assert torch.equal(whole[1].nan_to_num(), unblocked.nan_to_num())
    if rows > 3:
        assert whole[2] is not None and whole[2][3].isnan().all()


@pytest.mark.usefixtures("two_threads")
def test_non_contiguous_elementwise_input_runs_whole(pieces_run: list[int]) -> None:
    x = torch.randn(64, 64).t()
    with parallel.TorchThreadsInEngine(1):
        (y,) = _gelu("none", [x])
    assert pieces_run == []
    assert torch.equal(y, torch.nn.functional.gelu(x))


def test_piece_boundaries_cover_the_range_once() -> None:
    for total, parts, align in ((10, 3, 1), (1000, 2, 64), (65, 2, 64), (7, 8, 1)):
        bounds = parallel._bounds(total, parts, align)
        covered = [i for a, b in bounds for i in range(a, b)]
        assert covered == list(range(total))
        assert all(a % align == 0 for a, _ in bounds)
        assert len(bounds) <= parts


def test_pieces_run_on_two_threads_and_errors_reach_the_caller() -> None:
    where: list[int] = []
    started = threading.Event()

    def first() -> str:
        where.append(threading.get_ident())
        started.set()
        return "a"

    # the caller's piece (the last) waits for the first to start: a helper must have taken it
    results = parallel.run_pieces([first, lambda: started.wait(10) and "b"])
    assert results == ["a", "b"]
    assert where and where[0] != threading.get_ident()

    def fails() -> None:
        raise ValueError("piece failed")

    for pieces in ([fails, lambda: 1], [lambda: 1, fails]):
        with pytest.raises(ValueError, match="piece failed"):
            parallel.run_pieces(pieces)
    assert parallel.run_pieces([lambda: 1, lambda: 2]) == [1, 2]  # the helpers still work


def test_a_late_helper_leaves_its_piece_to_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper that does not wake (its core taken) holds nothing up: the caller runs every
    piece, and the helper finds the job done when it does wake."""
    parallel.run_pieces([lambda: 1, lambda: 2, lambda: 3])  # two helpers exist
    held: queue.SimpleQueue[parallel._Job] = queue.SimpleQueue()
    monkeypatch.setattr(parallel, "_JOBS", held)  # the helper waits on the real queue
    where: list[int] = []
    pieces = [lambda i=i: where.append(threading.get_ident()) or i for i in range(3)]
    assert parallel.run_pieces(pieces) == [0, 1, 2]
    assert where == [threading.get_ident()] * 3
    stale = [held.get_nowait() for _ in range(2)]  # one per helper
    stale[0].run(from_end=False)  # what a late helper does: nothing is left
    assert where == [threading.get_ident()] * 3


def test_helpers_busy_with_another_caller_mean_whole() -> None:
    assert parallel._BUSY.acquire(blocking=False)
    try:
        assert parallel.run_pieces([lambda: 1, lambda: 2]) is None
    finally:
        parallel._BUSY.release()


def test_thread_count_and_width_come_back_nested_and_on_error() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threads = parallel.TorchThreadsInEngine(1)
        with pytest.raises(RuntimeError, match="engine failed"), threads:
            with threads:  # a Function that calls the model again
                assert (torch.get_num_threads(), parallel.width()) == (1, 1)
            assert (torch.get_num_threads(), parallel.width()) == (1, 2)
            raise RuntimeError("engine failed")
        assert (torch.get_num_threads(), parallel.width()) == (2, 1)
        with parallel.TorchThreadsInEngine(0):  # the option at 0: nothing changes
            assert (torch.get_num_threads(), parallel.width()) == (2, 1)
    finally:
        torch.set_num_threads(before)
