"""torch.autograd.Function -> com.microsoft::PythonOp, run by the real engine.

Every model here goes through export, the engine's gradient build and a forward/backward in the
engine (conftest.run_engine); outputs and every gradient equal PyTorch eager (fp32 rtol 1e-4,
atol 1e-5). Nothing falls back to PyTorch: there is no fallback at this level.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import sys
from collections.abc import Iterator
from typing import Any

import onnx
import pytest
import torch
from conftest import assert_engine_matches_eager, run_engine

from ortmodule_exporter import ExportError, export, python_op
from ortmodule_exporter.callback_errors import user_errors
from ortmodule_exporter.python_op import (
    REGISTRY,
    CheckpointExportError,
    FunctionRegistry,
    RefusedPythonOpError,
    check_model,
    checks,
    registry,
    shape_inference,
    symbolic,
)
from ortmodule_exporter.python_op import runner as python_op_runner

SEEN: dict[str, Any] = {}


@pytest.fixture(autouse=True)
def _custom_autograd(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    python_op_runner.install()
    python_op.enable_custom_autograd(True)
    # What export/exporter.py passes to torch.onnx.export once custom autograd is wired in: the tracer
    # must not inline Functions that export as PythonOp (it cannot inline a Function with
    # non-tensor outputs, nor torch.utils.checkpoint).
    original = torch.onnx.export

    def export_like_ortmodule(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("autograd_inlining", not python_op.custom_autograd_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", export_like_ortmodule)
    yield
    python_op.enable_custom_autograd(True, allow_checkpoint=False)


def _python_ops(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == "com.microsoft" and n.op_type == "PythonOp"]


def _attr(node: onnx.NodeProto, name: str) -> Any:
    value = next(onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name)
    return value.decode() if isinstance(value, bytes) else value


# -- the Functions -----------------------------------------------------------------------------


class TanhGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x**3)))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        inner = 0.7978845608 * (x + 0.044715 * x**3)
        t = torch.tanh(inner)
        d_inner = 0.7978845608 * (1 + 3 * 0.044715 * x**2)
        return grad * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * d_inner)


@dataclasses.dataclass(frozen=True)
class Config:
    shift: float


class Scaled(torch.autograd.Function):
    """Every kind of non-tensor argument."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        alpha: float,
        beta: float,
        power: int,
        flip: bool,
        name: str,
        dims: tuple[int, ...],
        weights: tuple[float, ...],
        mask: tuple[bool, ...],
        items: list[int],
        nothing: None,
        config: Config,
    ) -> torch.Tensor:
        SEEN["args"] = (alpha, beta, power, flip, name, dims, weights, mask, items, nothing, config)
        ctx.alpha, ctx.power, ctx.flip = alpha * beta, power, flip
        ctx.save_for_backward(x)
        y = (x * alpha * beta) ** power + config.shift
        return -y if flip else y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        g = grad * ctx.power * (x * ctx.alpha) ** (ctx.power - 1) * ctx.alpha
        return (-g if ctx.flip else g, *([None] * 11))


class AddOneInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        x.add_(1.0)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class SortWithIndex(torch.autograd.Function):
    """Three outputs: values, a float rank that is not differentiable, integer indices."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        values, index = torch.sort(x, dim=-1)
        rank = index.to(x.dtype)
        ctx.mark_non_differentiable(rank, index)
        ctx.save_for_backward(index)
        SEEN["needs_input_grad"] = ctx.needs_input_grad
        return values, rank, index

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, grad_rank: Any, grad_index: Any) -> torch.Tensor:
        (index,) = ctx.saved_tensors
        SEEN["grad_rank"] = grad_rank
        return torch.zeros_like(grad).scatter(-1, index, grad)


class Outer(torch.autograd.Function):
    """Calls another Function inside its forward and its backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return TanhGelu.apply(x) * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            (g,) = torch.autograd.grad(TanhGelu.apply(leaf) * 2, leaf, grad)
        return g


class I0e(torch.autograd.Function):
    """Wraps torch.special.i0e, which the ONNX exporter cannot express."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = torch.special.i0e(x)
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        x, y = ctx.saved_tensors
        return grad * (torch.special.i1e(x) - torch.sign(x) * y)


class OptionalGrads(torch.autograd.Function):
    """set_materialize_grads(False); backward returns None for the second tensor."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        return x * 3, x + y

    @staticmethod
    def backward(ctx: Any, g1: torch.Tensor | None, g2: torch.Tensor | None) -> tuple[Any, Any]:
        SEEN["materialized"] = (g1 is not None, g2 is not None)
        gx = g1 * 3 if g1 is not None else None
        return gx, None


