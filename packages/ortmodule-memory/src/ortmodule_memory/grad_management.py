"""Memory-efficient gradient management: each parameter gets its gradient as soon as it exists.

Without it the engine returns every parameter gradient at the end of its backward run, so
all of them are alive at once. With ``ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT=1`` a training
graph's trainable parameters leave the graph inputs: one ``PythonOp`` per parameter at the
front of the graph produces it from a one-element trigger input, and that PythonOp's backward
calls ``param.backward(grad)`` the moment the engine has the gradient. PyTorch accumulates it
into ``param.grad`` exactly as in eager (tensor hooks, post-accumulate hooks, DDP's bucket
hooks, gradient accumulation across steps all fire as usual), and the engine can release the
buffer. The trigger's gradient is then the engine's only backward output.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import onnx
import torch

from ortmodule_exporter import ExportedModel
from ortmodule_exporter.components import StepContext, StepHook
from ortmodule_exporter.export import ExtraInput
from ortmodule_exporter.python_op import PYTHON_OP_DOMAIN, REGISTRY, python_op_node

from .options import MEM_EFFICIENT_GRAD_MGMT

__all__ = ["GRAD_MGMT", "TRIGGER", "ParamPull", "ParamSource", "pull_parameters"]

logger = logging.getLogger("ortmodule.memory")

GRAD_MGMT = MEM_EFFICIENT_GRAD_MGMT.name
TRIGGER = "mem_efficient_pull_weight_trigger"
FUNC_NAME = "ortmodule_memory.ParamPull"

# parameter names by key, the int the PythonOp carries (names are the same for every module
# with this structure, so the table grows with distinct names only)
_NAMES: list[str] = []
_KEYS: dict[str, int] = {}
_LOCK = threading.Lock()


def _key(name: str) -> int:
    with _LOCK:
        if name not in _KEYS:
            _KEYS[name] = len(_NAMES)
            _NAMES.append(name)
        return _KEYS[name]


class ParamSource(StepHook):
    """Tells :class:`ParamPull` which module's parameters the running forward reads."""

    _local = threading.local()

    @classmethod
    def current(cls) -> torch.nn.Module:
        module: torch.nn.Module | None = getattr(cls._local, "module", None)
        if module is None:
            raise RuntimeError(
                f"{FUNC_NAME} ran outside an ORTModule forward; memory-efficient gradient "
                f"management ({GRAD_MGMT}=1) needs the ortmodule-memory step hook registered"
            )
        return module

    def applies_to(self, ctx: StepContext) -> bool:
        return bool(ctx.options.get(GRAD_MGMT))

    def pre_forward(self, ctx: StepContext) -> None:
        self._local.module = ctx.module


class ParamPull(torch.autograd.Function):
    """Forward: the parameter named by ``key``; backward: ``param.backward(grad)``."""

    @staticmethod
    def forward(ctx: Any, trigger: torch.Tensor, key: int) -> torch.Tensor:
        param = ParamSource.current().get_parameter(_NAMES[key])
        ctx.param = param
        ctx.trigger = (trigger.shape, trigger.dtype, trigger.device)
        return param.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # a leaf's backward accumulates into .grad and runs its hooks (DDP's among them)
        ctx.param.backward(grad)
        shape, dtype, device = ctx.trigger
        return torch.zeros(shape, dtype=dtype, device=device), None


def pull_parameters(exported: ExportedModel, options: Mapping[str, Any]) -> None:
    """Post-export pass: trainable parameters -> one ParamPull PythonOp each, fed by a trigger."""
    if not options.get(GRAD_MGMT) or not exported.training:
        return
    if options.get("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD") is False:
        logger.warning(
            "%s=1 is ignored: it needs custom autograd Functions (ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=1)",
            GRAD_MGMT,
        )
        return
    module = getattr(ParamSource._local, "module", None)
    if module is None:
        logger.warning(
            "%s=1: no ORTModule forward is running, so the parameters cannot be told apart from "
            "buffers; the graph keeps its parameters as inputs",
            GRAD_MGMT,
        )
        return
    graph = exported.model.graph
    # trainable parameters only: frozen ones and buffers stay graph inputs (a change of
    # requires_grad changes the runtime's graph key, so this pass runs again)
    params = {name for name, p in module.named_parameters() if p.requires_grad}
    params &= set(exported.param_names)
    float_types = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                   onnx.TensorProto.DOUBLE}  # fmt: skip
    moved = [
        vi
        for vi in graph.input
        if vi.name in params and vi.type.tensor_type.elem_type in float_types
    ]
    if not moved:
        return
    entry = REGISTRY.register(ParamPull, name=FUNC_NAME)
    from ortmodule_exporter.python_op import runner as python_op_runner

    python_op_runner.install()
    nodes = []
    for vi in moved:
        elem = vi.type.tensor_type.elem_type
        rank = len(vi.type.tensor_type.shape.dim)
        nodes.append(
            python_op_node(
                entry,
                [TRIGGER],
                [f"{vi.name}/pull_ctx", vi.name],
                name=f"{vi.name}/pull",
                convention="dc",
                types=([onnx.TensorProto.FLOAT], [elem]),
                ranks=([1], [rank]),
                training=True,
                scalars={"int": ([_key(vi.name)], [1])},
            )
        )
        graph.value_info.append(vi)  # the parameter's exact shape, now as an inner value
        graph.input.remove(vi)
    for i, node in enumerate(nodes):
        graph.node.insert(i, node)
    graph.input.insert(
        len(exported.user_input_names),
        onnx.helper.make_tensor_value_info(TRIGGER, onnx.TensorProto.FLOAT, [1]),
    )
    if not any(o.domain == PYTHON_OP_DOMAIN for o in exported.model.opset_import):
        exported.model.opset_import.append(onnx.helper.make_opsetid(PYTHON_OP_DOMAIN, 1))
    moved_names = {vi.name for vi in moved}
    exported.param_names = tuple(n for n in exported.param_names if n not in moved_names)
    exported.extra_inputs[TRIGGER] = ExtraInput((1,), torch.float32, requires_grad=True)
