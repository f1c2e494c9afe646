"""Training-mode translations for the dynamo ONNX translator, where onnxscript's torch_lib
lowers an ATen operator for inference only (docs/architecture.md lists each).

>>> from ortmodule_exporter.export.torch_lib_training import training_translations
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ExportError

__all__ = ["training_translations"]


def _batch_norm_training(opset: int) -> Any:
    """``_native_batch_norm_legit_functional`` as a training-mode ``BatchNormalization``.

    torch_lib 0.7 forces ``training = False`` (an ONNX Runtime limitation of old opsets), which
    normalises a training step with the running statistics: silently wrong. The engine's
    training-mode BatchNormalization uses the batch's and has a gradient; the BatchNorm pass
    (``passes.batchnorm``) takes its running-statistic outputs to the module's buffers as for
    the TorchScript frontend.
    """
    import onnxscript  # noqa: PLC0415 - optional: only this frontend needs it

    op = onnxscript.values.Opset("", opset)

    def batch_norm(
        input: Any,
        weight: Any = None,
        bias: Any = None,
        running_mean: Any = None,
        running_var: Any = None,
        training: bool = False,
        momentum: float = 0.9,
        eps: float = 1e-05,
    ) -> tuple[Any, Any, Any, Any, Any]:
        channels = op.Shape(input, start=1, end=2)
        if weight is None:
            weight = op.Expand(op.CastLike(op.Constant(value_float=1.0), input), channels)
        if bias is None:
            bias = op.Expand(op.CastLike(op.Constant(value_float=0.0), input), channels)
        rank = len(input.shape)
        axes = op.Constant(value_ints=[0, *range(2, rank)])
        if running_mean is None or running_var is None:
            raise ExportError(
                "BatchNorm without running statistics (track_running_stats=False) is not "
                "supported by ORTMODULE_EXPORTER=torch_export yet; use the torchscript frontend"
            )
        if not training:
            norm = op.BatchNormalization(
                input, weight, bias, running_mean, running_var, epsilon=eps, momentum=1.0 - momentum
            )
            save_mean = op.Identity(running_mean)
            save_rstd = op.Div(
                op.CastLike(op.Constant(value_float=1.0), running_var),
                op.Sqrt(
                    op.Add(running_var, op.CastLike(op.Constant(value_float=eps), running_var))
                ),
            )
            return norm, save_mean, save_rstd, op.Identity(running_mean), op.Identity(running_var)
        norm, new_mean, new_var = op.BatchNormalization(
            input,
            weight,
            bias,
            running_mean,
            running_var,
            epsilon=eps,
            momentum=1.0 - momentum,
            training_mode=1,
            _outputs=3,
        )
        save_mean = op.ReduceMean(input, axes, keepdims=0)
        centered = op.Sub(input, op.ReduceMean(input, axes, keepdims=1))
        var = op.ReduceMean(op.Mul(centered, centered), axes, keepdims=0)
        save_rstd = op.Div(
            op.CastLike(op.Constant(value_float=1.0), var),
            op.Sqrt(op.Add(var, op.CastLike(op.Constant(value_float=eps), var))),
        )
        return norm, save_mean, save_rstd, new_mean, new_var

    return batch_norm


def _splits(opset: int) -> tuple[Any, Any]:
    """``split`` and ``split_with_sizes`` as one ``Split`` with a fixed number of outputs.

    torch_lib writes ``SplitToSequence`` and reads parts with ``SequenceAt``; the engine's
    gradient builder has neither (1.19.2). The number of parts is known whenever the split
    dim's size is (sizes given, or a static dim); a dynamic one keeps torch_lib's lowering and
    the engine's error names the node.
    """
    import onnxscript  # noqa: PLC0415 - optional: only this frontend needs it

    op = onnxscript.values.Opset("", opset)

    def _static(sizes: Any) -> list[int] | None:
        if isinstance(sizes, int):
            return [sizes]
        if isinstance(sizes, (list, tuple)) and all(isinstance(v, int) for v in sizes):
            return list(sizes)
        return None

    def parts(self: Any, sizes: list[int], dim: int) -> Any:
        if len(set(sizes)) == 1:
            # the translator counts Split's outputs from num_outputs only
            return op.Split(self, axis=dim, num_outputs=len(sizes))
        out, start = [], 0
        for size in sizes:
            out.append(
                op.Slice(
                    self,
                    op.Constant(value_ints=[start]),
                    op.Constant(value_ints=[start + size]),
                    op.Constant(value_ints=[dim]),
                )
            )
            start += size
        return tuple(out)

    def split_with_sizes(self: Any, split_sizes: Any, dim: int = 0) -> Any:
        sizes = _static(split_sizes)
        if sizes is None:
            return op.SplitToSequence(self, split_sizes, axis=dim)
        return parts(self, sizes, dim)

    def split(self: Any, split_size: Any, dim: int = 0) -> Any:
        size = _static(split_size)
        rank = len(self.shape) if self.shape is not None else None
        total = self.shape[dim] if rank is not None else None
        if size is None or len(size) != 1 or not isinstance(total, int):
            return op.SplitToSequence(self, split_size, axis=dim)
        step = size[0]
        sizes = [step] * (total // step) + ([total % step] if total % step else [])
        return parts(self, sizes, dim)

    return split, split_with_sizes


def _unary_schema(name: str) -> Any:
    """The schema of a float32 one-input, one-output com.microsoft operator."""
    import onnx  # noqa: PLC0415

    param = onnx.defs.OpSchema.FormalParameter
    return onnx.defs.OpSchema(
        name,
        "com.microsoft",
        1,
        inputs=[param("X", "T")],
        outputs=[param("Y", "T")],
        type_constraints=[("T", ["tensor(float)"], "float32")],
    )


def _gelu() -> Any:
    """``gelu`` as the engine's fused ``Gelu`` / ``FastGelu`` (com.microsoft) on float32.

    torch_lib writes GELU as its formula (``Div``, ``Erf``, ``Add``, ``Mul``; the tanh form as
    eight nodes), which the engine neither fuses (its GELU fusion matches another arrangement)
    nor recomputes as one subgraph; the TorchScript frontend writes the fused nodes
    (``symbolics.gelu``), whose gradients are GeluGrad / FastGeluGrad. Other dtypes keep
    torch_lib's formula: the engine's CPU kernels are float32 only.
    """
    import onnxscript  # noqa: PLC0415 - optional: only this frontend needs it
    from onnxscript.function_libs.torch_lib.ops import nn as torch_lib_nn  # noqa: PLC0415

    # the engine's contrib ops are not in onnx's schema registry: each is declared here
    msft = onnxscript.values.Opset("com.microsoft", 1)
    fused = {
        name: onnxscript.values.Op(msft, name, _unary_schema(name)) for name in ("Gelu", "FastGelu")
    }

    def gelu(self: Any, approximate: str = "none") -> Any:
        if getattr(self, "dtype", None) != onnxscript.ir.DataType.FLOAT:
            return torch_lib_nn.aten_gelu(self, approximate=approximate)
        return fused["FastGelu" if approximate == "tanh" else "Gelu"](self)

    return gelu


def _clamps_by_tensor(opset: int) -> tuple[Any, Any, Any]:
    """``clamp_min`` / ``clamp_max`` / ``clamp`` by tensors as ``Where``.

    torch_lib writes ``Max`` / ``Min`` (or ``Clip`` for a 0-d bound): the engine's Min/Max
    gradient splits a tie between the input and the bound (``x == t``: half each), PyTorch's
    clamp gives it all to the input; its Clip gradient has none for the bound (the build
    fails). ``Where(x <= t, x, t)`` gives the bound the gradient where it was chosen and the
    input the rest, as PyTorch's clamp backward does.
    """
    import onnxscript  # noqa: PLC0415 - optional: only this frontend needs it

    op = onnxscript.values.Opset("", opset)

    def clamp_min(self: Any, min: Any) -> Any:
        bound = op.CastLike(min, self)
        return op.Where(op.GreaterOrEqual(self, bound), self, bound)

    def clamp_max(self: Any, max: Any) -> Any:
        bound = op.CastLike(max, self)
        return op.Where(op.LessOrEqual(self, bound), self, bound)

    def clamp(self: Any, min: Any = None, max: Any = None) -> Any:
        # (with two bounds, lower == upper and x below both, PyTorch gives no one the
        # gradient and this the lower bound: the one tie left)
        out = self
        if min is not None:
            out = clamp_min(out, min)
        if max is not None:
            out = clamp_max(out, max)
        return out

    return clamp_min, clamp_max, clamp


def _copy_keeping_destination(opset: int) -> Any:
    """``copy(self, src)`` (functionalized ``self.copy_(src)``) as ``Where(True, src, self)``, src
    cast to self's type and broadcast to self's shape.

    torch_lib writes ``CastLike(src, self)``: the result no longer depends on ``self``, whose
    gradient eager gives zeros, and when ``src`` is a constant the whole output is one
    (``linalg.matrix_power(x, 0)`` is ``copy(clone(x), eye)``): eager's output requires grad,
    the engine's gradient builder fails on an output it has folded away ("couldn't find the
    producer node"). Where keeps ``self`` an input with a zero gradient, exactly, whatever its
    values (``self * 0`` would be NaN for an infinite one), and broadcasts ``src`` as copy_
    does (torch_lib does not).
    """
    import onnxscript  # noqa: PLC0415 - optional: only this frontend needs it

    op = onnxscript.values.Opset("", opset)

    def copy(self: Any, src: Any, non_blocking: bool = False) -> Any:
        shape = op.Shape(self)
        value = op.Expand(op.CastLike(src, self), shape)
        everywhere = op.Expand(op.Constant(value_ints=[1]), shape)
        return op.Where(op.Cast(everywhere, to=9), value, self)  # 9: BOOL

    return copy


def _refused(operator: str, why: str) -> Any:
    """A translation that refuses ``operator``, whose torch_lib lowering is wrong: the ATen route
    (``torch_export_aten``) takes an operator whose translation fails to PyTorch, and where it
    cannot, this error is what the user sees."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ExportError(
            f"{operator} is not supported by ORTMODULE_EXPORTER=torch_export: {why}; use the "
            "torchscript frontend (unset ORTMODULE_EXPORTER)"
        )

    return refuse


def training_translations(opset: int) -> dict[Any, Any]:
    """ATen overload -> onnxscript function, for the ops whose torch_lib lowering is wrong in
    training or has no gradient in the engine."""
    split, split_with_sizes = _splits(opset)
    clamp_min, clamp_max, clamp = _clamps_by_tensor(opset)
    aten = torch.ops.aten
    return {
        aten._native_batch_norm_legit_functional.default: _batch_norm_training(opset),
        aten.split.Tensor: split,
        aten.split_with_sizes.default: split_with_sizes,
        aten.gelu.default: _gelu(),
        aten.clamp_min.Tensor: clamp_min,
        aten.clamp_max.Tensor: clamp_max,
        aten.clamp.Tensor: clamp,
        aten.copy.default: _copy_keeping_destination(opset),
        # torch_lib writes exp(x**2) * (1 - erf(x)): 1 - erf(x) is 0 in float32 from x = 4
        # on, where erfcx(x) is about 1 / (x sqrt(pi)) (0.06 at x = 9: ours was 0)
        aten.special_erfcx.default: _refused(
            "torch.special.erfcx",
            "torch_lib's exp(x**2) * (1 - erf(x)) loses all precision for x > 3",
        ),
    }
