"""The output pool hands a buffer out again only once nothing holds it: no tensor, view or
DLPack export (the engine's hold on an ATen node's output)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ortmodule_exporter import dlpack_bridge as bridge
from ortmodule_exporter.aten import output_pool

SHAPE = (256, 512)  # 512 KiB of float32: pooled


@pytest.fixture(autouse=True)
def _empty_pool() -> Iterator[None]:
    output_pool.clear()
    yield
    output_pool.clear()


def test_a_released_buffer_is_reused() -> None:
    first = output_pool.empty(SHAPE, torch.float32)
    address = first.data_ptr()
    del first
    again = output_pool.empty(SHAPE, torch.float32)
    assert again.data_ptr() == address
    assert again.shape == SHAPE and again.dtype == torch.float32 and again.is_contiguous()


def test_a_buffer_is_not_reused_while_a_view_holds_it() -> None:
    first = output_pool.empty(SHAPE, torch.float32)
    view = first[3:].t()
    address = first.data_ptr()
    del first
    other = output_pool.empty(SHAPE, torch.float32)
    assert other.data_ptr() != address
    del view, other
    assert output_pool.empty(SHAPE, torch.float32).data_ptr() == address


def test_a_buffer_is_not_reused_while_the_engine_holds_it() -> None:
    first = output_pool.empty(SHAPE, torch.float32)
    first.fill_(7.0)
    address = first.data_ptr()
    pointer = bridge.managed_pointer(first.detach())  # handed to the engine, as the executor does
    del first
    other = output_pool.empty(SHAPE, torch.float32)
    assert other.data_ptr() != address
    other.fill_(1.0)
    held = bridge.tensor_from_pointer(pointer)  # the engine's hold, back in torch's hands
    assert bool((held == 7.0).all())
    del held, other
    assert output_pool.empty(SHAPE, torch.float32).data_ptr() == address


def test_another_dtype_of_the_same_size_shares_buffers() -> None:
    first = output_pool.empty(SHAPE, torch.float32)
    address = first.data_ptr()
    del first
    ints = output_pool.empty((SHAPE[0] * 2, SHAPE[1]), torch.int16)
    assert ints.data_ptr() == address and ints.dtype == torch.int16


def test_small_tensors_are_not_pooled() -> None:
    before = output_pool.stats()
    small = output_pool.empty((16, 16), torch.float32)
    assert small.shape == (16, 16)
    assert output_pool.stats() == before


def test_nearby_sizes_share_a_size_class() -> None:
    first = output_pool.empty((250, 512), torch.float32)
    address = first.data_ptr()
    del first
    longer = output_pool.empty((256, 512), torch.float32)  # 2.4% more: the same class
    assert longer.data_ptr() == address and longer.shape == (256, 512)
    assert output_pool.size_class(250 * 512 * 4) == output_pool.size_class(256 * 512 * 4)
    assert output_pool.size_class(1000) >= 1000
    assert output_pool.size_class(1000) <= 1000 * 9 // 8


def test_the_pool_stays_under_max_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    nbytes = output_pool.size_class(SHAPE[0] * SHAPE[1] * 4)
    monkeypatch.setattr(output_pool, "MAX_BYTES", output_pool.stats()["bytes"] + 2 * nbytes)
    held = [output_pool.empty(SHAPE, torch.float32) for _ in range(3)]
    assert len({t.data_ptr() for t in held}) == 3  # the third one is not pooled
    assert output_pool.stats()["bytes"] <= output_pool.MAX_BYTES
    held[0].fill_(3.0)  # buffers in use are never taken
    del held[1:]
    # idle buffers make room for another size, least recently used first
    allocated = output_pool.stats()["allocated"]
    other = output_pool.empty((SHAPE[0] * 2, SHAPE[1]), torch.float32)
    assert other.shape == (SHAPE[0] * 2, SHAPE[1])
    assert output_pool.stats()["allocated"] == allocated  # no room while held[0] is in use
    del held[0], other
    bigger = output_pool.empty((SHAPE[0] * 2, SHAPE[1]), torch.float32)
    assert output_pool.stats()["allocated"] == allocated + 1
    assert output_pool.stats()["bytes"] == 2 * nbytes <= output_pool.MAX_BYTES
    del bigger


def test_clear_frees_only_idle_buffers() -> None:
    kept = output_pool.empty(SHAPE, torch.float32)
    idle = output_pool.empty(SHAPE, torch.float32)
    del idle
    nbytes = kept.numel() * 4
    assert output_pool.stats()["bytes"] == 2 * nbytes
    assert output_pool.clear() == nbytes
    assert output_pool.stats()["bytes"] == nbytes
    kept.fill_(2.0)  # still ours to write
    assert bool((kept == 2.0).all())


def test_an_unpooled_tensor_takes_the_room_of_idle_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    nbytes = output_pool.size_class(SHAPE[0] * SHAPE[1] * 4)
    monkeypatch.setattr(output_pool, "TRIM_BYTES", 2 * nbytes)
    trims: list[bool] = []
    monkeypatch.setattr(output_pool, "release_free_pages", lambda: trims.append(True) or True)
    held = output_pool.empty(SHAPE, torch.float32)
    held.fill_(5.0)
    idle = [output_pool.empty(SHAPE, torch.float32) for _ in range(4)]
    del idle
    assert output_pool.stats()["bytes"] == 5 * nbytes

    # smaller than MIN_BYTES: the pool keeps its idle buffers
    tiny = output_pool.empty_unpooled((16, 16), torch.float32)
    assert tiny.shape == (16, 16) and output_pool.stats()["bytes"] == 5 * nbytes

    # one buffer's size: one idle buffer goes (least recently used), no trim below TRIM_BYTES
    one = output_pool.empty_unpooled(SHAPE, torch.float32)
    assert output_pool.stats()["bytes"] == 4 * nbytes and not trims

    # TRIM_BYTES: two more idle ones go (not the held one), and the heap is trimmed
    big = output_pool.empty_unpooled((SHAPE[0] * 2, SHAPE[1]), torch.float32)
    assert big.shape == (SHAPE[0] * 2, SHAPE[1]) and big.is_contiguous()
    assert output_pool.stats()["bytes"] == 2 * nbytes and trims == [True]
    assert bool((held == 5.0).all())
    pooled = output_pool.empty(SHAPE, torch.float32)  # the idle one left is still handed out
    assert output_pool.stats()["bytes"] == 2 * nbytes
    unpooled = {t.untyped_storage().data_ptr() for t in (one, big)}
    assert not unpooled & {held.data_ptr(), pooled.data_ptr()}

    # nothing idle: nothing freed, no trim
    big2 = output_pool.empty_unpooled((SHAPE[0] * 2, SHAPE[1]), torch.float32)
    assert output_pool.stats()["bytes"] == 2 * nbytes and trims == [True]
    del big, big2, one, pooled, tiny
