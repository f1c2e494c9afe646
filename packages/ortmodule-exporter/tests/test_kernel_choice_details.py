"""Kernel-choice details: max pooling on a channels-last copy (the same values and indices
as on the input as is), and CPU timings kept to CPU exports."""

from __future__ import annotations

import pytest
import torch

from ortmodule_exporter.aten import kernel_choice
from ortmodule_exporter.aten.kernel_choice import (
    CHANNELS_LAST,
    _max_pool2d,
    max_pool,
    pool_layout,
    traced,
)

SETTINGS = [
    # kernel, stride, padding, dilation, ceil_mode
    ((2, 2), (2, 2), (0, 0), (1, 1), False),
    ((3, 3), (2, 2), (1, 1), (1, 1), True),
    ((3, 3), (1, 1), (1, 1), (2, 2), False),
]


def _inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    plain = torch.randn(2, 5, 9, 11, generator=gen)
    ties = torch.randint(0, 3, (2, 5, 9, 11), generator=gen).float()  # many equal maxima
    nan = plain.clone()
    nan[0, 1, 0, :3] = float("nan")  # NaN is the maximum; two in one window
    nan[1, 4, 5, 5] = float("nan")
    return {"plain": plain, "ties": ties, "nan": nan}


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("name", ["plain", "ties", "nan"])
def test_channels_last_copy_gives_the_same_values_and_indices(
    settings: tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int], bool],
    name: str,
) -> None:
    x = _inputs()[name]
    kernel, stride, padding, dilation, ceil_mode = settings
    params = torch.tensor([*kernel, *stride, *padding, *dilation, int(ceil_mode)])
    as_is = _max_pool2d("", [x, params])
    copied = _max_pool2d(CHANNELS_LAST, [x, params])
    for a, b in zip(as_is, copied, strict=True):
        assert a is not None and b is not None
        assert b.is_contiguous()  # the engine takes the results as they are
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())


def test_the_layout_is_timed_once_per_shape_and_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    real = max_pool._torch_us

    def counting(fn: object, aten_nodes: int = 2) -> float:
        calls.append(fn)
        return real(fn, aten_nodes)  # type: ignore[arg-type]

    # pool_layout reads both from its own module
    monkeypatch.setattr(max_pool, "_torch_us", counting)
    monkeypatch.setattr(max_pool, "_POOL_LAYOUTS", {})
    shape, settings = (2, 8, 16, 16), [2, 2, 2, 2, 0, 0, 1, 1, 0]
    first = pool_layout(shape, settings)
    assert first in ("", CHANNELS_LAST) and len(calls) == 2  # as is, and on a copy
    assert pool_layout(shape, settings) == first and len(calls) == 2
    # one channel: nothing to vectorise over, kept as is without timing
    assert pool_layout((2, 1, 16, 16), settings) == "" and len(calls) == 2


def test_auto_keeps_the_engine_kernel_in_an_export_traced_off_the_cpu() -> None:
    before = kernel_choice.current_mode()
    kernel_choice.configure_kernel_choice("auto")

    def torch_faster(numel: int) -> tuple[float, float]:
        return 100.0, 1.0

    try:
        with kernel_choice.recording_traced_sizes():
            assert kernel_choice.choose("test-op-cpu", "Float", 64, torch_faster) == "torch"
            # what the recorder notes when a traced operator had a CUDA tensor
            traced._TRACE.recorder.off_cpu = True
            assert kernel_choice.choose("test-op-cuda", "Float", 64, torch_faster) == "engine"
        assert ("test-op-cuda", "Float", 64) not in kernel_choice.decisions()  # nothing timed
    finally:
        kernel_choice.configure_kernel_choice(before)


def test_the_families_register_in_a_fixed_order() -> None:
    # kernel_choice/__init__.py imports the families in this order (they register as they are
    # imported); configure_kernel_choice installs their symbolics in it
    assert kernel_choice.covered_operators() == (
        "aten::gelu",
        "aten::relu",
        "aten::layer_norm",
        "aten::cross_entropy_loss",
        "aten::_convolution",
        "aten::max_pool2d",
        "aten::max_pool2d_with_indices",
    )


