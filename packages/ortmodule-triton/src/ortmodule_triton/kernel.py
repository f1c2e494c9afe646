"""Run a generated kernel on torch tensors: on CUDA compiled by Triton, on CPU interpreted.

>>> import onnx, torch
>>> from onnx import TensorProto as T, helper as h
>>> g = h.make_graph([h.make_node("Relu", ["x"], ["y"])], "g",
...     [h.make_tensor_value_info("x", T.FLOAT, ["n"])], [h.make_tensor_value_info("y", T.FLOAT, ["n"])])
>>> relu = compile_subgraph(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]))
>>> relu(torch.tensor([-1.0, 2.0]))
(tensor([0., 2.]),)

On CPU the kernel runs under Triton's interpreter (what ``TRITON_INTERPRET=1`` selects): exact,
and far slower than torch, so it is for verification.
"""

from __future__ import annotations

import importlib.util
import math
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch

from .codegen import KernelPlan, generate
from .errors import TritonCodegenError
from .runtime import check_device, load_triton

__all__ = ["CompiledSubgraph", "LaunchConfig", "compile_subgraph"]

_TORCH_TYPES: dict[int, torch.dtype] = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.UINT8: torch.uint8,
    onnx.TensorProto.BOOL: torch.bool,
}

_SOURCE_DIR: list[Path] = []
_LOCK = threading.Lock()


@dataclass(frozen=True)
class LaunchConfig:
    """Block size (elementwise template; the row template's block is the row), warps and, for
    the row template, rows per program."""

    block: int
    num_warps: int
    rows: int = 1


def _source_dir() -> Path:
    with _LOCK:
        if not _SOURCE_DIR:
            _SOURCE_DIR.append(Path(tempfile.mkdtemp(prefix="ortmodule_triton_")))
        return _SOURCE_DIR[0]


