"""ORTMODULE_EXPORTER=torch_export on the engine's (1.19.2) kernel and gradient-builder bugs that
``export/torch_export_fixes.py`` and ``export/torch_export_empty.py`` rewrite the graph around:
each case trains (values, ``requires_grad`` and every input's gradient) as eager does. Fallback
is disabled (conftest), so every step ran in the engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

from ortmodule import DebugOptions, ORTModule

pytest.importorskip("onnxscript")

TORCH_EXPORT = DebugOptions(exporter="torch_export")


class _Fn(nn.Module):
    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.fn(*xs)


def _same_as_eager(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
    """``fn(*inputs)`` and the gradient of a weighted sum of it, eager against the engine."""
    eager_in = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    ort_in = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    want = fn(*eager_in)
    got = ORTModule(_Fn(fn), TORCH_EXPORT)(*ort_in)
    torch.testing.assert_close(got, want, equal_nan=True)
    assert got.requires_grad == want.requires_grad
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    for i, (o, e) in enumerate(zip(ort_in, eager_in, strict=True)):
        if not e.requires_grad:
            continue
        assert o.grad is not None, f"input {i}: no gradient, eager's is {e.grad}"
        torch.testing.assert_close(o.grad, e.grad, equal_nan=True, msg=f"grad of input {i}")


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape) + len(shape)))


# -- zero-element tensors (torch_export_empty) ---------------------------------------------


@pytest.mark.parametrize(
    ("fn", "shapes"),
    [
        # a broadcasting gradient's ReduceSum of an empty gradient reduced every axis: {1,1,1}
        # reshaped into the empty shape (OpInfo's mul, minimum, true_divide, ... empty samples)
        (torch.mul, [(0, 1, 3), (0, 10, 3)]),
        (torch.minimum, [(0, 1, 3), (0, 10, 3)]),
        (lambda x: torch.log10(x.abs() + 1), [(1, 0, 3)]),
        # a non-empty weight times an empty batch: its gradient is zeros, not none
        (torch.mul, [(1, 10, 3), (0, 10, 3)]),
        # Gemm over an empty inner dimension: the engine asserts K > 0
        (lambda c, a, b: torch.addmm(c, a, b, beta=0.2, alpha=0.6), [(5, 10), (5, 0), (0, 10)]),
        # MatMul over an empty inner dimension: uninitialised memory, not zeros
        (lambda a, b: a @ b, [(5, 0), (0, 4)]),
        # reductions of an empty tensor to a non-empty one
        (lambda x: x.sum(1) + 1, [(3, 0)]),
        (lambda x: x.mean(1), [(3, 0)]),
        # LayerNormalizationGrad fails on an empty batch
        (lambda x, w, b: nn.functional.layer_norm(x, (1,), w, b), [(0, 1), (1,), (1,)]),
        # an empty batch through computed pads and Reshape targets (torch_lib's im2col): known
        # empty only once the integer computations are folded
        (lambda x: nn.functional.unfold(x, 2), [(0, 1, 5, 5)]),
        # empty from a non-empty input, of symbolic dims: the slice's gradient is zeros
        (lambda x: (x[:, :0] * 2).sum(1) + x[:, 0], [(4, 3)]),
        # Concat's gradient (SplitTraining) loses an empty part's length
        (lambda x, y: torch.cat([x, y * 2], 0), [(0, 3), (4, 3)]),
    ],
)
def test_zero_element_tensors(
    fn: Callable[..., torch.Tensor], shapes: list[tuple[int, ...]]
) -> None:
    _same_as_eager(fn, [_randn(*s) for s in shapes])


# -- gradient builders (torch_export_fixes) ----------------------------------------------------


@pytest.mark.parametrize(
    ("fn", "shapes"),
    [
        # clamp by a tensor: the engine's Clip gradient has none for the bound (the build
        # failed), its Min/Max gradient splits ties; torch_lib_training writes Where
        (torch.clamp_max, [(4, 5), (4, 5)]),
        (torch.clamp_min, [(4, 5), (5,)]),
        (lambda x, t: torch.clamp(x, min=torch.tensor(-0.5), max=t), [(4, 5), (4, 5)]),
        (lambda x, t: torch.clamp(x, min=t, max=torch.tensor(0.5)), [(4, 5), ()]),
        # an integer exponent: the Pow gradient's Sub mixed int64 and float
        (lambda x: torch.pow(x, torch.tensor(3)), [(6,)]),
        # TopK of a 0-d tensor: refused by the engine's shape inference
        (lambda x: torch.topk(x, 1).values * 2, [()]),
        # a float sum divided by an int64 count, as torch_lib writes it: Div(float, int64)
        (lambda x: torch.masked.std(x), [(3, 4)]),
        # ReduceL2's gradient graph leaves a value untyped (the build failed)
        (lambda x, y: torch.dist(x, y), [(5, 4), (5, 4)]),
        (lambda x: torch.linalg.vector_norm(x, dim=1, keepdim=True) * x, [(3, 4)]),
        # flip (Slice with a negative step): SliceGrad's narrowing_error
        (lambda x: torch.flip(x, (0, 1, 2)) * torch.arange(60.0).view(5, 4, 3), [(5, 4, 3)]),
        (lambda x: torch.flip(x[1:, :3], (-1,)) * 2, [(5, 4, 3)]),
        # a Where branch broadcast by the condition: the engine's Where gradient keeps the
        # output's shape, and the backward of what computed the branch failed (HF umt5's
        # position bias). (PyTorch sums a module input's gradient to its shape itself.)
        (lambda b: torch.where(torch.arange(3).view(3, 1, 1) % 2 == 0, b[None], -1.0), [(2, 4)]),
        (lambda b: torch.where(torch.arange(4) < 3, -1.0, b[:, None]), [(2,)]),
        (lambda a, b: torch.where(torch.arange(3)[:, None] > 0, a[None], b[:, None]), [(4,), (3,)]),
    ],
)
def test_gradient_builder_gaps(
    fn: Callable[..., torch.Tensor], shapes: list[tuple[int, ...]]
) -> None:
    _same_as_eager(fn, [_randn(*s) for s in shapes])


def test_clamp_ties_go_to_the_input() -> None:
    """Where the input equals the bound, PyTorch's clamp gives the input the gradient."""
    x = torch.tensor([1.0, 2.0, 3.0])
    _same_as_eager(torch.clamp_max, [x, torch.tensor([2.0, 2.0, 2.0])])
    _same_as_eager(torch.clamp_min, [x, torch.tensor([2.0, 2.0, 2.0])])


