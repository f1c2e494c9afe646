"""A lookup table's gradients summed in one pass (the ``embedding_grad_sums`` built-graph
pass): the engine's ``GatherGrad`` and the ``Sum`` with a tied head's gradient become one ATen
node that adds the looked-up rows into the head's gradient, and training stays eager's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from test_matmul_routes import TiedLm

from ortmodule import ORTModule
from ortmodule_exporter.aten import output_pool
from ortmodule_exporter.aten.kernel_choice import EMBEDDING_GRAD_ADD, MATMUL, choice
from ortmodule_exporter.aten.kernel_choice import embedding as embedding_kernel
from ortmodule_exporter.aten.kernel_choice.embedding import _embedding_grad_add
from ortmodule_exporter.onnx_graph import attribute
from ortmodule_exporter.passes import matmul_routes
from ortmodule_exporter.symbolics import embedding as embedding_symbolic
from ortmodule_testing.parity import assert_same_training, clone_model, train_steps
from ortmodule_testing.zoo.registry import ZooCase


def _batch(step: int) -> tuple[tuple[torch.Tensor], dict[str, torch.Tensor]]:
    # repeated ids: rows gathered more than once add up
    gen = torch.Generator().manual_seed(step)
    return (torch.randint(0, 12, (3, 9), generator=gen),), {}


def _loss(loss: torch.Tensor, args: object, kwargs: object) -> torch.Tensor:
    return loss


_CASE = ZooCase("tied_lm_rows", TiedLm, _batch, _loss, (1e-5, 1e-6))


@pytest.fixture
def engine_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel choice measuring (``auto``), with the lookup on the engine's Gather and
    GatherGrad, as GPT-2's 50257-row table measured."""
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "AUTO")
    monkeypatch.setattr(embedding_symbolic, "LOOKUP_ROUTE", [lambda *args, **kwargs: None])


def _trained(steps: int = 3, case: ZooCase = _CASE) -> list[tuple[str, str, str, str]]:
    """The built graph's (op type, ATen operator, overload, output) after training like
    eager."""
    eager = case.build()
    ours = ORTModule(clone_model(eager))
    want, got = train_steps(eager, case, steps), train_steps(ours, case, steps)
    assert_same_training(want, got, *case.tolerance)
    graph = ours._runner.transitions.current(True, True)
    assert graph is not None
    return [
        (n.op_type, attribute(n, "operator", ""), attribute(n, "overload_name", ""), n.output[0])
        for n in graph.built.model.graph.node
    ]