class Wrap(torch.nn.Module):
    def __init__(self, fn: Any, width: int = 4) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(width, width)
        self.out = torch.nn.Linear(width, 3)
        self.fn = fn

    def forward(self, x: torch.Tensor) -> Any:
        return self.out(self.fn(self.inp(x)))


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0), requires_grad=True)


# -- tests -------------------------------------------------------------------------------------


def test_custom_gelu_trains_like_eager_and_is_one_python_op() -> None:
    run = assert_engine_matches_eager(Wrap(TanhGelu.apply), (_x(5, 4),))
    (node,) = _python_ops(run.built.exported.model)
    assert _attr(node, "func_name") == f"{__name__}.TanhGelu"
    assert _attr(node, "input_convention") == "d"
    assert _attr(node, "training_mode") == 1
    assert python_op_runner.live_contexts() == 0


def test_non_tensor_arguments_reach_forward_unchanged() -> None:
    config = Config(shift=0.25)
    args = (0.1, 2.0, 2, True, "gelu", (1, 2), (0.5, 1.5), (True, False), [3, 4], None, config)

    def call(h: torch.Tensor) -> torch.Tensor:
        return Scaled.apply(h, *args)

    run = assert_engine_matches_eager(Wrap(call), (_x(5, 4),))
    assert SEEN["args"] == args and SEEN["args"][-1] is config
    (node,) = _python_ops(run.built.exported.model)
    assert _attr(node, "input_convention") == "d" + "c" * 11
    # exact in float32: in the node; 0.1 is not, so it travels by reference like str/list/None
    assert list(_attr(node, "input_float_scalars")) == [2.0]
    assert list(_attr(node, "input_int_scalars")) == [2]
    assert list(_attr(node, "input_bool_scalars")) == [1]
    assert list(_attr(node, "input_int_tuples")) == [1, 2]
    assert list(_attr(node, "input_pointer_scalar_positions")) == [1, 5, 9, 10, 11]


def test_in_place_function_with_mark_dirty() -> None:
    run = assert_engine_matches_eager(Wrap(AddOneInPlace.apply), (_x(5, 4),))
    assert len(_python_ops(run.built.exported.model)) == 1
    # the second call (kernel already seen) copies only the argument written in place
    run = assert_engine_matches_eager(Wrap(AddOneInPlace.apply), (_x(3, 4),))


def test_multiple_outputs_with_non_differentiable_ones() -> None:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 6)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            values, rank, index = SortWithIndex.apply(self.lin(x))
            return values * 2, rank, index

    run = assert_engine_matches_eager(Model(), (_x(5, 4),))
    assert SEEN["needs_input_grad"] == (True,)
    # a non-differentiable output's gradient is materialised as zeros, as in eager
    assert torch.equal(SEEN["grad_rank"], torch.zeros(5, 6))
    assert run.outputs[2].dtype == torch.int64


def test_nested_and_chained_functions() -> None:
    assert_engine_matches_eager(Wrap(lambda h: TanhGelu.apply(Outer.apply(h))), (_x(5, 4),))


def test_function_wrapping_an_operator_onnx_cannot_express() -> None:
    # torch.special.i0e has no ONNX symbolic; inside a Function it runs in PyTorch
    run = assert_engine_matches_eager(Wrap(I0e.apply), (_x(5, 4),))
    assert _attr(_python_ops(run.built.exported.model)[0], "func_name").endswith(".I0e")


class Cube(torch.autograd.Function):
    """The newer style: forward without ctx, setup_context saves what backward needs."""

    @staticmethod
    def forward(x: torch.Tensor, scale: float) -> torch.Tensor:
        return x**3 * scale

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, scale = inputs
        ctx.save_for_backward(x)
        ctx.scale = scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return grad * 3 * x**2 * ctx.scale, None


def test_function_with_setup_context() -> None:
    assert_engine_matches_eager(Wrap(lambda h: Cube.apply(h, 0.5)), (_x(5, 4),))


def test_unmaterialized_grads_and_none_gradients() -> None:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.b(x)
            first, _unused = OptionalGrads.apply(self.a(x), y)
            return first + y  # b still gets its gradient through this path

    assert_engine_matches_eager(Model(), (_x(5, 4),))
    assert SEEN["materialized"] == (True, False)


