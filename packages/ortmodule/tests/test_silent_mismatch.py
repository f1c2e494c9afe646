"""Results that differed from eager with no error (issue #36, "No silent wrong training").

Each case runs the engine (fallback disabled) under the kernel choices ``auto`` and ``engine``
and compares the output and every gradient with PyTorch eager (fp32: rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortmodule import ORTModule

KERNEL_CHOICES = ("AUTO", "ENGINE")


@pytest.fixture(autouse=True)
def _engine_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")


def _same_step(
    eager: nn.Module, inputs: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch, choice: str
) -> None:
    """One forward and backward of ``eager`` and of ORTModule on a copy: same output, same
    gradients of every input that requires grad and of every parameter."""
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", choice)
    ours = ORTModule(copy.deepcopy(eager))
    ins_e = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    ins_o = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out_e, out_o = eager(*ins_e), ours(*ins_o)
    torch.testing.assert_close(out_o, out_e, rtol=1e-4, atol=1e-5, msg="output")
    grad_out = torch.randn(out_e.shape, generator=torch.Generator().manual_seed(1))
    (out_e * grad_out).sum().backward()
    (out_o * grad_out).sum().backward()
    for i, (a, b) in enumerate(zip(ins_o, ins_e, strict=True)):
        if b.requires_grad:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=f"inputs[{i}]")
    for (name, p_e), p_o in zip(eager.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(p_o.grad, p_e.grad, rtol=1e-4, atol=1e-5, msg=name)


# -- BatchNorm with the given statistics in a graph that trains ------------------------------
# The engine turned every BatchNormalization into its training-mode kernel: an eval-mode
# batch norm normalized with the batch's statistics (forward off by 0.81 on a (4, 3, 5) input).


class BatchNormWithStats(nn.Module):
    def forward(
        self,
        x: torch.Tensor,
        mean: torch.Tensor,
        var: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor,
    ) -> torch.Tensor:
        return F.batch_norm(x, mean, var, w, b, training=False)


@pytest.mark.parametrize("choice", KERNEL_CHOICES)
@pytest.mark.parametrize("shape", [(4, 3, 5), (2, 3), (2, 3, 4, 5)])
def test_batch_norm_eval_with_statistics_as_inputs(
    monkeypatch: pytest.MonkeyPatch, choice: str, shape: tuple[int, ...]
) -> None:
    gen = torch.Generator().manual_seed(0)
    c = shape[1]
    x = torch.randn(shape, generator=gen).requires_grad_()
    mean, var = torch.randn(c, generator=gen), torch.rand(c, generator=gen) + 0.5
    w = torch.randn(c, generator=gen).requires_grad_()
    b = torch.randn(c, generator=gen).requires_grad_()
    _same_step(BatchNormWithStats(), [x, mean, var, w, b], monkeypatch, choice)


class FrozenBatchNorm(nn.Module):
    """A BatchNorm layer put in eval mode inside a module that trains (fine-tuning with frozen
    statistics): it must normalize with its running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.bn.running_mean.uniform_(-1, 1)
        self.bn.running_var.uniform_(0.5, 2)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.conv(x)).mean((2, 3)))


@pytest.mark.parametrize("choice", KERNEL_CHOICES)
def test_frozen_batch_norm_layer_in_a_training_module(
    monkeypatch: pytest.MonkeyPatch, choice: str
) -> None:
    torch.manual_seed(0)
    model = FrozenBatchNorm()
    model.bn.eval()
    x = torch.randn(4, 3, 6, 6)
    _same_step(model, [x], monkeypatch, choice)
    assert model.training and not model.bn.training


def test_batch_norm_training_mode_still_uses_batch_statistics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model = FrozenBatchNorm()  # every layer in train mode
    _same_step(model, [torch.randn(4, 3, 6, 6)], monkeypatch, "ENGINE")


# -- selective scan (Mamba-style) ------------------------------------------------------------
# The engine's CPU ConvGrad of a grouped 1-D convolution cleared memory past its input
# gradient, so other tensors of the backward lost values (D.grad off, or a Reshape error in the
# 2-layer block); ortmodule_exporter.passes.grouped_conv_grad runs it as the 2-D kernel.


