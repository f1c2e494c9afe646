"""Per-operator kernel choice (ORTMODULE_KERNEL_CHOICE): GELU on PyTorch's kernels inside the
engine trains like eager, and AUTO picks whichever route it measured faster."""

from __future__ import annotations

import math
from typing import Any

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from ortmodule import ORTModule
from ortmodule_exporter.aten import kernel_choice, output_pool
from ortmodule_exporter.aten.executor import ATEN_DOMAIN
from ortmodule_exporter.aten.kernel_choice import choice, convolution, max_pool, relu
from ortmodule_exporter.onnx_graph import attribute
from ortmodule_exporter.passes import engine_forwards
from ortmodule_testing.parity import clone_model


class GeluMLP(torch.nn.Module):
    def __init__(self, approximate: str) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 32)
        self.act = torch.nn.GELU(approximate=approximate)
        self.down = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


def _ops(model: ORTModule) -> list[str]:
    graph = model._runner.transitions.current(True, True)
    assert graph is not None
    return [
        next((a.s.decode() for a in n.attribute if a.name == "operator"), n.op_type)
        for n in graph.built.exported.model.graph.node
    ]


def _train_both(approximate: str) -> ORTModule:
    torch.manual_seed(0)
    eager = GeluMLP(approximate)
    ours = ORTModule(clone_model(eager))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, ours)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(5, 8, generator=gen)
        for model, opt in zip((eager, ours), opts, strict=True):
            opt.zero_grad()
            model(x).square().mean().backward()
        for p_ours, p_eager in zip(ours.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p_ours.grad, p_eager.grad, rtol=1e-4, atol=1e-5)
        for opt in opts:
            opt.step()
    return ours


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_on_torch_kernels_trains_like_eager(
    approximate: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "TORCH")
    assert kernel_choice.GELU in _ops(_train_both(approximate))


