"""FusedAdam's CUDA path: one Triton launch per bucket, checked against torch.optim.AdamW."""

from __future__ import annotations

import pytest
import torch

from ortmodule_optim import FusedAdam

pytestmark = pytest.mark.gpu


def params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(1,), (7,), (1023,), (1025,), (64, 33), (3, 5, 7), (4096, 3)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to("cuda", dtype)) for s in shapes]


def grads(ps: list[torch.nn.Parameter], step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen).to(p.device, p.dtype) for p in ps]


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_triton_matches_adamw_fp32(adam_w_mode):
    pytest.importorskip("triton")
    ref, ours = params(torch.float32), params(torch.float32)
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref_opt = cls(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode)
    for step in range(20):
        for ps, o in ((ref, ref_opt), (ours, opt)):
            for p, g in zip(ps, grads(ps, step), strict=True):
                p.grad = g
            o.step()
    for p, q in zip(ref, ours, strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_precision_is_as_close_to_exact_as_torch(dtype):
    """torch rounds to half precision after every op, the kernel once: compare both to fp64."""
    pytest.importorskip("triton")
    ref, ours = params(dtype), params(dtype)
    exact = [torch.nn.Parameter(p.detach().double()) for p in ref]
    hyper = {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-4}
    ref_opt = torch.optim.AdamW(ref, foreach=False, **hyper)
    exact_opt = torch.optim.AdamW(exact, foreach=False, **hyper)
    opt = FusedAdam(ours, **hyper)
    for step in range(20):
        gs = grads(ref, step)
        for p, q, e, g in zip(ref, ours, exact, gs, strict=True):
            p.grad, q.grad, e.grad = g, g.clone(), g.double()
        for o in (ref_opt, exact_opt, opt):
            o.step()

    def error(ps: list[torch.nn.Parameter]) -> float:
        return max(float((p.double() - e).abs().max()) for p, e in zip(ps, exact, strict=True))

    assert error(ours) <= 1.5 * error(ref) + 1e-3


def test_one_launch_per_bucket(monkeypatch):
    pytest.importorskip("triton")
    import ortmodule_optim.triton_adam as triton_adam

    launches = []
    kernel = triton_adam._adam_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(triton_adam, "_adam_kernel", Counting())
    ps = params(torch.float32) + [
        torch.nn.Parameter(torch.ones(5, device="cuda", dtype=torch.float64))
    ]
    opt = FusedAdam(ps)
    for p, g in zip(ps, grads(ps, 0), strict=True):
        p.grad = g
    opt.step()
    # one for the seven fp32 tensors; float64 goes to the foreach path (the kernel computes in fp32)
    assert len(launches) == 1


def test_non_contiguous_falls_back_to_foreach():
    base = torch.randn(8, 6, device="cuda")
    p = torch.nn.Parameter(base.t())  # non-contiguous
    ref = torch.nn.Parameter(p.detach().clone())
    opt, ref_opt = FusedAdam([p], lr=0.1), torch.optim.AdamW([ref], lr=0.1, weight_decay=0.0)
    for _ in range(3):
        g = torch.randn(6, 8, device="cuda")
        p.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(p, ref)