def _load_function(plan: KernelPlan) -> Callable[..., Any]:
    """The kernel as a plain Python function from a real file: Triton's JIT reads the source
    back with ``inspect``, so generated code must live in a module file."""
    path = _source_dir() / f"{plan.fn_name}.py"
    if not path.exists():
        path.write_text(plan.source)
    spec = importlib.util.spec_from_file_location(
        f"ortmodule_triton_generated.{plan.fn_name}", path
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn: Callable[..., Any] = getattr(module, plan.fn_name)
    return fn


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return strides[::-1]


def _broadcast(shapes: Sequence[Sequence[int]]) -> list[int]:
    """numpy broadcasting of equal-rank shapes; RuntimeError when they do not broadcast."""
    out = [1] * (len(shapes[0]) if shapes else 0)
    for shape in shapes:
        for d, size in enumerate(shape):
            if size != out[d] and out[d] != 1 and size != 1:
                raise RuntimeError(f"shape {tuple(shape)} does not broadcast")
            if out[d] == 1:
                out[d] = size
    return out


#: ``fn(plan, shape key, default, run)`` picks a launch config; see :mod:`ortmodule_triton.tuning`
Chooser = Callable[[KernelPlan, str, LaunchConfig, Callable[[LaunchConfig], None]], LaunchConfig]
_CHOOSER: list[Chooser | None] = [None]


def set_launch_chooser(chooser: Chooser | None) -> None:
    """Install the tuner (``None``: default block sizes)."""
    _CHOOSER[0] = chooser


class CompiledSubgraph:
    """A callable over torch tensors: the subgraph's inputs in, its outputs (a tuple) out."""

    def __init__(self, plan: KernelPlan) -> None:
        self.plan = plan
        self._fn = _load_function(plan)
        self._kernels: dict[str, Any] = {}
        self._hidden: dict[torch.device, list[torch.Tensor]] = {}

    @property
    def source(self) -> str:
        return self.plan.source

    def _kernel(self, device: torch.device) -> Any:
        check_device(device, self.plan.fn_name)
        kind = device.type
        if kind not in self._kernels:
            self._kernels[kind] = load_triton().jit(self._fn)
        return self._kernels[kind]

    def _hidden_tensors(self, device: torch.device) -> list[torch.Tensor]:
        if device not in self._hidden:
            self._hidden[device] = [
                torch.from_numpy(arr.copy()).to(device) for _, arr in self.plan.hidden
            ]
        return self._hidden[device]

    def default_config(self, n: int, rows_total: int = 1) -> LaunchConfig:
        if self.plan.reduce_start is None:
            return LaunchConfig(1024, 4)
        block = 1 << max(n - 1, 0).bit_length()
        # up to 4096 elements per program: many short rows share one
        rows = max(1, min(1 << max(rows_total - 1, 0).bit_length(), 4096 // block))
        return LaunchConfig(block, max(1, min(16, block * rows // 256)), rows)

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        plan = self.plan
        if len(tensors) != len(plan.inputs):
            raise TypeError(
                f"{plan.fn_name} takes {len(plan.inputs)} tensors "
                f"({', '.join(s.name for s in plan.inputs)}), got {len(tensors)}"
            )
        device = tensors[0].device
        for ispec, t in zip(plan.inputs, tensors, strict=True):
            want = _TORCH_TYPES[ispec.dtype]
            if not isinstance(t, torch.Tensor) or t.dtype != want or t.dim() != ispec.rank:
                got = (
                    f"{t.dtype}, rank {t.dim()}"
                    if isinstance(t, torch.Tensor)
                    else type(t).__name__
                )
                raise TypeError(
                    f"{plan.fn_name}: input {ispec.name!r} must be a rank-{ispec.rank} {want} tensor, "
                    f"got {got}"
                )
            if t.device != device:
                raise ValueError(
                    f"{plan.fn_name}: input {ispec.name!r} is on {t.device}, not {device}"
                )
        loaded = [t.contiguous() for t in (*tensors, *self._hidden_tensors(device))]
        rank = plan.rank
        shapes = [[1] * (rank - t.dim()) + list(t.shape) for t in loaded]
        try:
            ref = _broadcast(shapes)
        except RuntimeError:
            names = [s.name for s in plan.inputs] + [n for n, _ in plan.hidden]
            raise ValueError(
                f"{plan.fn_name}: input shapes do not broadcast: "
                + ", ".join(f"{n}={tuple(t.shape)}" for n, t in zip(names, loaded, strict=True))
            ) from None
        start = plan.reduce_start
        rows = math.prod(ref[:start]) if start is not None else 1
        n = math.prod(ref[start:]) if start is not None else math.prod(ref)
        outputs: list[torch.Tensor] = []
        for spec in plan.outputs:
            dtype = _TORCH_TYPES[spec.dtype]
            if spec.kind == "full":
                own = _broadcast([shapes[i] for i in spec.deps])
                if own != ref:
                    raise TritonCodegenError(
                        f"{plan.fn_name}: output {spec.name!r} has shape {tuple(own)}, smaller "
                        f"than the kernel's {tuple(ref)}; it needs a kernel of its own"
                    )
                outputs.append(torch.empty(ref, dtype=dtype, device=device))
            elif spec.kind == "row":
                assert start is not None
                shape = ref[:start] + ([1] * (rank - start) if spec.rank == rank else [])
                outputs.append(torch.empty(shape, dtype=dtype, device=device))
            else:
                assert start is not None
                outputs.append(torch.zeros(ref[start:], dtype=torch.float32, device=device))
        total = rows * n
        if total:
            ref_strides = _contiguous_strides(ref)
            strides: list[int] = []
            flags: dict[str, bool] = {}
            for i, shape in enumerate(shapes):
                own_strides = _contiguous_strides(shape)
                strides += [
                    0 if shape[d] == 1 and ref[d] != 1 else own_strides[d] for d in range(rank)
                ]
                flags[f"BC{i}"] = shape != ref
            seeds = [
                s if s is not None else int(torch.randint(0, 2**31 - 1, ()).item())
                for s in plan.seeds
            ]
            kernel = self._kernel(device)
            sizes = [rows, n] if start is not None else [total]
            args = [*loaded, *outputs, *sizes, *ref, *ref_strides]
            args += [*strides, *seeds]

            col = [k for k, spec in enumerate(plan.outputs) if spec.kind == "col"]

            def run(config: LaunchConfig) -> None:
                for k in col:  # summed atomically: a tuning run must start from zero too
                    outputs[k].zero_()
                if start is not None:
                    g = (-(-rows // config.rows),)
                    extra = {"ROWS": config.rows}
                else:
                    g, extra = (-(-total // config.block),), {}
                kernel[g](*args, **flags, **extra, BLOCK=config.block, num_warps=config.num_warps)

            config = self.default_config(n, rows)
            chooser = _CHOOSER[0]
            if chooser is not None:
                key = f"{tuple(ref)}:{[str(t.dtype) for t in loaded]}"
                config = chooser(plan, key, config, run)
            run(config)
        for k, spec in enumerate(plan.outputs):
            if spec.kind == "col":
                shape = list(outputs[k].shape)[len(outputs[k].shape) - spec.rank :]
                outputs[k] = outputs[k].reshape(shape).to(_TORCH_TYPES[spec.dtype])
        return tuple(outputs)


def compile_subgraph(model: onnx.ModelProto) -> CompiledSubgraph:
    """Generate and load the Triton kernel of ``model``'s graph.

    The result takes the graph's inputs (torch tensors, in the graph's order, on CUDA or CPU)
    and returns its outputs as a tuple, in the graph's order.
    """
    return CompiledSubgraph(generate(model))