def test_erfcx_runs_in_pytorch_not_wrong() -> None:
    """torch_lib's erfcx is exp(x**2) * (1 - erf(x)): 0 for x = 9, eager 0.0623. Its
    translation is refused, so the ATen route runs it in PyTorch."""
    _same_as_eager(torch.special.erfcx, [torch.tensor([1.0, 9.0])])


@pytest.mark.parametrize(
    ("fn", "x"),
    [
        # torch_lib's log_sigmoid lost precision far below zero: -8.4787 for eager's -8.4786
        (nn.functional.logsigmoid, [-8.48, -20.0, 0.5, 3.0]),
        # log_ndtr's gradient was NaN in the tail
        (torch.special.log_ndtr, [-10.0, -5.0, 0.5, 3.0]),
        # _safe_softmax's gradient was NaN on a row that is all -inf (eager: 0)
        (
            lambda t: torch.ops.aten._safe_softmax(t.view(2, 2), -1),
            [float("-inf"), float("-inf"), 1.0, 2.0],
        ),
    ],
    ids=["logsigmoid", "log_ndtr", "safe_softmax"],
)
def test_wrong_translations_run_in_pytorch(fn: Callable[..., torch.Tensor], x: list[float]) -> None:
    """Found by the full OpInfo sweep of 2026-11-27: each runs in PyTorch (the ATen route)."""
    _same_as_eager(fn, [torch.tensor(x)])


def test_norm_of_zeros_has_a_zero_gradient() -> None:
    """PyTorch's norm backward masks a zero norm (gradient 0, not Sqrt's NaN)."""
    x = torch.zeros(2, 3)
    x[1] = torch.tensor([3.0, 4.0, 0.0])
    _same_as_eager(lambda t: torch.linalg.vector_norm(t, dim=1), [x])


# -- outputs, 0-d reductions (torch_export_fixes, exporter) ----------------------------------


