"""Matrix products on PyTorch's ``mm`` (the ``matmul_routes`` built-graph pass of the kernel
choice): the engine's ``Gemm``/``MatMul``/``FusedMatMul`` by a 2-d operand becomes an ATen node
where PyTorch was measured faster, transposes around it are folded, and training stays eager's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from ortmodule import ORTModule
from ortmodule_exporter.aten import kernel_choice
from ortmodule_exporter.aten.kernel_choice import choice, matmul
from ortmodule_exporter.aten.parallel import TorchThreadsInEngine, width
from ortmodule_exporter.onnx_graph import attribute
from ortmodule_exporter.passes.matmul_routes import route_matmuls, routes_products
from ortmodule_testing.parity import assert_same_training, clone_model, train_steps
from ortmodule_testing.zoo.registry import ZooCase


class TiedLm(torch.nn.Module):
    """What a causal LM's products look like: Linear layers with bias (Gemm after the
    exporter's reshape), a bias-free Linear over (batch, seq, features) (MatMul), and a head
    tied to the embedding (MatMul by a Transpose of the table, whose gradient leaves through a
    Transpose and is summed with the lookup's)."""

    def __init__(self, vocab: int = 40, width: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.up = torch.nn.Linear(width, 3 * width)
        self.down = torch.nn.Linear(3 * width, width)
        self.mix = torch.nn.Linear(width, width, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.down(torch.tanh(self.up(h)))
        h = self.mix(h)
        logits = h @ self.embed.weight.t()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


@contextlib.contextmanager
def _kernel_choice(mode: str) -> Iterator[None]:
    """The kernel choice in ``mode`` for the block, back to ``engine`` after it."""
    kernel_choice.configure_kernel_choice(mode)
    try:
        yield
    finally:
        kernel_choice.configure_kernel_choice("engine")


def _built_operators(model: ORTModule) -> list[tuple[str, str]]:
    graph = model._runner.transitions.current(True, True)
    assert graph is not None
    return [(n.op_type, attribute(n, "operator", "")) for n in graph.built.model.graph.node]


def _batch(step: int) -> tuple[tuple[torch.Tensor], dict[str, torch.Tensor]]:
    # a new batch size at the third step: the products take the rows they are given
    gen = torch.Generator().manual_seed(step)
    return (torch.randint(0, 40, (2 if step == 2 else 3, 7), generator=gen),), {}


_CASE = ZooCase("tied_lm", TiedLm, _batch, lambda loss, args, kwargs: loss, (1e-5, 1e-6))


def _train_like_eager(steps: int = 3) -> ORTModule:
    eager = _CASE.build()
    ours = ORTModule(clone_model(eager))
    want, got = train_steps(eager, _CASE, steps), train_steps(ours, _CASE, steps)
    assert_same_training(want, got, *_CASE.tolerance)
    return ours


def test_products_on_torch_mm_train_like_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "TORCH")
    ops = _built_operators(_train_like_eager())
    products = [op for op in ops if op[0] in ("Gemm", "MatMul", "FusedMatMul")]
    routed = ops.count(("ATen", kernel_choice.MATMUL))
    # forward: up, down, mix, head; backward: two each, but the head's two, which the loss's
    # gradient node computes with them (passes/loss_head_grads.py)
    assert routed == 10, ops
    assert ops.count(("ATen", kernel_choice.LOSS_HEAD_BACKWARD)) == 1, ops
    assert not products
    # the head's Transpose of the table and its gradient's Transpose were folded away
    assert ("Transpose", "") not in ops


def test_engine_mode_keeps_the_engines_products(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "ENGINE")
    ops = _built_operators(_train_like_eager(steps=1))
    assert ("ATen", kernel_choice.MATMUL) not in ops
    assert any(op[0] in ("Gemm", "MatMul") for op in ops)


def test_recompute_keeps_the_forward_products_on_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's memory optimizer recomputes only its own nodes: under a recompute level
    (the kernel choice's ``losses`` mode) the forward half's products stay the engine's and the
    backward half's are still measured."""
    from ortmodule_exporter.passes import matmul_routes

    seen: list[bool] = []

    def route(*args: object, backward: bool = False, **kwargs: object) -> str:
        seen.append(backward)
        return "torch"

    monkeypatch.setattr(matmul_routes, "matmul_route", route)
    model = _two_products_with_yield()
    with _kernel_choice(kernel_choice.LOSSES):
        assert route_matmuls(model, "cpu") == 2
    # the pass asks with the half each product is in; matmul_route answers "engine" for the
    # forward one under "losses" (below)
    assert seen == [False, True]
    monkeypatch.setattr(choice, "_DECISIONS", {})
    monkeypatch.setattr(choice, "_SECONDS", {})
    with _kernel_choice(kernel_choice.LOSSES):
        assert kernel_choice.matmul_route(None, 8, 8, False, False) == "engine"
        monkeypatch.setattr(matmul, "measure_matmul", lambda *a: (2.0, 1.0))
        assert kernel_choice.matmul_route(None, 8, 8, False, False, backward=True) == "torch"


def _two_products_with_yield() -> onnx.ModelProto:
    """x @ w, a YieldOp, then dy @ w^T: one product in each half of a training graph."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y"]),
        helper.make_node("YieldOp", ["y"], ["dy"], domain="com.microsoft", full_shape_outputs=[0]),
        helper.make_node("Gemm", ["dy", "w"], ["dx"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [8, 8]),
        ],
        [helper.make_tensor_value_info("dx", TensorProto.FLOAT, [4, 8])],
    )
    return helper.make_model(graph)


def test_cuda_graphs_keep_the_engines_products() -> None:
    model = _two_products_with_yield()
    with _kernel_choice("torch"):
        assert route_matmuls(model, "cuda") == 0
        assert route_matmuls(model, "cpu") == 2
    assert routes_products(model.SerializeToString())


def test_a_product_of_another_type_stays_on_the_engine() -> None:
    """Only float32 products are timed: a double or half one keeps the engine's node."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.DOUBLE, [4, 8]),
            helper.make_tensor_value_info("w", TensorProto.DOUBLE, [8, 8]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [4, 8])],
    )
    model = helper.make_model(graph)
    with _kernel_choice("torch"):
        assert route_matmuls(model, "cpu") == 0


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("bias", ["none", "row", "full"])
def test_the_product_function_is_gemm(
    trans_a: bool, trans_b: bool, bias: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``alpha * op(A) @ op(B) + beta * C`` as ONNX's Gemm defines it, whole and in row pieces
    (the engine's threads: ``TorchThreadsInEngine(1)`` on a 2-thread PyTorch)."""
    gen = torch.Generator().manual_seed(0)
    m, k, n = 300, 70, 90
    a = torch.randn((k, m) if trans_a else (m, k), generator=gen)
    b = torch.randn((n, k) if trans_b else (k, n), generator=gen)
    c = {"none": None, "row": torch.randn(n, generator=gen), "full": torch.randn(m, n)}[bias]
    alpha, beta = 0.5, (2.0 if c is not None else 0.0)
    want = alpha * (a.t() if trans_a else a).double() @ (b.t() if trans_b else b).double()
    if c is not None:
        want = want + beta * c.double()
    overload = kernel_choice.matmul_overload(trans_a, trans_b, alpha, beta)
    inputs = [a, b] + ([c] if c is not None else [])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        whole = matmul._matmul(overload, inputs)[0]
        monkeypatch.setattr(matmul, "MIN_PIECES_WORK", 0)
        with TorchThreadsInEngine(1):
            assert width() == 2
            pieces = matmul._matmul(overload, inputs)[0]
    finally:
        torch.set_num_threads(threads)
    for got in (whole, pieces):
        assert got.shape == (m, n)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_a_matmul_of_a_batch_by_a_matrix_keeps_its_leading_dims() -> None:
    x, w = torch.randn(2, 3, 5, 4), torch.randn(6, 4)
    (got,) = matmul._matmul(kernel_choice.matmul_overload(False, True, 1.0, 0.0), [x, w])
    assert got.shape == (2, 3, 5, 6)
    torch.testing.assert_close(got, x @ w.t())


def test_the_measurement_times_both_products() -> None:
    engine_us, torch_us = kernel_choice.measure_matmul(64, 32, 48, False, True, True, False)
    assert engine_us > 0 and torch_us > kernel_choice.ATEN_NODE_US
    engine_us, torch_us = kernel_choice.measure_matmul(64, 32, 48, True, False, False, True)
    assert engine_us > 0 and torch_us > kernel_choice.ATEN_NODE_US


def test_a_product_is_timed_at_a_capped_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch's rows are unknown in the built graph: timed at CALIBRATION_ROWS, and a wide
    dim (an LM head's vocabulary) is capped, so one timing takes milliseconds."""
    timed: list[tuple[object, ...]] = []

    def fake(*args: object) -> tuple[float, float]:
        timed.append(args)
        return 2.0, 1.0

    monkeypatch.setattr(matmul, "measure_matmul", fake)
    monkeypatch.setattr(choice, "_DECISIONS", {})
    monkeypatch.setattr(choice, "_SECONDS", {})
    with _kernel_choice("auto"):
        assert kernel_choice.matmul_route(None, 768, 50257, False, True) == "torch"
        # a second product of the same class is not timed again
        assert kernel_choice.matmul_route(None, 768, 60000, False, True) == "torch"
    cap = matmul.CALIBRATION_CAP
    assert timed == [
        (min(kernel_choice.CALIBRATION_ROWS, cap), 768, cap, False, True, False, False)
    ]
