"""The CUDA engine's ``TritonOp`` executor (GPU-only; never run on the machines this was built on).

In its CUDA build the engine has a ``TritonFusion`` graph transformer and a ``TritonOp`` kernel.
Once an executor is registered (``register_triton_op_executor(config_getter, by_name, by_onnx)``
in ``onnxruntime.capi._pybind_state``), every session it creates runs the transformer on the
*training* graph, forward and gradient nodes alike, with the config ``config_getter()`` returns
(the JSON format of :mod:`ortmodule_triton.fusion_config`), and replaces each fused subgraph by a
``TritonOp`` node carrying the subgraph (``onnx_key``, ``onnx_string``). At run time the kernel
calls ``by_onnx(onnx_key, onnx_bytes, *dlpack_inputs)`` and expects a tuple of DLPack outputs;
``TritonOp`` nodes naming a ``func_name`` call ``by_name(func_name, *dlpack_inputs, **attrs)``.
This module provides both callbacks: ``by_onnx`` compiles the subgraph once per key with
:func:`ortmodule_triton.compile_subgraph`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import onnx
import torch
from torch.utils.dlpack import from_dlpack, to_dlpack  # type: ignore[attr-defined]

from .codegen import generate
from .debug import dump
from .kernel import CompiledSubgraph

__all__ = [
    "register_kernel_function",
    "register_triton_executor",
    "run_by_name",
    "run_by_onnx",
    "triton_executor_registered",
]

logger = logging.getLogger("ortmodule.triton")

_LOCK = threading.Lock()
_KERNELS: dict[int, CompiledSubgraph] = {}
_FUNCTIONS: dict[str, Callable[..., Any]] = {}
_CONFIG: list[str] = ["{}"]
_REGISTERED = [False]


def _to_torch(capsule: Any) -> torch.Tensor | None:
    return None if capsule is None else from_dlpack(capsule)


def _to_capsules(outputs: Any) -> Any:
    if isinstance(outputs, torch.Tensor):
        return to_dlpack(outputs.contiguous())
    return tuple(to_dlpack(t.contiguous()) for t in outputs)


def run_by_onnx(onnx_key: int, onnx_bytes: bytes, *capsules: Any) -> Any:
    """``TritonOp`` with a subgraph: compile it once per key, run it, return DLPack outputs."""
    with _LOCK:
        kernel = _KERNELS.get(onnx_key)
        if kernel is None:
            model = onnx.load_from_string(onnx_bytes)
            plan = generate(model)
            dump(plan, model, model)
            kernel = _KERNELS[onnx_key] = CompiledSubgraph(plan)
    tensors = [_to_torch(c) for c in capsules]
    return _to_capsules(kernel(*[t for t in tensors if t is not None]))


def register_kernel_function(name: str, fn: Callable[..., Any]) -> None:
    """Make ``fn(*tensors, **attrs)`` callable from ``TritonOp(func_name=name)`` nodes."""
    _FUNCTIONS[name] = fn


def run_by_name(func_name: str, *capsules: Any, **kwargs: Any) -> Any:
    fn = _FUNCTIONS.get(func_name)
    if fn is None:
        raise KeyError(
            f"TritonOp asks for kernel function {func_name!r}, which nothing registered; "
            f"registered: {sorted(_FUNCTIONS)}"
        )
    result = fn(*[_to_torch(c) for c in capsules], **kwargs)
    return None if result is None else _to_capsules(result)


def triton_executor_registered() -> bool:
    return _REGISTERED[0]


def register_triton_executor(engine: Any, config_json: str) -> bool:
    """Register the executor with the engine once per process (the engine accepts one);
    later calls only update the config the engine reads at session creation."""
    _CONFIG[0] = config_json
    with _LOCK:
        if _REGISTERED[0]:
            return False
        engine.register_triton_op_executor(lambda: _CONFIG[0], run_by_name, run_by_onnx)
        _REGISTERED[0] = True
    logger.info("Triton executor registered with the CUDA engine")
    return True
