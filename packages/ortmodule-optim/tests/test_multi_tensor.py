"""The multi-tensor overflow check, norm and clip against per-tensor torch references."""

from __future__ import annotations

import math

import pytest
import torch

from ortmodule_optim.multi_tensor import (
    clip_by_global_norm_,
    global_norm,
    has_inf_or_nan,
    scale_,
    tensor_norms,
)


def tensors(
    dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float64),
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(3,), (4, 5), (0,), (2, 3, 4), (1,)]
    return [
        torch.randn(shape, generator=gen).to(dtypes[i % len(dtypes)])
        for i, shape in enumerate(shapes * 2)
    ]


def reference_has_inf_or_nan(ts: list[torch.Tensor]) -> bool:
    return any(not torch.isfinite(t).all() for t in ts)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, None])
@pytest.mark.parametrize("where", [0, 3, 9])
def test_has_inf_or_nan(bad, where):
    ts = tensors()
    if bad is not None:
        ts[where].view(-1)[-1] = bad
    assert bool(has_inf_or_nan(ts)) == reference_has_inf_or_nan(ts) == (bad is not None)


def test_has_inf_or_nan_large_finite_values_are_not_overflow():
    # a sum-based check would overflow here
    ts = [torch.full((1000,), 60000.0, dtype=torch.float16)] * 3
    assert not bool(has_inf_or_nan(ts))
    assert not bool(has_inf_or_nan([]))


def test_sparse_tensor_uses_its_values():
    sparse = torch.sparse_coo_tensor([[0, 3]], [1.0, math.inf], (5,), check_invariants=True)
    assert bool(has_inf_or_nan([torch.ones(2), sparse]))
    assert (
        float(
            global_norm(
                [
                    torch.sparse_coo_tensor([[1]], [3.0], (4,), check_invariants=True),
                    torch.full((1,), 4.0),
                ]
            )
        )
        == 5.0
    )


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_norms_match_torch(norm_type):
    ts = tensors()
    expected = torch.stack(
        [
            torch.linalg.vector_norm(t.float(), norm_type) if t.numel() else torch.tensor(0.0)
            for t in ts
        ]
    )
    torch.testing.assert_close(tensor_norms(ts, norm_type), expected)
    total = torch.nn.utils.get_total_norm([t.float() for t in ts if t.numel()], norm_type)
    torch.testing.assert_close(global_norm(ts, norm_type), total)


def test_norm_in_float64():
    ts = tensors((torch.float32,))
    expected = torch.linalg.vector_norm(torch.cat([t.double().flatten() for t in ts]))
    assert global_norm(ts, dtype=torch.float64).dtype == torch.float64
    torch.testing.assert_close(global_norm(ts, dtype=torch.float64), expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_matches_torch(max_norm):
    ours = [torch.nn.Parameter(t.float()) for t in tensors()]
    ref = [torch.nn.Parameter(t.float()) for t in tensors()]
    for p in (*ours, *ref):
        p.grad = p.detach() * 3
    total = clip_by_global_norm_([p.grad for p in ours], max_norm)
    ref_total = torch.nn.utils.clip_grad_norm_(ref, max_norm, foreach=False)
    torch.testing.assert_close(total, ref_total)
    for p, q in zip(ours, ref, strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_scale_by_float_and_tensor():
    ts = [torch.ones(2), torch.ones(3, dtype=torch.float16)]
    scale_(ts, 0.5)
    scale_(ts, torch.tensor(4.0))
    assert all(bool((t == 2).all()) for t in ts)