class ScanPieces(nn.Module):
    """The smallest piece of the selective-scan block that differed: in_proj, chunk, a
    depthwise Conv1d cut back to the sequence length, SiLU, ``x * D[None, :, None]``, SiLU gate."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.in_proj = nn.Linear(d, 2 * d)
        self.conv = nn.Conv1d(d, d, 3, groups=d, padding=2)
        self.D = nn.Parameter(torch.ones(d) + torch.rand(d))
        self.out_proj = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        length = h.shape[1]
        x, z = self.in_proj(h).transpose(1, 2).chunk(2, dim=1)
        x = F.silu(self.conv(x)[..., :length])
        y = x * self.D[None, :, None] * F.silu(z)
        return self.out_proj(y.transpose(1, 2))


@pytest.mark.parametrize("choice", KERNEL_CHOICES)
def test_scan_pieces_depthwise_conv_channel_scale(
    monkeypatch: pytest.MonkeyPatch, choice: str
) -> None:
    torch.manual_seed(0)
    _same_step(ScanPieces(), [torch.randn(2, 6, 16)], monkeypatch, choice)


class SelectiveScanBlock(nn.Module):
    """A Mamba-style block in plain PyTorch: in_proj, depthwise causal Conv1d, x_proj/dt_proj,
    softplus as ``log1p(exp(.))``, per-channel broadcasts and a Python loop over the sequence."""

    def __init__(self, d: int = 16, n: int = 4, r: int = 2, k: int = 3) -> None:
        super().__init__()
        self.d, self.n, self.r = d, n, r
        self.in_proj = nn.Linear(d, 2 * d)
        self.conv = nn.Conv1d(d, d, k, groups=d, padding=k - 1)
        self.x_proj = nn.Linear(d, r + 2 * n, bias=False)
        self.dt_proj = nn.Linear(r, d)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1).float()).repeat(d, 1))
        self.D = nn.Parameter(torch.ones(d))
        self.out_proj = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        length = h.shape[1]
        x, z = self.in_proj(h).transpose(1, 2).chunk(2, dim=1)
        x = F.silu(self.conv(x)[..., :length])
        dt, b, c = torch.split(self.x_proj(x.transpose(1, 2)), [self.r, self.n, self.n], dim=-1)
        dt = torch.log1p(torch.exp(self.dt_proj(dt))).transpose(1, 2)
        a = -torch.exp(self.A_log)
        d_a = torch.exp(a[None, :, None, :] * dt[:, :, :, None])
        d_bu = dt[:, :, :, None] * b[:, None, :, :] * x[:, :, :, None]
        s = torch.zeros(h.shape[0], self.d, self.n)
        ys = []
        for i in range(length):
            s = d_a[:, :, i] * s + d_bu[:, :, i]
            ys.append(torch.matmul(s, c[:, i, :].unsqueeze(-1))[:, :, 0])
        y = torch.stack(ys, dim=-1) + x * self.D[None, :, None]
        return self.out_proj((y * F.silu(z)).transpose(1, 2))


class TwoScanLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([SelectiveScanBlock(), SelectiveScanBlock()])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = h + layer(h)
        return h


@pytest.mark.parametrize("choice", KERNEL_CHOICES)
@pytest.mark.parametrize("batch", [1, 2])
def test_two_layer_selective_scan_block(
    monkeypatch: pytest.MonkeyPatch, choice: str, batch: int
) -> None:
    torch.manual_seed(0)
    _same_step(TwoScanLayers(), [torch.randn(batch, 6, 16)], monkeypatch, choice)


class DepthwiseConv3d(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(d, 2 * d)
        self.conv = nn.Conv3d(d, d, 3, groups=d, padding=1)
        self.D = nn.Parameter(torch.rand(d) + 1)
        self.out = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x, z = self.inp(h).permute(0, 4, 1, 2, 3).chunk(2, dim=1)
        y = F.silu(self.conv(x)) * self.D[None, :, None, None, None] * F.silu(z)
        return self.out(y.permute(0, 2, 3, 4, 1))


@pytest.mark.parametrize("choice", KERNEL_CHOICES)
def test_grouped_conv3d_backward_leaves_the_output_alone(
    monkeypatch: pytest.MonkeyPatch, choice: str
) -> None:
    """The same engine bug in 3-D: the backward cleared 336 of the 768 elements of the output
    the caller still held (2026-11-26); the gradient now runs in PyTorch inside the engine."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 4, 8)
    _same_step(DepthwiseConv3d(), [x], monkeypatch, choice)
    eager = DepthwiseConv3d()
    ours = ORTModule(copy.deepcopy(eager))
    out_e, out_o = eager(x), ours(x)
    out_o.sum().backward()
    torch.testing.assert_close(out_o, out_e, rtol=1e-4, atol=1e-5, msg="output after backward")


# -- NaN propagation -----------------------------------------------------------------------


class MaximumMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(torch.maximum(h, torch.zeros_like(h)))


# Fixed 2026-11-26: where maximum's input was NaN the engine's gradient of Max put NaN into the
# first layer's gradients (128 NaNs in a.weight, eager 16); maximum now exports as Where nodes
# (symbolics/max_min.py) and masks select (passes/nan_gradients.py).
def test_nan_through_maximum_reaches_the_gradients_eager_reaches() -> None:
    torch.manual_seed(0)
    eager = MaximumMLP()
    ours = ORTModule(copy.deepcopy(eager))
    x = torch.randn(4, 8)
    x[1, 3] = float("nan")
    eager(x).sum().backward()
    ours(x).sum().backward()
    for (name, p_e), p_o in zip(eager.named_parameters(), ours.parameters(), strict=True):
        assert torch.equal(p_o.grad.isnan(), p_e.grad.isnan()), name
        torch.testing.assert_close(p_o.grad, p_e.grad, rtol=1e-4, atol=1e-5, equal_nan=True)