class WideGelus(torch.nn.Module):
    """Three GELUs whose outputs (64 x 1024 floats, 256 KiB) are pooled: the first two are
    saved for the backward while the later ones run, so a buffer handed out while still held
    would overwrite a saved activation and the gradients would differ from eager's."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return x


def test_pooled_gelu_outputs_train_like_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "TORCH")
    torch.manual_seed(0)
    eager = WideGelus()
    ours = ORTModule(clone_model(eager))
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (eager, ours)]
    gen = torch.Generator().manual_seed(0)
    before = output_pool.stats()
    for _ in range(3):
        x = torch.randn(64, 1024, generator=gen)
        outs = []
        for model, opt in zip((eager, ours), opts, strict=True):
            opt.zero_grad()
            out = model(x)
            out.square().mean().backward()
            outs.append(out.detach())
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)
        for p_ours, p_eager in zip(ours.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p_ours.grad, p_eager.grad, rtol=1e-4, atol=1e-5)
        for opt in opts:
            opt.step()
    after = output_pool.stats()
    assert kernel_choice.GELU in _ops(ours)
    # later steps' GELU outputs and gradients were given buffers of earlier ones
    assert after["reused"] > before["reused"]


def test_engine_keeps_its_own_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "ENGINE")
    assert kernel_choice.GELU not in _ops(_train_both("none"))


@pytest.mark.parametrize(
    ("engine_us", "torch_us", "route"), [(50.0, 10.0, "torch"), (10.0, 50.0, "engine")]
)
def test_auto_takes_the_faster_route_and_measures_once(
    engine_us: float, torch_us: float, route: str
) -> None:
    kernel_choice.configure_kernel_choice("auto")
    calls: list[int] = []

    def measure(numel: int) -> tuple[float, float]:
        calls.append(numel)
        return engine_us, torch_us

    op = f"test-op-{route}"
    assert kernel_choice.choose(op, "Float", 3000, measure) == route
    assert kernel_choice.choose(op, "Float", 4000, measure) == route  # same size class
    assert calls == [4096]
    assert kernel_choice.decisions()[(op, "Float", 4096)] == (route, engine_us, torch_us)
    kernel_choice.configure_kernel_choice("engine")  # what the process had before


def test_measurement_times_both_kernels() -> None:
    engine_us, torch_us = kernel_choice.measure_gelu(1 << 12)
    assert engine_us > 0 and torch_us > 2 * kernel_choice.ATEN_NODE_US


def test_bad_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="kernel choice mode must be one of"):
        kernel_choice.configure_kernel_choice("fastest")


# -- ReLU, convolution and max pooling ----------------------------------------------------------


class ConvNet(torch.nn.Module):
    """Conv -> ReLU -> MaxPool -> Conv(stride, padding, groups, dilation, bias) -> ReLU."""

    def __init__(self, ceil_mode: bool, return_indices: bool) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.pool = torch.nn.MaxPool2d(
            3, stride=2, padding=1, ceil_mode=ceil_mode, return_indices=return_indices
        )
        self.body = torch.nn.Conv2d(8, 8, 3, stride=2, padding=2, dilation=2, groups=2)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem(x))
        y = self.pool(y)
        if isinstance(y, tuple):
            y = y[0] + y[1].float() * 0  # the indices reach the output, no gradient
        y = torch.relu(self.body(y))
        return self.head(y.mean(dim=(2, 3)))


def _train_like_eager(
    eager: torch.nn.Module,
    batches: list[tuple[torch.Tensor, ...]],
    loss: Any,
    tol: tuple[float, float],
    grad_tol: tuple[float, float],
) -> ORTModule:
    """A step per batch of ``eager`` and an ORTModule copy: outputs within ``tol``, gradients
    (and which parameters have none) within ``grad_tol`` (rtol, atol)."""
    ours = ORTModule(clone_model(eager))
    for args in batches:
        outs = []
        for model in (eager, ours):
            model.zero_grad()
            out = model(*args)
            loss(out).backward()
            outs.append(out)
        torch.testing.assert_close(outs[1], outs[0], rtol=tol[0], atol=tol[1])
        for (name, p_eager), p_ours in zip(
            eager.named_parameters(), ours.parameters(), strict=True
        ):
            assert (p_ours.grad is None) == (p_eager.grad is None), name
            if p_eager.grad is not None:
                torch.testing.assert_close(
                    p_ours.grad, p_eager.grad, rtol=grad_tol[0], atol=grad_tol[1]
                )
    return ours


def _train_convnet(ceil_mode: bool, return_indices: bool) -> ORTModule:
    torch.manual_seed(0)
    eager = ConvNet(ceil_mode, return_indices)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 11, 11, generator=gen),) for _ in range(2)]
    return _train_like_eager(
        eager, batches, lambda out: out.square().mean(), (1e-4, 1e-5), (1e-4, 1e-5)
    )


@pytest.mark.parametrize(("ceil_mode", "return_indices"), [(False, False), (True, True)])
def test_relu_conv_and_max_pool_on_torch_kernels_train_like_eager(
    ceil_mode: bool, return_indices: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "TORCH")
    ops = _ops(_train_convnet(ceil_mode, return_indices))
    # the stem's input needs no gradient: its convolution stays on the engine (see CONV)
    assert ops.count(kernel_choice.CONV) == 1 and "Conv" in ops
    assert ops.count(kernel_choice.RELU) == 2
    assert ops.count(kernel_choice.MAX_POOL2D) == 1 and "MaxPool" not in ops


@pytest.mark.parametrize("ceil_mode", [False, True])
def test_max_pool_on_a_channels_last_copy_trains_like_eager(
    ceil_mode: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "TORCH")
    monkeypatch.setattr(max_pool, "pool_layout", lambda *a: kernel_choice.CHANNELS_LAST)
    # the pooled map is a ReLU output: ties at zero in many windows, each one's gradient
    # must reach the same element as in eager
    model = _train_convnet(ceil_mode, return_indices=True)
    graph = model._runner.transitions.current(True, True).built.exported.model.graph
    (pool,) = [n for n in graph.node if kernel_choice.MAX_POOL2D in str(n.attribute)]
    overload = next(a.s.decode() for a in pool.attribute if a.name == "overload_name")
    assert overload == kernel_choice.CHANNELS_LAST


def test_engine_keeps_relu_conv_and_max_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "ENGINE")
    ops = _ops(_train_convnet(False, False))
    assert not any(op.startswith("_ortmodule_") for op in ops)
    assert ops.count("Conv") == 2 and ops.count("Relu") == 2 and "MaxPool" in ops


def test_auto_records_decisions_per_traced_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "AUTO")
    _train_convnet(False, False)
    found = kernel_choice.decisions()
    conv = [k for k in found if k[0].startswith("conv(weight=8x4x3x3")]
    pool = [k for k in found if k[0].startswith("max_pool2d(kernel=[3, 3]")]
    assert [k[2] for k in conv] == [(4, 8, 6, 6)]  # the pooled map
    assert [k[2] for k in pool] == [(4, 8, 11, 11)]
    # 4 x 8 x 11 x 11 = 3872 elements after the stem, 4 x 8 x 3 x 3 = 288 after the body;
    # the backward is decided first (the forward only matters when it runs on PyTorch)
    assert ("relu_backward", "Float", 4096) in found and ("relu_backward", "Float", 256) in found


def test_a_measurement_that_raises_keeps_the_engine_kernel() -> None:
    kernel_choice.configure_kernel_choice("auto")

    def measure(numel: int) -> tuple[float, float]:
        raise RuntimeError("no ReluGrad in this build")

    try:
        assert kernel_choice.choose("test-op-raises", "Float", 100, measure) == "engine"
    finally:
        kernel_choice.configure_kernel_choice("engine")


@pytest.mark.parametrize(
    ("measure", "aten_nodes"),
    [
        (lambda: kernel_choice.measure_relu(1 << 12), 1),
        (lambda: kernel_choice.measure_relu_backward(1 << 12), 1),
        (lambda: kernel_choice.measure_conv((2, 4, 8, 8), (4, 4, 3, 3), (1, 1), (1, 1), (1, 1)), 2),
        # grouped 1-D: timed as the 2-D kernel the built graph runs (passes/grouped_conv_grad.py)
        (lambda: kernel_choice.measure_conv((2, 8, 9), (8, 1, 3), (1,), (2,), (1,), 8, True), 2),
        (lambda: kernel_choice.measure_max_pool2d((2, 4, 8, 8), (2, 2), (2, 2), (0, 0), (1, 1)), 2),
    ],
)
def test_new_measurements_time_both_kernels(measure: Any, aten_nodes: int) -> None:
    engine_us, torch_us = measure()
    assert engine_us > 0 and torch_us > aten_nodes * kernel_choice.ATEN_NODE_US


# -- ReLU's forward and backward chosen apart -----------------------------------------------------


def _relu_nodes(model: ORTModule) -> tuple[list[str], list[str]]:
    """(ReLU nodes of the exported graph, of the training graph the engine runs): ``Relu`` or
    the ATen operator with its overload."""
    graph = model._runner.transitions.current(True, True)
    assert graph is not None

    def names(nodes: Any) -> list[str]:
        found = []
        for n in nodes:
            operator = attribute(n, "operator", "")
            if n.op_type == "Relu":
                found.append("Relu")
            elif operator.startswith(kernel_choice.RELU):
                found.append(f"{operator}.{attribute(n, 'overload_name', '')}")
        return sorted(found)

    return names(graph.built.exported.model.graph.node), names(graph.built.model.graph.node)


def _relu_measured(
    monkeypatch: pytest.MonkeyPatch, forward: tuple[float, float], backward: tuple[float, float]
) -> list[str]:
    """AUTO with ReLU's two measurements mocked (engine us, PyTorch us); returns which were
    made. Convolution and pooling stay on the engine."""
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "AUTO")
    monkeypatch.setattr(choice, "_DECISIONS", {})  # no decision of an earlier test
    made: list[str] = []

    def measured(name: str, result: tuple[float, float]) -> Any:
        return lambda *_: made.append(name) or result

    # each patched in the family module whose symbolic reads it
    monkeypatch.setattr(relu, "measure_relu", measured("forward", forward))
    monkeypatch.setattr(relu, "measure_relu_backward", measured("backward", backward))
    slower = measured("other", (1.0, 1e9))
    monkeypatch.setattr(convolution, "measure_conv", slower)
    monkeypatch.setattr(max_pool, "measure_max_pool2d", slower)
    return made


BACKWARD = f"{kernel_choice.RELU_BACKWARD}."


@pytest.mark.parametrize("pass_runs", [True, False])
def test_relu_forward_on_engine_with_backward_on_torch_trains_like_eager(
    pass_runs: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = _relu_measured(monkeypatch, forward=(10.0, 90.0), backward=(900.0, 60.0))
    if not pass_runs:  # a graph the pass never reached: its ATen forward computes the same
        monkeypatch.setattr(engine_forwards, "ENGINE_FORWARDS", {})
    exported, built = _relu_nodes(_train_convnet(False, False))
    assert made.count("forward") == made.count("backward") == 2  # the two traced sizes
    forward = f"{kernel_choice.RELU}.{kernel_choice.ENGINE_FORWARD}"
    assert exported == [forward, forward]
    assert built == sorted([BACKWARD] * 2 + (["Relu"] * 2 if pass_runs else [forward] * 2))


def test_relu_forward_on_torch_keeps_its_backward_there(monkeypatch: pytest.MonkeyPatch) -> None:
    _relu_measured(monkeypatch, forward=(90.0, 10.0), backward=(900.0, 60.0))
    exported, built = _relu_nodes(_train_convnet(False, False))
    assert exported == [f"{kernel_choice.RELU}."] * 2
    assert built == sorted([f"{kernel_choice.RELU}."] * 2 + [BACKWARD] * 2)


def test_relu_backward_on_engine_keeps_relu_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _relu_measured(monkeypatch, forward=(90.0, 10.0), backward=(60.0, 900.0))
    exported, built = _relu_nodes(_train_convnet(False, False))
    assert "forward" not in made  # no ReluGrad after a forward on PyTorch
    assert exported == ["Relu"] * 2 and built == ["Relu"] * 2


def test_engine_forwards_pass_rewrites_only_its_overload() -> None:
    def aten(operator: str, overload: str, out: str) -> onnx.NodeProto:
        return helper.make_node(
            "ATen", ["x"], [out], domain=ATEN_DOMAIN, operator=operator, overload_name=overload
        )

    nodes = [
        aten(kernel_choice.RELU, kernel_choice.ENGINE_FORWARD, "a"),
        aten(kernel_choice.RELU, "", "b"),
        aten(kernel_choice.GELU, kernel_choice.ENGINE_FORWARD, "c"),  # no engine forward known
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, [4]) for o in "abc"],
    )
    model = helper.make_model(graph)
    assert engine_forwards.engine_forwards(model) == 1
    first, *rest = model.graph.node
    assert (first.op_type, first.domain, list(first.input), list(first.output)) == (
        "Relu",
        "",
        ["x"],
        ["a"],
    )
    assert [n.op_type for n in rest] == ["ATen", "ATen"]


# -- LayerNorm and embedding ----------------------------------------------------------------------


class Embedder(torch.nn.Module):
    """Token + position embeddings (the position table broadcast over the batch), LayerNorm
    with one frozen and one trainable instance, and a LayerNorm over two dims."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(40, 8)
        self.positions = torch.nn.Embedding(16, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.frozen = torch.nn.LayerNorm(8)
        self.frozen.requires_grad_(False)
        self.wide = torch.nn.LayerNorm((6, 8), eps=1e-3)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        x = self.frozen(self.norm(x))
        return self.head(self.wide(x))


def _train_embedder() -> ORTModule:
    torch.manual_seed(0)
    eager = Embedder()
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 40, (3, 6), generator=gen),) for _ in range(2)]
    return _train_like_eager(
        eager, batches, lambda out: out.square().mean(), (1e-5, 1e-6), (1e-4, 1e-6)
    )


