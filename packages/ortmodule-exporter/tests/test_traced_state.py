"""A symbolic reads the numbers behind a traced state-dict entry or constant at export time."""

from __future__ import annotations

import torch

from ortmodule_exporter import export, register_symbolic, unregister_symbolic
from ortmodule_exporter.symbolics.traced_state import traced_tensor


@torch.library.custom_op("ortmodule_test::scaled_by", mutates_args=())
def scaled_by(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return x * scale + shift


@scaled_by.register_fake
def _(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor([2.0, 3.0, 5.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scaled_by(x, self.scale, torch.tensor([1.0, 1.0, 1.0]))


def test_a_symbolic_reads_a_state_dict_entry_and_a_constant() -> None:
    seen: dict[str, torch.Tensor | None] = {}

    def symbolic(g, x, scale, shift):  # type: ignore[no-untyped-def]
        seen["scale"], seen["shift"] = traced_tensor(scale), traced_tensor(shift)
        seen["x"] = traced_tensor(x)  # the user's input: not known at export
        folded = g.op("Constant", value_t=seen["scale"])
        return g.op("Add", g.op("Mul", x, folded), shift)

    register_symbolic("ortmodule_test::scaled_by", symbolic)
    try:
        exported = export(Scaled(), (torch.randn(2, 3),), training=False)
    finally:
        unregister_symbolic("ortmodule_test::scaled_by")
    assert seen["x"] is None
    assert torch.equal(seen["scale"], torch.tensor([2.0, 3.0, 5.0]))  # type: ignore[arg-type]
    assert torch.equal(seen["shift"], torch.ones(3))  # type: ignore[arg-type]
    # folded into a constant, the buffer is no longer read from the graph's inputs
    assert [i.name for i in exported.model.graph.input] == ["input.x"]


def test_outside_an_export_a_state_entry_is_unknown() -> None:
    graph = torch._C.Graph()
    value = graph.addInput("scale")
    assert traced_tensor(value) is None
