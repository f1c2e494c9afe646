"""scaled_dot_product_attention runs PyTorch's fused kernels inside the engine by default
(ORTMODULE_FUSED_ATTENTION), forward and backward, and trains like eager."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from ortmodule import DebugOptions, ORTModule
from ortmodule_testing.parity import clone_model

FLASH = "_scaled_dot_product_flash_attention_for_cpu"
#: the same kernel on the token-major tensors (passes/attention_layout.py reads the Transposes)
FLASH_BSHD = "_ortmodule_flash_attention_bshd"


class Attention(torch.nn.Module):
    """q, k, v projections and SDPA; ``mask`` picks the kind of mask."""

    def __init__(self, mask: str, d: int = 16, heads: int = 2, seq: int = 6) -> None:
        super().__init__()
        self.mask, self.heads = mask, heads
        # no bias: softmax ignores a key bias, whose gradient is rounding noise AdamW amplifies
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.out = torch.nn.Linear(d, d)
        # a learned additive bias (T5/ALiBi-like): its gradient must reach it
        self.bias = torch.nn.Parameter(torch.randn(heads, seq, seq) * 0.1)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            y.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
            for y in self.qkv(x).chunk(3, dim=-1)
        )
        if self.mask == "causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.mask == "padding":  # bool mask, True = attend
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        elif self.mask == "additive":  # HF style: finfo.min where padded
            add = (1.0 - keep[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=add)
        else:  # learned bias
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias[None, :, :t, :t])
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(3, 6, 16, generator=gen)
    keep = torch.ones(3, 6, dtype=torch.bool)
    keep[1, 4:] = False
    keep[2, 2:] = False
    return x, keep


def _exported_ops(model: ORTModule) -> list[str]:
    graph = model._runner.transitions.current(True, True)
    assert graph is not None, "no training graph was built"
    return [
        next((a.s.decode() for a in n.attribute if a.name == "operator"), n.op_type)
        for n in graph.built.exported.model.graph.node
    ]


def _train_both(
    mask: str,
    steps: int = 3,
    make: Callable[[str], torch.nn.Module] | None = None,
    options: DebugOptions | None = None,
) -> tuple[ORTModule, torch.nn.Module]:
    """``steps`` AdamW steps of eager and ORTModule of ``make(mask)`` (:class:`Attention`):
    losses, first gradients and the parameters after compared."""
    torch.manual_seed(0)
    eager = (make or Attention)(mask)
    ours = ORTModule(clone_model(eager), options)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, ours)]
    first: list[list[torch.Tensor | None]] = []
    for step in range(steps):
        x, keep = _batch(step)
        losses = []
        for model, opt in zip((eager, ours), opts, strict=True):
            opt.zero_grad()
            loss = model(x, keep).square().mean()
            loss.backward()
            losses.append(loss.detach())
            if step == 0:
                first.append(
                    [None if p.grad is None else p.grad.clone() for p in model.parameters()]
                )
            opt.step()
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
    for g_eager, g_ours in zip(*first, strict=True):
        assert (g_eager is None) == (g_ours is None)
        if g_eager is not None:
            torch.testing.assert_close(g_ours, g_eager, rtol=1e-4, atol=1e-5)
    for p_ours, p_eager in zip(ours.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p_ours, p_eager, rtol=1e-4, atol=1e-5)
    return ours, eager


@pytest.mark.parametrize("mask", ["causal", "padding", "additive"])
def test_sdpa_runs_fused_and_trains_like_eager(mask: str) -> None:
    ours, _ = _train_both(mask)
    ops = _exported_ops(ours)
    # fused, and the heads' Transposes read away (the kernel takes eager's strided views)
    assert FLASH_BSHD in ops and FLASH not in ops
    graph = ours._runner.transitions.current(True, True)
    assert graph is not None
    (node,) = [n for n in graph.built.exported.model.graph.node if n.op_type == "ATen"]
    assert next(a.s for a in node.attribute if a.name == "overload_name") == b"qkvo"


def test_a_mask_that_needs_a_gradient_stays_decomposed() -> None:
    ours, eager = _train_both("learned")
    assert not {FLASH, FLASH_BSHD} & set(_exported_ops(ours))
    assert eager.bias.grad is not None and ours.module.bias.grad is not None


def test_switched_off_the_engine_runs_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_FUSED_ATTENTION", "0")
    ours, _ = _train_both("causal", steps=1)
    ops = _exported_ops(ours)
    assert not {FLASH, FLASH_BSHD} & set(ops) and "Softmax" in ops