def test_layer_norm_and_embedding_on_torch_kernels_train_like_eager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "TORCH")
    ops = _ops(_train_embedder())
    # the frozen LayerNorm stays on the engine: its weight and bias want no gradient
    assert ops.count(kernel_choice.LAYER_NORM) == 2 and ops.count("LayerNormalization") == 1
    assert ops.count("embedding") == 2


class PaddedEmbedder(torch.nn.Module):
    """A table with a padding row and one scaling gradients by token frequency."""

    def __init__(self) -> None:
        super().__init__()
        self.padded = torch.nn.Embedding(40, 8, padding_idx=0)
        self.by_freq = torch.nn.Embedding(40, 8, scale_grad_by_freq=True)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.padded(ids) * self.by_freq(ids))


@pytest.mark.parametrize("mode", ["TORCH", "ENGINE"])
def test_embedding_with_padding_row_or_frequency_scaling_trains_like_eager(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", mode)
    torch.manual_seed(0)
    eager = PaddedEmbedder()
    gen = torch.Generator().manual_seed(0)
    # few distinct tokens: padding (0) in every row and repeats for the frequency scaling
    batches = [(torch.randint(0, 5, (3, 6), generator=gen),) for _ in range(2)]
    ours = _train_like_eager(
        eager, batches, lambda out: out.square().mean(), (1e-5, 1e-6), (1e-5, 1e-6)
    )
    assert ours.module.padded.weight.grad is not None
    assert not ours.module.padded.weight.grad[0].any()  # the padding row gets no gradient
    ops = _ops(ours)
    assert ops.count("embedding") == (2 if mode == "TORCH" else 0)


def test_engine_keeps_layer_norm_and_embedding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "ENGINE")
    ops = _ops(_train_embedder())
    assert not any(op.startswith("_ortmodule_") for op in ops) and "embedding" not in ops
    assert ops.count("LayerNormalization") == 3


