"""Finding fusible subgraphs: config rules, conditions, min_nodes, initializers, no cycles."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import model
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

from ortmodule_triton import TritonConfigError, parse_config
from ortmodule_triton.fusion_config import FusionConfig
from ortmodule_triton.partition import find_subgraphs, replace_subgraphs

F = T.FLOAT


def chain_with_matmul():
    """a -> Relu -> MatMul -> Exp -> Add(., Relu out): the MatMul splits two fusible parts, and
    fusing Relu with Exp/Add would need the MatMul inside (a cycle)."""
    return model(
        [
            h.make_node("Relu", ["x"], ["r"], name="relu"),
            h.make_node("Mul", ["r", "two"], ["m"], name="mul"),
            h.make_node("MatMul", ["m", "w"], ["mm"], name="matmul"),
            h.make_node("Exp", ["mm"], ["e"], name="exp"),
            h.make_node("Add", ["e", "m"], ["y"], name="add"),
        ],
        [("x", F, ["n", 4]), ("w", F, [4, 4])],
        [("y", F, ["n", 4])],
        [numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")],
    )


def names(m, subs):
    return [[m.graph.node[k].name for k in s.nodes] for s in subs]


def test_groups_do_not_swallow_a_path_through_an_unfused_node():
    m = chain_with_matmul()
    subs = find_subgraphs(m, FusionConfig.default())
    assert names(m, subs) == [["relu", "mul"], ["exp", "add"]]
    first, second = subs
    assert first.inputs == ("x",) and first.outputs == ("m",)  # the scalar is embedded
    assert second.inputs == ("mm", "m") and second.outputs == ("y",)
    replace_subgraphs(
        m, subs, lambda s, i: [h.make_node("Identity", [s.inputs[0]], list(s.outputs))]
    )
    assert [n.op_type for n in m.graph.node] == ["Identity", "MatMul", "Identity"]


def test_min_nodes_and_initializer_policy():
    m = chain_with_matmul()
    config = parse_config(
        '{"ops": {"Relu": {"versions": [14]}, "Mul": {"versions": [14]}, "Exp": {"versions": [13]},'
        ' "Add": {"versions": [14]}}, "initializer": "none", "min_nodes": 3}'
    )
    assert find_subgraphs(m, config) == []  # two groups of two
    config = parse_config(
        '{"ops": {"Relu": {"versions": [14]}, "Mul": {"versions": [14]}}, "initializer": "none",'
        ' "min_nodes": 2}'
    )
    (sub,) = find_subgraphs(m, config)
    assert sub.inputs == ("x", "two")  # "none": the scalar initializer stays an input


def test_multi_axis_reduction_axes_are_embedded_under_initializer_none():
    m = model(
        [
            h.make_node("Exp", ["x"], ["e"], name="exp"),
            h.make_node("ReduceSum", ["e", "axes"], ["y"], name="sum", keepdims=1),
        ],
        [("x", F, ["n", 3, 5])],
        [("y", F, ["n", 1, 1])],
        [numpy_helper.from_array(np.array([1, 2], dtype=np.int64), "axes")],
    )
    config = parse_config(
        '{"ops": {"Exp": {"versions": [13]}, "ReduceSum": {"versions": [13]}},'
        ' "initializer": "none"}'
    )
    (sub,) = find_subgraphs(m, config)
    assert sub.inputs == ("x",)


def test_versions_and_conditions():
    m = model(
        [
            h.make_node("Exp", ["x"], ["e"], name="exp"),
            h.make_node("ReduceSum", ["e", "axes"], ["s"], name="sum", keepdims=1),
            h.make_node("Div", ["e", "s"], ["y"], name="div"),
        ],
        [("x", F, ["n", 5])],
        [("y", F, ["n", 5])],
        [numpy_helper.from_array(np.array([-1], dtype=np.int64), "axes")],
    )

    def config(condition: str, versions: str = "[13]") -> FusionConfig:
        return parse_config(
            '{"ops": {"Exp": {"versions": [13]}, "Div": {"versions": [14]}, "ReduceSum": '
            f'{{"versions": {versions}, "conditions": {{"axes": "{condition}"}}}}}}}}'
        )

    assert names(m, find_subgraphs(m, config("[-1]"))) == [["exp", "sum", "div"]]
    assert names(m, find_subgraphs(m, config("single"))) == [["exp", "sum", "div"]]
    assert names(m, find_subgraphs(m, config("constant"))) == [["exp", "sum", "div"]]
    # axes [1] is not [-1] as written: ReduceSum stays out, Exp and Div cannot join around it
    assert find_subgraphs(m, config("[1]")) == []
    assert find_subgraphs(m, config("[-1]", versions="[1, 11]")) == []


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[]", "must be a JSON object"),
        ('{"ops": {}}', "non-empty object"),
        ('{"ops": {"Add": {}}}', "'versions' must be"),
        ('{"ops": {"Add": {"versions": [14], "colour": 1}}}', r"unknown keys \['colour'\]"),
        ('{"ops": {"Add": {"versions": [14]}}, "initializer": "some"}', "'initializer' is 'some'"),
        ('{"ops": {"Add": {"versions": [14]}}, "min_nodes": 0}', "'min_nodes' is 0"),
        ('{"ops": {"Add": {"versions": [14], "conditions": {"axis": "[oops"}}}}', "condition axis"),
        ("{oops", "is not JSON"),
    ],
)
def test_config_errors_name_the_key(text, match):
    with pytest.raises(TritonConfigError, match=match):
        parse_config(text, "cfg.json")


def test_default_config_round_trips_through_the_engine_json():
    config = FusionConfig.default()
    again = parse_config(config.to_json())
    # one name per op in the format: com.microsoft's Gelu stands for both
    assert set(again.ops) == set(config.ops) - {("", "Gelu")}
    assert again.ops[("", "Add")].versions == frozenset({1, 6, 7, 13, 14})