def _outputs_same_as_eager(
    fn: Callable[..., tuple[torch.Tensor, ...]], inputs: Sequence[torch.Tensor]
) -> None:
    """``fn(*inputs)``, a tuple, and the gradient of a weighted sum of its float outputs, eager
    against the engine: every output's value and ``requires_grad``, every input's gradient."""
    eager_in = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    ort_in = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    want = fn(*eager_in)
    got = ORTModule(_Fn(fn), TORCH_EXPORT)(*ort_in)
    assert len(got) == len(want)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for i, (o, e) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(o, e, equal_nan=True, msg=f"output {i}")
        assert o.requires_grad == e.requires_grad, f"output {i}: requires_grad"
        if e.requires_grad:
            weights = torch.randn(e.shape, generator=gen)
            losses.append(((e * weights).sum(), (o * weights).sum()))
    sum(e for e, _ in losses).backward()  # type: ignore[union-attr]
    sum(o for _, o in losses).backward()  # type: ignore[union-attr]
    for i, (o, e) in enumerate(zip(ort_in, eager_in, strict=True)):
        if e.grad is None:
            assert o.grad is None or not o.grad.any(), f"input {i}: eager has no gradient"
            continue
        assert o.grad is not None, f"input {i}: no gradient, eager's is {e.grad}"
        torch.testing.assert_close(o.grad, e.grad, equal_nan=True, msg=f"grad of input {i}")


@pytest.mark.parametrize(
    ("fn", "shapes"),
    [
        # an output computed from no input (torch.export traces fake tensors, so its value is
        # computed from the graph; the engine folded it and refused it as an output): the
        # index of the max of a 0-d tensor is a Constant 0
        (lambda x: tuple(torch.max(x, 0)), [()]),
        # the integer outputs of an empty input: frexp's exponent, solve_ex's info
        (lambda x: tuple(torch.frexp(x)), [(1, 0, 3)]),
        (lambda a, b: tuple(torch.linalg.solve_ex(a, b)), [(0, 5, 5), (0, 5)]),
        # native_layer_norm's mean and rstd: from the input, but without grad in eager; the
        # engine asked for the rstd's gradient, which LayerNormalizationGrad never reads
        (
            lambda x, w, b: tuple(torch.native_layer_norm(x, [2, 3], w, b, 0.5)),
            [(4, 2, 3), (2, 3), (2, 3)],
        ),
    ],
    ids=["max_of_0d", "frexp_empty", "solve_ex_empty", "native_layer_norm"],
)
def test_outputs_without_gradient(
    fn: Callable[..., tuple[torch.Tensor, ...]], shapes: list[tuple[int, ...]]
) -> None:
    _outputs_same_as_eager(fn, [_randn(*s) for s in shapes])


@pytest.mark.parametrize(
    ("fn", "shapes"),
    [
        # Pow with an exponent on a float path: the engine differentiates the base only
        (torch.pow, [(3, 4), (3, 4)]),
        (lambda x: 2**x, [(5,)]),
        (torch.exp2, [(5,)]),
        # x ** 2: a constant exponent stays in the engine (checked below)
        (lambda x: x**2, [(5,)]),
        # Mish is new in opset 18: an opset-17 probe of its gradient could not ask the engine
        (nn.functional.mish, [(6,)]),
        # permute of a 0-d tensor: a Transpose without perm, whose engine gradient failed
        (lambda x: x.sum().permute(()), [(2, 3)]),
        (lambda x: x.permute(2, 0, 1), [(2, 3, 4)]),
    ],
    ids=["pow", "rpow", "exp2", "square", "mish", "permute_0d", "permute"],
)
def test_engine_gradient_gaps(
    fn: Callable[..., torch.Tensor], shapes: list[tuple[int, ...]]
) -> None:
    """Each failed the gradient build on torch_export (the full OpInfo sweep of 2026-11-27)."""
    _same_as_eager(fn, [_randn(*s).abs() + 0.5 for s in shapes])


def test_constant_exponent_stays_in_the_engine() -> None:
    model = ORTModule(_Fn(lambda x: x**2), TORCH_EXPORT)
    model(torch.randn(4, requires_grad=True)).sum().backward()
    graph = model._runner.transitions.current(True, True).built.exported.model.graph
    assert any(n.op_type == "Pow" for n in graph.node)