def test_auto_keys_layer_norm_and_embedding_on_their_sizes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "AUTO")
    _train_embedder()
    found = kernel_choice.decisions()
    # 3 x 6 lookups; 18 rows of 8 (size class 16); 3 rows of 6 x 8 (size class 4)
    assert ("embedding(40x8)", "Float", 16) in found
    assert ("embedding(16x8)", "Float", 8) in found
    assert ("layer_norm(8)", "Float", 16) in found
    assert ("layer_norm(6x8)", "Float", 4) in found


@pytest.mark.parametrize(
    "measure",
    [
        lambda: kernel_choice.measure_layer_norm(64, [32]),
        lambda: kernel_choice.measure_embedding(100, 16, 64),
    ],
)
def test_layer_norm_and_embedding_measurements_time_both_kernels(measure: Any) -> None:
    engine_us, torch_us = measure()
    assert engine_us > 0 and torch_us > 2 * kernel_choice.ATEN_NODE_US


# -- cross-entropy --------------------------------------------------------------------------------


class Classifier(torch.nn.Module):
    def __init__(self, reduction: str) -> None:
        super().__init__()
        self.reduction = reduction
        self.proj = torch.nn.Linear(8, 12)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(
            self.proj(x), labels, reduction=self.reduction, ignore_index=-1
        )