class _FakeClock:
    """``measuring``'s clock, advanced only by the fake kernels: each call of ``kernel(s)``
    takes ``s`` seconds (a list: one per call, the last repeated), and is counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from types import SimpleNamespace

        from ortmodule_exporter.aten.kernel_choice import measuring

        self.now = 0.0
        monkeypatch.setattr(measuring, "time", SimpleNamespace(perf_counter=lambda: self.now))

    def kernel(self, seconds: float | list[float], runs: list[int]):  # type: ignore[no-untyped-def]
        each = seconds if isinstance(seconds, list) else [seconds]

        def run() -> None:
            self.now += each[min(len(runs), len(each) - 1)]
            runs.append(1)

        return run


def test_a_long_kernel_is_timed_fewer_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """A measurement runs once untimed, then up to 5 timed runs; it stops after 3 once they
    took 0.05 s together: a 20 ms kernel runs 1 + 3 times, a 1 ms one 1 + 5 times."""
    from ortmodule_exporter.aten.kernel_choice import measuring

    clock = _FakeClock(monkeypatch)
    long_runs: list[int] = []
    short_runs: list[int] = []
    assert measuring._best_us(clock.kernel(0.02, long_runs)) == pytest.approx(20_000)
    assert measuring._best_us(clock.kernel(0.001, short_runs)) == pytest.approx(1_000)
    assert (len(long_runs), len(short_runs)) == (1 + 3, 1 + 5)
    warmed: list[int] = []
    assert measuring._best_us(clock.kernel(0.02, warmed), warmed=True) == pytest.approx(20_000)
    assert len(warmed) == 3  # the caller ran it already: no untimed run


@pytest.mark.parametrize(
    ("seconds", "runs"),
    [
        (0.004, 1 + 1),  # 2.5x faster than the engine's 10 ms: decided
        (0.03, 1 + 1),  # 3x slower, untimed and timed: decided
        (0.018, 1 + 3),  # 1.8x: timed as usual
        ([0.01, 0.03], 1 + 3),  # slow once the untimed run was not: maybe preempted
        ([0.03, 0.01], 1 + 5),  # slow on the untimed run only: first-call costs
    ],
)
def test_a_clear_difference_from_the_engine_ends_the_timing(
    monkeypatch: pytest.MonkeyPatch, seconds: float | list[float], runs: int
) -> None:
    """The PyTorch side, timed against an engine time of 10 ms, stops after one timed run
    where it is more than 2x faster, or more than 2x slower in the untimed run and the timed
    one; the ATen nodes' own cost counts (the fake kernel adds none of it)."""
    from ortmodule_exporter.aten.kernel_choice import measuring

    clock = _FakeClock(monkeypatch)
    done: list[int] = []
    us = measuring._torch_us(clock.kernel(seconds, done), aten_nodes=0, engine_us=10_000)
    assert len(done) == runs
    assert us == pytest.approx((seconds if isinstance(seconds, float) else seconds[-1]) * 1e6)
    # the ATen nodes' cost decides too: 4.95 ms is 2x below 10 ms, with 2 nodes' 90 us not
    near: list[int] = []
    measuring._torch_us(clock.kernel(0.00495, near), aten_nodes=2, engine_us=10_000)
    assert len(near) == 1 + 5


@pytest.mark.parametrize("known_shapes", [False, True])
def test_the_engine_side_times_its_steady_state(
    monkeypatch: pytest.MonkeyPatch, known_shapes: bool
) -> None:
    """The engine's timed runs write into outputs allocated before them: no page of a 64 MiB
    output is faulted in while they run (allocated per run, the first two runs faulted 16k
    pages each, and inside GPT-2's export cost 0.4 s each)."""
    import resource

    from onnx import helper

    from ortmodule_exporter.aten.kernel_choice import measuring

    faults: list[int] = []
    best = measuring._best_us

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        try:
            return best(*args, **kwargs)
        finally:
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    monkeypatch.setattr(measuring, "_best_us", counted)
    x = torch.ones(4096, 4096)
    us = measuring._engine_us(
        "add",
        [helper.make_node("Add", ["x", "x"], ["y"])],
        {"x": x},
        ["y"],
        output_shapes={"y": (4096, 4096)} if known_shapes else None,
    )
    assert us > 0
    assert faults[0] < 1000, faults  # 64 MiB are 16384 pages
