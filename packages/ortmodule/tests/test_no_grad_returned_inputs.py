"""An op under ``torch.no_grad()`` that hands back its input tensor itself (``h.to(h.dtype)``,
``h.float()`` of a float32 ``h``, ``h.contiguous()`` of a contiguous one, ``h.type_as(h)``)
returns ``h``, which still requires grad; reads of ``h`` after the block keep their gradient.

Both frontends took such a result for a value computed without grad, and later reads of ``h``
read that result: the gradient was cut there. In dots3_note_text's sparse-attention indexer
(``self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype))`` under
``@torch.no_grad()``) that cut the gradient of the attention's gate projection input, and every
gradient before it was up to 0.01 off; in the small module below the TorchScript frontend left
``a.weight`` no gradient at all (an engine build error) and torch_export's was 2.2 off.

A weight reached only through such a cut (``c`` below: read under ``no_grad``, its result
scaled by zero into the loss) has no gradient, as in eager: the TorchScript frontend failed to
build ("unreachable from the output node(s)"), torch_export gave zeros, and with a float64
value on that path crashed the process while creating the engine's session.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ortmodule import DebugOptions, ORTModule
from ortmodule_testing.parity import clone_model

FRONTENDS = {
    "torchscript": DebugOptions(exporter="torchscript"),
    "torch_export": DebugOptions(exporter="torch_export"),
}


class _ReadUnderNoGrad(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            if self.how == "to_same_dtype":
                g = h.to(torch.float32)
            elif self.how == "float":
                g = h.float()
            elif self.how == "contiguous":
                g = h.contiguous()
            elif self.how == "type_as":
                g = h.type_as(x)
            elif self.how == "copy":  # a new tensor: no gradient through g
                g = h.to(torch.float32, copy=True)
            else:  # "double": a new tensor too
                g = h.double()
            z = self.c(g.float()).sum()
        # h after the block, and g (h itself, unless copied)
        return (self.b(h) * (1 + 0 * z)).sum() + (g.float() * 0.5).sum()


HOWS = ["to_same_dtype", "float", "contiguous", "type_as", "copy", "double"]


@pytest.mark.parametrize("frontend", list(FRONTENDS))
@pytest.mark.parametrize("how", HOWS)
def test_a_tensor_returned_as_is_under_no_grad_keeps_its_gradient(how: str, frontend: str) -> None:
    if frontend == "torch_export":
        pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    model = _ReadUnderNoGrad(how)
    wrapped = ORTModule(clone_model(model), FRONTENDS[frontend])
    x = torch.randn(4, 8)
    for _ in range(2):
        loss_ref, loss = model(x), wrapped(x)
        loss_ref.backward()
        loss.backward()
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    for name, parameter in model.named_parameters():
        got = wrapped.module.get_parameter(name).grad
        if parameter.grad is None:
            assert got is None, f"{name}: a gradient where eager has none"
        else:
            torch.testing.assert_close(got, parameter.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert model.c.weight.grad is None  # the case the test is about: c only under no_grad