def test_switched_off_functions_are_inlined() -> None:
    python_op.enable_custom_autograd(False)
    run = assert_engine_matches_eager(Wrap(TanhGelu.apply), (_x(5, 4),))
    assert not _python_ops(run.built.exported.model)


def test_function_subclass_and_same_named_classes() -> None:
    class Base(torch.autograd.Function):
        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad * 2

    class Double(Base):  # the engine itself only accepts direct Function subclasses
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    def make() -> type:
        class Same(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                return x * 3

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
                return grad * 3

        return Same

    first, second = make(), make()
    assert_engine_matches_eager(Wrap(Double.apply), (_x(5, 4),))
    a = assert_engine_matches_eager(Wrap(first.apply), (_x(5, 4),))
    b = assert_engine_matches_eager(Wrap(second.apply), (_x(5, 4),))
    name_a = _attr(_python_ops(a.built.exported.model)[0], "func_name")
    name_b = _attr(_python_ops(b.built.exported.model)[0], "func_name")
    assert name_a != name_b and name_b.startswith(name_a.split("#")[0])


def test_bool_tensors_cross_the_boundary() -> None:
    class Masked(torch.autograd.Function):
        @staticmethod
        def forward(
            ctx: Any, x: torch.Tensor, keep: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            assert keep.dtype == torch.bool
            ctx.save_for_backward(keep)
            return x * keep, keep.logical_not()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor, _g: Any) -> tuple[torch.Tensor, None]:
            (keep,) = ctx.saved_tensors
            return grad * keep, None

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.lin(x)
            y, dropped = Masked.apply(h, h > 0)
            return y, dropped

    run = assert_engine_matches_eager(Model(), (_x(5, 4),))
    assert run.outputs[1].dtype == torch.bool


def test_non_tensor_outputs() -> None:
    class WithCount(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, int]:
            return x * 2, 7

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor, _none: Any) -> torch.Tensor:
            return grad * 2

    def call(h: torch.Tensor) -> torch.Tensor:
        y, count = WithCount.apply(h)
        return y * count

    assert_engine_matches_eager(Wrap(call), (_x(5, 4),))


