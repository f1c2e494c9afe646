"""``as_strided`` on a view that is not contiguous (Longformer's and LED's sliding-window
chunks): the graph gathers the elements eager reads from memory. Fallback disabled (conftest)."""

from __future__ import annotations

import copy

import pytest
import torch

from ortmodule import ORTModule


class OverlappingChunks(torch.nn.Module):
    """Longformer's ``_chunk`` on ``q.transpose(1, 2).reshape(b * h, s, d)``, which with one
    row (b == 1) is a view with strides (d, h * d, 1), not a copy."""

    def __init__(self, window: int = 2) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.window = window

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        q = self.lin(q)
        b, s, h, d = q.shape
        x = q.transpose(1, 2).reshape(b * h, s, d)
        x = x.view(x.size(0), x.size(1) // (2 * self.window), 2 * self.window, x.size(2))
        size = list(x.size())
        size[1] = size[1] * 2 - 1
        stride = list(x.stride())
        stride[1] = stride[1] // 2
        chunks = x.as_strided(size=size, stride=stride)
        return torch.einsum("bcxd,bcyd->bcxy", chunks, chunks)


def test_as_strided_on_a_transposed_view_reads_eager_elements() -> None:
    # before: torch.onnx's symbolic gathered from the logical order, not memory; the chunks
    # (and Longformer's attention) were other elements, by up to 2.3 here
    torch.manual_seed(0)
    eager = OverlappingChunks()
    wrapped = ORTModule(copy.deepcopy(eager))
    for seed in range(2):
        torch.manual_seed(seed)
        q = torch.randn(1, 8, 2, 4)
        want, got = eager(q), wrapped(q)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        g = torch.randn(want.shape)
        (want * g).sum().backward()
        (got * g).sum().backward()
        for (name, p), (_, r) in zip(
            eager.named_parameters(), wrapped.module.named_parameters(), strict=True
        ):
            torch.testing.assert_close(r.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
            p.grad = None
            r.grad = None


class BeyondTheView(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)[:, :2]  # a view with gaps in memory
        return y.as_strided((2, 3), (4, 1)).sum()


def test_as_strided_reading_outside_its_input_is_refused() -> None:
    from ortmodule_exporter import ExportError

    with pytest.raises(ExportError, match="as_strided"):
        ORTModule(BeyondTheView())(torch.randn(2, 4))