@pytest.mark.usefixtures("engine_lookups")
@pytest.mark.parametrize(("products", "overload"), [("torch", "in_place|-1"), ("engine", "|-1")])
def test_the_rows_go_into_our_head_product_in_place_else_into_a_new_table(
    products: str, overload: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(matmul_routes, "matmul_route", lambda *args, **kwargs: products)
    unpooled: list[tuple[int, ...]] = []
    allocate = output_pool.empty_unpooled

    def spy(shape: Sequence[int], *args: Any) -> torch.Tensor:
        unpooled.append(tuple(shape))
        return allocate(shape, *args)

    monkeypatch.setattr(output_pool, "empty_unpooled", spy)
    nodes = _trained()
    # the table's gradient (the head product's output, or the new table) is the user's .grad:
    # not a pooled buffer, and idle pooled ones make room for it where it is large
    assert tuple(_CASE.build().embed.weight.shape) in unpooled, unpooled
    assert ("ATen", EMBEDDING_GRAD_ADD, overload, "embed.weight_grad") in nodes, nodes
    assert not [n for n in nodes if n[0] == "GatherGrad"], nodes
    if products == "torch":
        # the head's weight gradient, added into, is allocated as a graph output's (not pooled)
        head = [n[2] for n in nodes if n[1] == MATMUL and n[3] == "embed.weight_grad_1"]
        assert head == ["10o|1.0|0.0"], nodes


class PaddedTiedLm(TiedLm):
    """:class:`TiedLm` whose table has a padding row: its lookups add nothing to its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.embed.padding_idx = 3


def test_pytorchs_lookup_gradient_with_a_padding_row_is_fused_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "TORCH")
    case = ZooCase("padded_tied_lm", PaddedTiedLm, _batch, _loss, _CASE.tolerance)
    nodes = _trained(case=case)
    assert ("ATen", EMBEDDING_GRAD_ADD, "in_place|3", "embed.weight_grad") in nodes, nodes
    assert not [n for n in nodes if n[1] == "embedding_backward"], nodes


def test_engine_mode_keeps_gather_grad_and_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "ENGINE")
    nodes = _trained(steps=1)
    assert not [n for n in nodes if n[1] == EMBEDDING_GRAD_ADD]
    assert [n for n in nodes if n[0] == "GatherGrad"]


class UntiedLm(TiedLm):
    """:class:`TiedLm` with a head of its own: its table has no other gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Parameter(torch.randn(40, 16) * 0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = self.mix(h + self.down(torch.tanh(self.up(h))))
        logits = h @ self.head.t()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


@pytest.mark.parametrize("frontend", ["torchscript", "torch_export"])
@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_tables_lookup_is_not_timed(
    tied: bool, frontend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "AUTO")
    monkeypatch.setenv("ORTMODULE_EXPORTER", frontend)
    monkeypatch.setattr(choice, "_DECISIONS", {})
    timed: list[tuple[int, int]] = []

    def measure(rows: int, dim: int, lookups: int) -> tuple[float, float]:
        timed.append((rows, dim))
        return 1.0, 2.0  # the engine's

    monkeypatch.setattr(embedding_kernel, "measure_embedding", measure)
    case = ZooCase(
        "tied_lm_rows" if tied else "untied_lm_rows",
        TiedLm if tied else UntiedLm,
        _batch,
        _loss,
        _CASE.tolerance,
    )
    nodes = _trained(steps=2, case=case)
    # a tied table's gradient is summed in one pass whichever route its lookup takes: the
    # lookup is the engine's, untimed; a table read by its lookup alone is timed
    assert timed == ([] if tied else [(40, 16)])
    assert [n for n in nodes if n[0] == "Gather"], nodes
    assert bool([n for n in nodes if n[1] == EMBEDDING_GRAD_ADD]) == tied, nodes


def _reference(
    shape: list[int], indices: torch.Tensor, dy: torch.Tensor, *others: torch.Tensor
) -> torch.Tensor:
    table = torch.zeros(shape, dtype=torch.float64)
    table.index_add_(0, indices.reshape(-1) % shape[0], dy.reshape(-1, *shape[1:]).double())
    return sum((o.double() for o in others), table)


@pytest.mark.parametrize("overload", ["|-1", "in_place|-1"])
def test_the_node_adds_repeated_and_negative_rows_to_every_summand(overload: str) -> None:
    gen = torch.Generator().manual_seed(0)
    shape = [6, 4]
    indices = torch.tensor([[0, 5, -1], [2, 2, 0]])
    dy = torch.randn(2, 3, 4, generator=gen)
    head, bias = torch.randn(6, 4, generator=gen), torch.randn(4, generator=gen)
    want = _reference(shape, indices, dy, head, bias)
    kept = head.clone()
    inputs = [torch.tensor(shape), indices, dy, head, bias]
    (got,) = _embedding_grad_add(overload, inputs)
    assert got is not None
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    # a summand is written into only in place, and only when it has the table's shape
    assert (got is head) == overload.startswith("in_place")
    if not overload.startswith("in_place"):
        assert torch.equal(head, kept)
    (broadcast,) = _embedding_grad_add(overload, [torch.tensor(shape), indices, dy, bias])
    assert broadcast is not None and broadcast is not bias
    torch.testing.assert_close(broadcast.double(), _reference(shape, indices, dy, bias))


def test_a_padding_rows_lookups_add_nothing() -> None:
    gen = torch.Generator().manual_seed(1)
    indices = torch.tensor([1, 2, 1, 0])
    dy = torch.randn(4, 3, generator=gen)
    head = torch.randn(5, 3, generator=gen)
    (got,) = _embedding_grad_add("|1", [torch.tensor(5), indices, dy, head])
    assert got is not None
    want = head.double().clone()
    want[2] += dy[1].double()
    want[0] += dy[3].double()
    torch.testing.assert_close(got.double(), want)