def _train_classifier(reduction: str, ignored_share: float) -> ORTModule:
    torch.manual_seed(0)
    eager = Classifier(reduction)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        x = torch.randn(20, 8, generator=gen)
        labels = torch.randint(0, 12, (20,), generator=gen)
        labels[: int(20 * ignored_share)] = -1
        batches.append((x, labels))
    return _train_like_eager(eager, batches, lambda loss: loss, (1e-6, 1e-6), (1e-5, 1e-6))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_dense_cross_entropy_on_torch_kernels_trains_like_eager(
    reduction: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "TORCH")
    ops = _ops(_train_classifier(reduction, ignored_share=0.05))  # 1 of 20 ignored
    assert kernel_choice.CROSS_ENTROPY in ops and "SoftmaxCrossEntropyLoss" not in ops


def test_sparse_labels_keep_the_engines_loss_for_label_sparsity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "TORCH")
    ops = _ops(_train_classifier("mean", ignored_share=0.5))
    assert kernel_choice.CROSS_ENTROPY not in ops and "SoftmaxCrossEntropyLoss" in ops


def _cross_entropy_kernels(
    logits: torch.Tensor, target: torch.Tensor, params: torch.Tensor, grad: torch.Tensor
) -> tuple[Any, Any, Any, Any]:
    """The ATen route's forward and backward kernels: (loss, logsumexp, counted rows, the
    logits' gradient for ``grad``)."""
    from ortmodule_exporter.aten.kernel_choice import cross_entropy

    loss, lse, total = cross_entropy._cross_entropy("", [logits, target, params])
    (got,) = cross_entropy._cross_entropy_backward("", [grad, logits, lse, target, total, params])
    return loss, lse, total, got


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignored", [0, 3, 6])
def test_cross_entropy_kernels_equal_pytorchs_loss_and_gradient(
    reduction: str, ignored: int
) -> None:
    """The ATen route's kernels keep each row's logsumexp for the backward, not the
    log-probabilities (one tensor of the logits' size fewer); the loss, the counted rows and
    the gradient are F.cross_entropy's, with ignored rows and with every row ignored."""
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(6, 11, generator=gen)).requires_grad_()
    target = torch.randint(0, 11, (6,), generator=gen)
    target[:ignored] = -1
    params = torch.tensor([1 if reduction == "mean" else 2, -1])
    grad = torch.tensor(0.7)
    loss, lse, total, got = _cross_entropy_kernels(logits.detach(), target, params, grad)
    assert lse is not None and lse.shape == (6,)
    want = torch.nn.functional.cross_entropy(logits, target, reduction=reduction, ignore_index=-1)
    torch.testing.assert_close(loss, want.detach(), equal_nan=True)
    assert total is not None and total.item() == 6 - ignored
    want.backward(grad)
    torch.testing.assert_close(got, logits.grad)