def test_shape_inference_keeps_dims() -> None:
    class Plain(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad * 2

    def dims_of(exported: Any) -> list[Any]:
        node = _python_ops(exported.model)[0]
        vi = next(v for v in exported.model.graph.value_info if v.name == node.output[1])
        return [d.dim_param or d.dim_value or None for d in vi.type.tensor_type.shape.dim]

    model = Wrap(Plain.apply)
    default = run_engine(model, (_x(5, 4),)).built.exported
    assert len(dims_of(default)) == 2 and "input.x_dim0" not in dims_of(default)

    python_op.register_shape_inference(Plain, lambda shapes, dtypes: [shapes[0]])
    try:
        run = assert_engine_matches_eager(model, (_x(5, 4),))
    finally:
        python_op.unregister_shape_inference(Plain)
    assert dims_of(run.built.exported) == ["input.x_dim0", 4]


def test_user_exception_reaches_the_caller_with_the_function_name() -> None:
    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            if not torch.onnx.is_in_onnx_export():
                raise ValueError("bad input in user code")
            return x

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad

    with pytest.raises(ValueError, match="bad input in user code") as info, user_errors():
        run_engine(Wrap(Fails.apply), (_x(5, 4),))
    assert any("Fails.forward" in note for note in getattr(info.value, "__notes__", []))
    assert any(code.co_name == "forward" for code in _frames(info.value.__traceback__))


def _frames(tb: Any) -> Iterator[Any]:
    while tb is not None:
        yield tb.tb_frame.f_code
        tb = tb.tb_next


class _Checkpointed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.utils.checkpoint as cp

        return cp.checkpoint(self.inner, x, use_reentrant=True)


def test_checkpoint_is_refused_with_guidance() -> None:
    with pytest.raises(ExportError) as info:
        export(Wrap(_Checkpointed()), (_x(5, 4),), training=True)
    text = str(info.value)
    assert "CheckpointFunction" in text
    assert "ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT=1" in text and "ORTMODULE_MEMORY_OPT_LEVEL" in text
    assert isinstance(info.value.__cause__, CheckpointExportError)


def test_checkpoint_runs_when_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    export_module = sys.modules[
        "ortmodule_exporter.export.exporter"
    ]  # the package re-exports export()
    python_op.enable_custom_autograd(True, allow_checkpoint=True)

    # The checkpointed block is handed to the Function by reference; the export's deep copy
    # must hand over the original so that its parameters train. export/exporter.py does that with
    # python_op.exporting_copy_of; emulated here around the copy.
    def copy_and_map(module: torch.nn.Module, enabled: bool = True) -> torch.nn.Module:
        clone = copy.deepcopy(module)
        context = python_op.exporting_copy_of(module, clone)
        context.__enter__()
        monkeypatch.setattr(python_op, "_pending_context", context, raising=False)
        return clone

    monkeypatch.setattr(export_module, "copy_for_export", copy_and_map)
    model = Wrap(_Checkpointed())
    eager = copy.deepcopy(model)
    x = _x(5, 4)
    grad = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    try:
        run = run_engine(model, (x,), grad_outputs=[grad])
    finally:
        python_op._pending_context.__exit__(None, None, None)  # type: ignore[attr-defined]
    name = _attr(_python_ops(run.built.exported.model)[0], "func_name")
    assert name == "torch.utils.checkpoint.CheckpointFunction"

    x_eager = x.detach().clone().requires_grad_()
    out = eager(x_eager)
    out.backward(grad)
    torch.testing.assert_close(run.outputs[0], out.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(run.grads["input.x"], x_eager.grad, rtol=1e-4, atol=1e-5)
    for pname, p in eager.named_parameters():
        # the engine returns the graph's parameter gradients; the checkpointed block's own
        # parameters are trained by PyTorch inside the PythonOp's backward, as in eager
        got = run.grads.get(pname)
        if got is None:
            got = dict(model.named_parameters())[pname].grad
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-5, msg=pname)


def test_exporting_copy_of_maps_modules_back() -> None:
    import copy

    original = Wrap(TanhGelu.apply)
    clone = copy.deepcopy(original)
    with python_op.exporting_copy_of(original, clone):
        assert symbolic._original(clone.inp) is original.inp
        bound = symbolic._original(clone.inp.forward)
        assert bound.__self__ is original.inp
    assert symbolic._original(clone.inp) is clone.inp


# -- security ------------------------------------------------------------------------------------


def _exported(fn: Any) -> onnx.ModelProto:
    return export(Wrap(fn), (_x(5, 4),), training=True).model


def test_model_naming_an_unexported_function_is_refused() -> None:
    model = _exported(TanhGelu.apply)
    check_model(model)  # exported by this process: accepted
    node = _python_ops(model)[0]
    for a in node.attribute:
        if a.name == "func_name":
            a.s = b"os.system"
    with pytest.raises(RefusedPythonOpError, match="os.system"):
        check_model(model)
    with pytest.raises(RefusedPythonOpError, match="never imported"):
        python_op_runner.run_forward("os.system", [0], [1], True, b"x", [None])


def test_forged_object_references_are_refused() -> None:
    model = _exported(
        lambda h: Scaled.apply(
            h, 0.1, 1.0, 1, False, "n", (1,), (1.0,), (True,), [1], None, Config(0.0)
        )
    )
    node = _python_ops(model)[0]
    for a in node.attribute:
        if a.name == "input_pointer_scalars":
            a.ints[0] = id(object())  # an address this export never handed out
    with pytest.raises(RefusedPythonOpError, match="object references"):
        check_model(model)


def test_a_fresh_process_refuses_a_cached_model(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _exported(TanhGelu.apply)
    buf = io.BytesIO()
    onnx.save_model(model, buf)
    fresh = FunctionRegistry()  # what a new process has
    # every module of python_op that reads the registry by name
    for module in (python_op, registry, symbolic, checks, shape_inference):
        monkeypatch.setattr(module, "REGISTRY", fresh)
    with pytest.raises(RefusedPythonOpError, match="did not export in this process"):
        check_model(onnx.load_from_string(buf.getvalue()))
    assert not python_op.model_is_runnable(model)


def test_registry_does_not_grow_with_steps() -> None:
    model = Wrap(TanhGelu.apply)
    run_engine(model, (_x(5, 4),))
    before = REGISTRY.sizes()
    for _ in range(3):
        run_engine(model, (_x(5, 4),))
    after = REGISTRY.sizes()
    # each export adds nothing new for the same Function and arguments
    assert after["functions"] == before["functions"] and after["nodes"] == before["nodes"]