def test_scan_of_an_untyped_value_runs_in_pytorch() -> None:
    """cumsum of a where (OpInfo's masked.cumsum): the where's ONNX value was untyped while
    translating, so the CumSum (no engine gradient) was not seen on a float path; and its
    ``dtype`` argument (a ScalarType, an int to the executor) kept it from the ATen route."""
    mask = torch.tensor([[True, False, True], [False, True, True]])
    _same_as_eager(lambda x: torch.masked.cumsum(x, 1, mask=mask), [_randn(2, 3)])


@pytest.mark.parametrize(
    "fn",
    [
        # a real tensor's angle: Where(x < 0, pi, 0), from no float input
        lambda x: (torch.angle(x),),
        # fill: an Expand of the value to the input's shape (the input read by CastLike and
        # Shape only)
        lambda x: (torch.fill(x, 2.5), x * 3),
    ],
    ids=["angle", "fill"],
)
def test_outputs_eager_differentiates_with_zero_gradient(
    fn: Callable[..., tuple[torch.Tensor, ...]],
) -> None:
    """Eager's output requires grad and its inputs get a zero gradient; the translation
    computes it from no float input, so the engine gave an output without ``requires_grad``
    and no gradient (the full OpInfo sweep of 2026-11-27). PyTorch runs the operator."""
    _outputs_same_as_eager(fn, [torch.tensor([-1.5, 0.0, 2.0])])


@pytest.mark.parametrize(
    "fn",
    [
        # a reduction over dim 0 of a 0-d tensor: ONNX allows no axes for rank 0, and the
        # engine's shape inference refused ReduceSum's
        lambda x: nn.functional.normalize(x, p=1.2, dim=0),
        lambda x: x.sum(0) * x,
        lambda x: torch.amax(x, -1) + x.mean(0),
    ],
    ids=["normalize", "sum", "amax_mean"],
)
def test_reductions_of_0d_tensors(fn: Callable[..., torch.Tensor]) -> None:
    _same_as_eager(fn, [torch.tensor(0.7)])


@pytest.mark.parametrize(
    "fn",
    [
        # ScatterElements of 0-d tensors: the CPU kernel refused rank 0 at run time
        lambda x: torch.scatter(x, 0, torch.tensor(0), x * 2),
        lambda x: torch.scatter_add(x, 0, torch.tensor(0), x * 3),
        # Tile of a 0-d tensor: "must be atleast 1 dimensional"
        lambda x: torch.tile(x, ()) * x,
    ],
    ids=["scatter", "scatter_add", "tile"],
)
def test_scalar_operands(fn: Callable[..., torch.Tensor]) -> None:
    _same_as_eager(fn, [torch.tensor(0.7)])


def test_empty_output_with_a_dynamic_dim() -> None:
    """cdist of an empty and a non-empty input: an ATen node kept for its output's shape
    (``(0, s)``, the ``s`` dynamic) needs that output's type declared, and the output schema
    holds the symbolic dim as dynamic."""
    _same_as_eager(torch.cdist, [_randn(0, 5), _randn(4, 5)])


# -- CPU kernels for narrow integer types (torch_export_kernels) ------------------------------


@pytest.mark.parametrize(
    ("fn", "shapes"),
    [
        # torch.eye of a fixed size decomposes into iota(uint8) and Equal of them: the CPU
        # engine has no Equal (nor Less, Add, ...) on uint8 and refused the session
        (lambda x: x * torch.eye(4) + x, [(4, 4)]),
        (lambda x: torch.linalg.matrix_power(x, 0) * x + x, [(3, 3)]),
        # copy(clone(x), eye): torch_lib's copy drops x, so the output was a constant the
        # gradient builder could not find ("couldn't find the producer node"); eager's output
        # requires grad and gives x zeros
        (lambda x: torch.linalg.matrix_power(x, 0), [(1, 1)]),
        (lambda x: torch.linalg.matrix_power(x, 0), [(3, 3)]),
        # copy_ broadcasts its source
        (lambda x, y: x.clone().copy_(y) * x, [(3, 4), (4,)]),
        # narrow integer arithmetic cast back: the low bits are kept (uint8 wraps around)
        (
            lambda x: x * (torch.arange(5, dtype=torch.uint8) * 60 + 100 < 128).float(),
            [(3, 5)],
        ),
    ],
)
def test_narrow_integer_operands(
    fn: Callable[..., torch.Tensor], shapes: list[tuple[int, ...]]
) -> None:
    _same_as_eager(fn, [_randn(*s) for s in shapes])