@pytest.mark.parametrize("special", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("at_target", [False, True])
def test_cross_entropy_kernels_put_nan_and_inf_where_pytorch_does(
    special: float, at_target: bool
) -> None:
    """A +inf logit makes its row NaN as in log_softmax (torch.logsumexp alone would give an
    infinite loss and finite gradients); -inf is a masked class."""
    logits = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    target = torch.tensor([1, 2, 3])
    logits[0, 1 if at_target else 0] = special
    leaf = logits.clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(leaf, target)
    want.backward()
    params = torch.tensor([1, -100])
    loss, _lse, _total, got = _cross_entropy_kernels(logits, target, params, torch.tensor(1.0))
    torch.testing.assert_close(loss, want.detach(), equal_nan=True)
    torch.testing.assert_close(got, leaf.grad, equal_nan=True)


def test_losses_mode_measures_the_cross_entropy_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """ORTModule's default under recompute: the loss is decided, and so is a backward-only
    rewrite of the built graph; every other operator keeps the engine's kernel without a
    measurement."""
    from ortmodule_exporter.aten.kernel_choice import cross_entropy

    monkeypatch.setattr(choice, "_DECISIONS", {})
    monkeypatch.setattr(choice, "_SECONDS", {})
    monkeypatch.setattr(
        cross_entropy, "measure_cross_entropy", lambda rows, classes: (50.0 * rows, 1.0 * rows)
    )
    measured: list[int] = []

    def other(numel: int) -> tuple[float, float]:
        measured.append(numel)
        return 50.0, 1.0

    kernel_choice.configure_kernel_choice(kernel_choice.LOSSES)
    try:
        assert kernel_choice.choose("test-op-not-a-loss", "Float", 100, other) == "engine"
        assert kernel_choice.cross_entropy_route(64, 1000) == "torch"
        assert not measured
        assert kernel_choice.choose("test-backward", "Float", 100, other, backward_only=True) == (
            "torch"
        )
    finally:
        kernel_choice.configure_kernel_choice("engine")
    assert measured == [128]


def test_recompute_routes_the_engines_gelu_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """ORTMODULE_MEMORY_OPT_LEVEL=1 on the zoo's tiny Hugging Face GPT-2 (a GELU written out,
    which the engine fuses into FastGelu): the forward FastGelu stays the engine's (one of
    its nodes, which recompute may repeat), its gradient takes PyTorch's gelu_backward where
    measured faster (here: made to), recompute plans apply, and the gradients match eager's."""
    from ortmodule_exporter.aten.kernel_choice import gelu
    from ortmodule_memory import memory_report

    monkeypatch.setattr(choice, "_DECISIONS", {})
    monkeypatch.setattr(choice, "_SECONDS", {})
    monkeypatch.setattr(
        gelu, "measure_gelu_backward", lambda numel, approximate="none": (50.0, 1.0)
    )
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "1")
    eager, ours = _hf_gpt2_step()
    ops = _built_ops(ours)
    assert ("FastGelu", "", "") in ops
    assert ("ATen", kernel_choice.GELU_BACKWARD, "tanh") in ops
    assert not any(op == "FastGeluGrad" for op, _, _ in ops)
    report = memory_report(ours)
    assert report is not None and report.applied
    for got, want in zip(ours.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)


