"""Which ONNX operators the engine can differentiate, asked of the engine itself.

The engine's gradient builders live in a C++ registry that ``_pybind_state`` does not list. So
each operator type is asked once per process: a one-node model (inputs typed from the ONNX
schema, required attributes filled in) goes through the engine's ``GradientGraphBuilder``, and
only the engine's own answer "The gradient builder has not been registered" counts as no. Any
other failure of the probe (a model the schema cannot describe) counts as yes, so a wrong guess
never reroutes an operator the engine can train. Answers are kept per engine version.

>>> from ortmodule_exporter.aten.engine_gradients import engine_has_gradient
>>> engine_has_gradient("Sin"), engine_has_gradient("CumSum")
(True, False)
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import onnx
import onnx.defs
import onnx.helper

from ..engine_binding import _C, import_onnxruntime

__all__ = ["engine_has_gradient", "engine_version", "probed"]

logger = logging.getLogger("ortmodule.exporter")

_NOT_REGISTERED = "gradient builder has not been registered"
_UNREACHABLE = "unreachable from the output node(s)"
_LOCK = threading.Lock()
_ANSWERS: dict[tuple[str, str, str, int], bool] = {}
#: ONNX types a probe input takes when its schema allows them, best first
_PREFERRED = ("tensor(float)", "tensor(int64)", "tensor(bool)")
#: the newest IR version the 1.19 engine loads
_IR_VERSION = 8
_ATTR_DEFAULTS: dict[int, Any] = {
    int(onnx.AttributeProto.INT): 1,
    int(onnx.AttributeProto.INTS): [1],
    int(onnx.AttributeProto.FLOAT): 1.0,
    int(onnx.AttributeProto.FLOATS): [1.0],
    int(onnx.AttributeProto.STRING): "",
}


def engine_version() -> str:
    return str(import_onnxruntime().__version__)


def _elem(schema: onnx.defs.OpSchema, formal: onnx.defs.OpSchema.FormalParameter) -> int:
    allowed: list[str] = []
    for constraint in schema.type_constraints:
        if constraint.type_param_str == formal.type_str:
            allowed = list(constraint.allowed_type_strs)
    if not allowed:
        allowed = [formal.type_str]
    for t in _PREFERRED:
        if t in allowed:
            return {
                "tensor(float)": onnx.TensorProto.FLOAT,
                "tensor(int64)": onnx.TensorProto.INT64,
                "tensor(bool)": onnx.TensorProto.BOOL,
            }[t]
    return onnx.TensorProto.FLOAT


def _is_sequence(schema: onnx.defs.OpSchema, formal: onnx.defs.OpSchema.FormalParameter) -> bool:
    """Whether ``formal`` takes only sequences (``seq(tensor(...))``)."""
    allowed = [formal.type_str]
    for constraint in schema.type_constraints:
        if constraint.type_param_str == formal.type_str:
            allowed = list(constraint.allowed_type_strs)
    return all(t.startswith("seq(") for t in allowed)


def _probe_model(op_type: str, domain: str, opset: int) -> tuple[onnx.ModelProto, list[str]]:
    """A one-node model whose loss reads the node's first output; a sequence (the sequence
    operators: torch_lib writes ``split_with_sizes`` as ``SplitToSequence`` + ``SequenceAt``)
    is typed as one of float tensors and read through ``SequenceAt``, so that the engine is
    asked about the operator itself rather than refusing a malformed model."""
    schema = onnx.defs.get_schema(op_type, opset, domain)
    inputs, names, float_inputs = [], [], []
    for i, formal in enumerate(schema.inputs):
        if formal.option == onnx.defs.OpSchema.FormalParameterOption.Optional:
            break
        name = f"x{i}"
        if _is_sequence(schema, formal):
            inputs.append(
                onnx.helper.make_tensor_sequence_value_info(name, onnx.TensorProto.FLOAT, None)
            )
            names.append(name)
            float_inputs.append(name)
            continue
        elem = _elem(schema, formal)
        inputs.append(onnx.helper.make_tensor_value_info(name, elem, None))
        names.append(name)
        if elem == onnx.TensorProto.FLOAT:
            float_inputs.append(name)
    attrs: dict[str, Any] = {}
    for name, a in schema.attributes.items():
        kind = int(getattr(a.type, "value", 0))  # a pybind enum; its stub has no int()
        if a.required and kind in _ATTR_DEFAULTS:
            attrs[name] = _ATTR_DEFAULTS[kind]
    nodes = [onnx.helper.make_node(op_type, names, ["y"], domain=domain, **attrs)]
    if schema.outputs and _is_sequence(schema, schema.outputs[0]):
        zero = onnx.helper.make_tensor("zero", onnx.TensorProto.INT64, [], [0])
        nodes.append(onnx.helper.make_node("Constant", [], ["first"], value=zero))
        nodes.append(onnx.helper.make_node("SequenceAt", ["y", "first"], ["y0"]))
        nodes.append(onnx.helper.make_node("ReduceSum", ["y0"], ["loss"], keepdims=0))
    else:
        nodes.append(onnx.helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0))
    graph = onnx.helper.make_graph(
        nodes,
        "probe",
        inputs,
        [onnx.helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])],
    )
    imports = [onnx.helper.make_opsetid("", opset)]
    if domain:
        imports.append(onnx.helper.make_opsetid(domain, 1))
    model = onnx.helper.make_model(graph, opset_imports=imports)
    model.ir_version = _IR_VERSION
    return model, float_inputs


def _probe(op_type: str, domain: str, opset: int) -> bool:
    try:
        model, float_inputs = _probe_model(op_type, domain, opset)
    except Exception:  # noqa: BLE001 - not an ONNX schema we can describe: assume trainable
        return True
    if not float_inputs:
        return True
    C = _C()
    # the same builder as a real build, so the engine's pre-gradient rewrites apply (it trains
    # BatchNormalization as BatchNormInternal, which has the gradient)
    config = C.OrtModuleGraphBuilderConfiguration()
    config.initializer_names = []
    config.initializer_names_to_train = []
    config.input_names_require_grad = list(float_inputs)
    config.build_gradient_graph = True
    config.enable_caching = False
    config.loglevel = C.Severity(3) if hasattr(C, "Severity") else 3
    transformer = C.TrainingGraphTransformerConfiguration()
    transformer.propagate_cast_ops_config = C.PropagateCastOpsConfiguration()
    transformer.enable_compute_optimizer = False
    try:
        builder = C.OrtModuleGraphBuilder()
        builder.initialize(model.SerializeToString(), config)
        builder.build(transformer)
    except Exception as err:  # noqa: BLE001 - the engine's answer is in the message
        if _NOT_REGISTERED in str(err):
            return False
        # the builder does not follow a sequence-typed edge: through SplitToSequence the
        # input is "unreachable from the output node(s)", which is a no as well
        return not (_takes_sequences(model) and _UNREACHABLE in str(err))
    return True


def _takes_sequences(model: onnx.ModelProto) -> bool:
    return any(
        vi.type.HasField("sequence_type") for vi in (*model.graph.input, *model.graph.value_info)
    ) or any(n.op_type == "SequenceAt" for n in model.graph.node)


def engine_has_gradient(op_type: str, domain: str = "", opset: int = 17) -> bool:
    """Whether the engine has a gradient builder for ``domain::op_type`` (asked once)."""
    key = (engine_version(), domain, op_type, opset)
    with _LOCK:
        answer = _ANSWERS.get(key)
        if answer is None:
            answer = _probe(op_type, domain, opset)
            _ANSWERS[key] = answer
            if not answer:
                logger.debug("the engine has no gradient for %s::%s", domain or "ai.onnx", op_type)
        return answer


def probed() -> dict[str, bool]:
    """Every answer so far: ``"domain::op_type"`` -> has a gradient."""
    with _LOCK:
        return {f"{d or 'ai.onnx'}::{t}": v for (_v, d, t, _o), v in _ANSWERS.items()}
