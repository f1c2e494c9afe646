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


def test_a_long_kernel_is_timed_fewer_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """A measurement runs once untimed, then up to 5 timed runs; it stops after 3 once they
    took 0.1 s together. The clock is faked: each run of the long kernel takes 50 ms, of the
    short one 1 ms."""
    from types import SimpleNamespace

    from ortmodule_exporter.aten.kernel_choice import measuring

    now = [0.0]
    monkeypatch.setattr(measuring, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def kernel(seconds: float, runs: list[int]):  # type: ignore[no-untyped-def]
        def run() -> None:
            runs.append(1)
            now[0] += seconds

        return run

    long_runs: list[int] = []
    short_runs: list[int] = []
    assert measuring._best_us(kernel(0.05, long_runs)) == pytest.approx(50_000)
    assert measuring._best_us(kernel(0.001, short_runs)) == pytest.approx(1_000)
    assert (len(long_runs), len(short_runs)) == (1 + 3, 1 + 5)