def test_recompute_keeps_the_layers_on_the_engine_and_routes_the_loss(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ORTMODULE_MEMORY_OPT_LEVEL=1 with the kernel choice at its default: LayerNorm and GELU
    stay the engine's nodes (recomputable), the cross-entropy takes PyTorch's route where it
    measures faster (here: made to), recompute plans apply, and training matches eager."""
    from ortmodule_exporter.aten.kernel_choice import cross_entropy
    from ortmodule_memory import memory_report
    from ortmodule_testing.zoo.gpt import GPTConfig, GPTDecoder

    monkeypatch.setattr(choice, "_DECISIONS", {})
    monkeypatch.setattr(choice, "_SECONDS", {})
    monkeypatch.setattr(
        cross_entropy, "measure_cross_entropy", lambda rows, classes: (50.0 * rows, 1.0 * rows)
    )
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "1")
    torch.manual_seed(0)
    eager = GPTDecoder(GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, seq_len=16))
    ours = ORTModule(clone_model(eager))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for model in (eager, ours):
        loss, _ = model(ids, labels=ids.clone())
        loss.backward()
    ops = _ops(ours)
    assert kernel_choice.CROSS_ENTROPY in ops and "SoftmaxCrossEntropyLoss" not in ops
    assert {"LayerNormalization", "Erf"} <= set(ops)  # GELU stays decomposed in the engine
    assert not {kernel_choice.LAYER_NORM, kernel_choice.GELU} & set(ops)
    report = memory_report(ours)
    assert report is not None and report.applied
    for got, want in zip(ours.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)


def _hf_gpt2_step() -> tuple[torch.nn.Module, ORTModule]:
    """The zoo's tiny Hugging Face GPT-2 (transformers, dropout off; its GELU is tanh
    arithmetic) and an ORTModule copy, after one forward and backward each on the same batch."""
    from hf_models import HF_ZOO

    case = HF_ZOO["gpt2"]
    eager = case.build(seed=0)
    ours = ORTModule(clone_model(eager))
    args, kwargs = case.make_batch(0)
    for model in (eager, ours):
        case.loss_fn(model(*args, **kwargs), args, kwargs).backward()
    return eager, ours


def _built_ops(model: ORTModule) -> set[tuple[str, str, str]]:
    """(op type, ATen operator, overload) of every node of the built gradient graph."""
    graph = model._runner.transitions.current(True, True)
    assert graph is not None
    return {
        (n.op_type, attribute(n, "operator", ""), attribute(n, "overload_name", ""))
        for n in onnx.load_from_string(graph.built.model_bytes).graph.node
    }


@pytest.mark.parametrize("mode", ["TORCH", "ENGINE"])
def test_the_engines_fused_gelu_gradient_takes_pytorchs_kernel(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hugging Face GPT-2's GELU is tanh arithmetic, which the engine fuses into FastGelu; its
    FastGeluGrad (20x slower than PyTorch's gelu_backward at GPT-2 124M's MLP) is routed on the
    built graph (passes/gelu_grads.py), the forward FastGelu stays. Gradients match eager."""
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", mode)
    eager, ours = _hf_gpt2_step()
    ops = _built_ops(ours)
    routed = ("ATen", kernel_choice.GELU_BACKWARD, "tanh")
    assert ("FastGelu", "", "") in ops
    if mode == "TORCH":
        assert routed in ops and not any(op[0] == "FastGeluGrad" for op in ops)
    else:
        assert routed not in ops and any(op[0] == "FastGeluGrad" for op in ops)
    for got, want in zip(ours.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("typed", [True, False])
def test_an_engine_gelu_gradient_without_value_info_is_routed_too(typed: bool) -> None:
    """The build keeps no value_info for some activations (GPT-2 124M's, below the INFO log
    level): the node is float32 all the same, the engine's CPU kernel has no other type."""
    from ortmodule_exporter.passes.gelu_grads import route_gelu_grads

    node = helper.make_node("FastGeluGrad", ["dy", "x"], ["dx"], domain="com.microsoft")
    value_info = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])] if typed else []
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("dy", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("dx", TensorProto.FLOAT, [4, 8])],
        value_info=value_info,
    )
    model = helper.make_model(graph)
    kernel_choice.configure_kernel_choice("torch")
    try:
        assert route_gelu_grads(model, "cpu") == 1
        assert route_gelu_grads(model, "cuda") == 0
    finally:
        kernel_choice.configure_kernel_choice("engine")
    (routed,) = model.graph.node
    assert attribute(routed, "operator") == kernel_choice.GELU_BACKWARD
    assert attribute(routed, "overload_name") == "tanh" and list(routed.input) == ["dy", "x"]


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_backward_measurement_times_both_kernels(approximate: str) -> None:
    engine_us, torch_us = kernel_choice.measure_gelu_backward(1 << 14, approximate)
    assert engine_us > 0 and torch_us > kernel_choice.ATEN_NODE_US


def test_cross_entropy_measurement_times_both_kernels() -> None:
    engine_us, torch_us = kernel_choice.measure_cross_entropy(64, 32)
    assert engine_us > 0 and torch_us > 2 * kernel_choice.ATEN_NODE_US


def test_a_large_cross_entropy_is_timed_on_a_few_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    from ortmodule_exporter.aten.kernel_choice import choice, cross_entropy

    timed: list[tuple[int, int]] = []

    def fake(rows: int, classes: int) -> tuple[float, float]:
        timed.append((rows, classes))
        # per row: the engine 10 us, PyTorch 9 us, plus PyTorch's fixed ATen-node cost
        return 10.0 * rows, 9.0 * rows + 2 * kernel_choice.ATEN_NODE_US

    monkeypatch.setattr(cross_entropy, "measure_cross_entropy", fake)
    monkeypatch.setattr(choice, "_DECISIONS", {})
    monkeypatch.setattr(choice, "_SECONDS", {})
    kernel_choice.configure_kernel_choice("auto")
    try:
        route = kernel_choice.cross_entropy_route(1000, 50257)
    finally:
        kernel_choice.configure_kernel_choice("engine")
    # 1024 rows (the size class) x 50257 classes would be 200 MiB of logits, timed 12 times
    assert timed == [(cross_entropy.CALIBRATION_LOGITS // 50257, 50257)]
    # scaled to 1024 rows, PyTorch's 1 us a row saved outweighs its fixed cost
    assert route == "torch"
    engine_us, torch_us = kernel_choice.decisions()[("cross_entropy(50257)", "Float", 1024)][1:]
    assert engine_us == pytest.approx(10.0 * 1024)
    assert torch_us == pytest.approx(9.0 * 1024 + 2 * kernel_choice.ATEN_NODE_US)


class TanhGeluMlp(torch.nn.Module):
    """GPT-2's MLP with its GELU written out (``NewGELUActivation``): the engine fuses it into
    ``FastGelu``, and its gradient ``FastGeluGrad`` is routed by a measurement the gradient
    build makes (after the export was cached)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        inner = math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))
        return self.down(0.5 * h * (1.0 + torch.tanh(inner))).sum()


def test_a_warm_start_takes_the_gradient_builds_measurements_from_the_cache(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ortmodule_exporter.aten.kernel_choice import gelu

    monkeypatch.setenv("ORTMODULE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "AUTO")
    monkeypatch.setattr(choice, "_DECISIONS", {})
    monkeypatch.setattr(choice, "_SECONDS", {})
    timed: list[int] = []

    def measure(numel: int, approximate: str = "none") -> tuple[float, float]:
        timed.append(numel)
        return 10.0, 1.0  # PyTorch's gradient is faster

    monkeypatch.setattr(gelu, "measure_gelu_backward", measure)
    x = torch.randn(8, 16)
    cold = ORTModule(TanhGeluMlp())
    cold(x).backward()
    assert len(timed) == 1, "the gradient build measured the GELU gradient"
    monkeypatch.setattr(choice, "_DECISIONS", {})  # the next process
    warm = ORTModule(TanhGeluMlp())
    warm(x).backward()
    assert warm._runner.exports == 0, "the warm start exported again"
    assert len(timed) == 1, "the warm start measured the GELU gradient again"
    graph = warm._runner.transitions.current(True, True)
    assert graph is not None
    routed = [
        n for n in onnx.load_from_string(graph.built.model_bytes).graph.node if n.op_type == "ATen"
    ]
    assert any(attribute(n, "operator") == kernel_choice.GELU_BACKWARD for n in routed)
