"""Schema equality, hashing, printing, and describe_difference's reasons."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections import OrderedDict
from typing import Any

import pytest
import pytree_cases
import torch
from pytree_cases import Color, Pair, Point, Triple

from ortmodule_pytree import Schema, TensorSpec, describe_difference, flatten, unflatten


def schema_of(obj: Any, **kwargs: Any) -> Schema:
    return flatten(obj, **kwargs)[1]


def batch(n: int = 2, seq: int = 5, **kwargs: Any) -> dict[str, Any]:
    inputs: dict[str, Any] = {
        "input_ids": torch.zeros(n, seq, dtype=torch.int64),
        "mask": torch.ones(n, seq),
        "use_cache": False,
    }
    inputs.update(kwargs)
    return inputs


def test_batch_and_sequence_length_do_not_change_the_schema() -> None:
    a, b = schema_of(batch(2, 5)), schema_of(batch(8, 17))
    assert a == b and hash(a) == hash(b)
    assert describe_difference(a, b) == ""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_is_part_of_the_schema() -> None:
    on_gpu = batch(mask=torch.ones(2, 5, device="cuda"))
    assert describe_difference(schema_of(batch()), schema_of(on_gpu)) == (
        "input 'input.mask' device changed cpu -> cuda:0"
    )
    assert schema_of(on_gpu).tensor_specs[1].device == torch.device("cuda", 0)


def test_static_shapes_make_shapes_part_of_the_schema() -> None:
    a = schema_of(batch(2, 5), static_shapes=True)
    b = schema_of(batch(8, 5), static_shapes=True)
    assert a != b
    assert schema_of(batch(2, 5), static_shapes=True) == a
    assert a != schema_of(batch(2, 5))
    assert describe_difference(a, b) == (
        "input 'input.input_ids' shape changed (2, 5) -> (8, 5) (and 1 more difference)"
    )
    assert a.tensor_specs[1].shape == (2, 5)
    assert schema_of(batch(2, 5)).tensor_specs[1].shape is None


def test_an_empty_tensor_keeps_its_shape_in_the_schema() -> None:
    # the exporter treats zero-element inputs apart: turning one empty (or back) re-exports
    _, empty = flatten((torch.ones(0, 3),))
    assert empty.tensor_specs[0].shape == (0, 3)
    assert flatten((torch.ones(2, 3),))[1] != empty
    assert flatten((torch.ones(5, 3),))[1] == flatten((torch.ones(2, 3),))[1]


def test_dims_of_size_one_count_in_the_schema() -> None:
    # a graph may treat a size-1 dim as a broadcast one (the exporter keeps it a fixed 1)
    _, one = flatten((torch.ones(1, 3),))
    assert one.tensor_specs[0].shape == (1, -1)
    assert flatten((torch.ones(1, 7),))[1] == one
    assert flatten((torch.ones(2, 3),))[1] != one
    assert flatten((torch.ones(2, 3),))[1].tensor_specs[0].shape is None
    assert describe_difference(one, flatten((torch.ones(2, 3),))[1]) == (
        "input 'input.0' shape changed (1, *) -> dynamic"
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (
            {"mask": torch.ones(2, 5, dtype=torch.bool)},
            "input 'input.mask' dtype changed torch.float32 -> torch.bool",
        ),
        ({"mask": torch.ones(2, 5, 3)}, "input 'input.mask' rank changed 2 -> 3"),
        (
            {"mask": torch.ones(2, 5, requires_grad=True)},
            "input 'input.mask' requires_grad changed False -> True",
        ),
        (
            {"mask": torch.ones(2, 5, device="meta")},
            "input 'input.mask' device changed cpu -> meta",
        ),
        ({"use_cache": True}, "input.use_cache changed False -> True"),
        ({"use_cache": 0}, "input.use_cache changed False -> 0"),
        (
            {"extra": torch.ones(2)},
            "structure changed at input: dict with keys ['input_ids', 'mask', 'use_cache'] "
            "-> dict with keys ['input_ids', 'mask', 'use_cache', 'extra']; "
            "number of input tensors changed 2 -> 3",
        ),
        (
            {"use_cache": torch.ones(2)},
            "number of input tensors changed 2 -> 3: 'input.use_cache' was False, "
            "now Tensor(float32, ndim=1, cpu)",
        ),
        (
            {"mask": torch.ones(2, 5, dtype=torch.float64, requires_grad=True)},
            "input 'input.mask' dtype changed torch.float32 -> torch.float64, "
            "requires_grad changed False -> True",
        ),
    ],
)
def test_each_kind_of_change_is_a_new_schema_with_a_reason(
    change: dict[str, Any], reason: str
) -> None:
    old, new = schema_of(batch()), schema_of(batch(**change))
    assert old != new
    assert describe_difference(old, new) == reason


@pytest.mark.parametrize(
    ("old", "new", "reason"),
    [
        (
            [torch.ones(2)],
            (torch.ones(2),),
            "structure changed at input: list of length 1 -> tuple of length 1",
        ),
        (
            {"a": torch.ones(2)},
            OrderedDict(a=torch.ones(2)),
            "structure changed at input: dict with keys ['a'] -> OrderedDict with keys ['a']",
        ),
        (
            {"a": [1, torch.ones(2)]},
            {"a": [1, torch.ones(2), 2]},
            "structure changed at input['a']: list of length 2 -> list of length 3",
        ),
        (
            Pair(torch.ones(2), 2),
            Triple(torch.ones(2), 2, 3),
            "structure changed at input: Pair(first, second) -> Triple(a, b, c)",
        ),
        (
            [Point(torch.ones(2))],
            [Pair(torch.ones(2), None)],
            "structure changed at input[0]: Point(x, y) -> Pair(first, second)",
        ),
        (
            {"a": torch.ones(2)},
            {"a": [torch.ones(2)]},
            "structure changed at input['a']: Tensor(float32, ndim=1, cpu) -> list of length 1",
        ),
        (
            {"a": {}},
            {"a": {"b": None}},
            "structure changed at input['a']: empty dict -> dict with keys ['b']",
        ),
    ],
)
def test_structure_changes_say_where(old: Any, new: Any, reason: str) -> None:
    assert describe_difference(schema_of(old), schema_of(new)) == reason


def test_same_named_classes_are_told_apart_by_module() -> None:
    @dataclasses.dataclass
    class Point:
        x: Any
        y: Any = None

    Point.__qualname__ = "Point"
    reason = describe_difference(schema_of(pytree_cases.Point(1)), schema_of(Point(1)))
    assert reason == (
        "structure changed at input: pytree_cases.Point(x, y) -> test_pytree_schema.Point(x, y)"
    )


def test_a_tensor_and_a_constant_trading_places() -> None:
    old, new = schema_of([torch.ones(2), None]), schema_of([None, torch.ones(2)])
    assert describe_difference(old, new) == (
        "input 'input.0' was Tensor(float32, ndim=1, cpu), now None (and 1 more difference)"
    )


def test_constants_are_compared_with_their_type() -> None:
    assert schema_of([True]) != schema_of([1])
    assert schema_of([1]) != schema_of([1.0])
    assert schema_of([0.0]) != schema_of([-0.0])
    assert schema_of([float("nan")]) == schema_of([float("nan")])
    assert schema_of([Color.RED]) != schema_of([Color.BLUE])
    assert schema_of([torch.float32]) != schema_of([torch.float16])
    assert schema_of(["a"]) != schema_of([b"a"])


def test_prefix_is_part_of_the_schema() -> None:
    a, b = schema_of([torch.ones(1)]), schema_of([torch.ones(1)], prefix="output")
    assert a != b
    assert describe_difference(a, b) == "prefix changed 'input' -> 'output'"
    assert b.names == ("output.0",)


def test_schema_is_frozen_and_usable_as_a_key() -> None:
    schema = schema_of(batch())
    with pytest.raises(AttributeError):
        schema.prefix = "x"
    with pytest.raises(AttributeError):
        schema.foo = 1  # type: ignore[attr-defined]
    cache = {schema: "graph"}
    assert cache[schema_of(batch(4, 9))] == "graph"
    assert schema != "not a schema"


# torch's own LeafSpec warns about a deprecation of its own when it is unpickled.
@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
def test_schema_survives_pickle_and_deepcopy() -> None:
    obj = {
        "a": [torch.ones(2), Point(torch.ones(1), Color.RED)],
        "b": pytree_cases.CausalLMOutput(logits=torch.ones(1)),
        "c": pytree_cases.Bag([torch.ones(1)], tag="t"),
        "d": OrderedDict(e=Pair(1.5, None)),
    }
    tensors, schema = flatten(obj)
    for copied in (pickle.loads(pickle.dumps(schema)), copy.deepcopy(schema)):
        assert copied == schema and hash(copied) == hash(schema)
        assert copied.names == schema.names
        pytree_cases.assert_same(unflatten(tensors, copied), obj)


def test_tensor_specs() -> None:
    x = torch.ones(2, 3, requires_grad=True)
    schema = schema_of({"x": x, "n": torch.zeros(4, dtype=torch.int64)})
    assert schema.tensor_specs == (
        TensorSpec("input.x", torch.float32, 2, torch.device("cpu"), True),
        TensorSpec("input.n", torch.int64, 1, torch.device("cpu"), False),
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        schema.tensor_specs[0].name = "y"  # type: ignore[misc]


def test_repr_is_readable() -> None:
    schema = schema_of(
        (
            (torch.ones(2, 3, requires_grad=True),),
            {"mask": torch.ones(2, dtype=torch.bool), "flag": True},
        )
    )
    assert repr(schema) == (
        "Schema(input=((Tensor(float32, ndim=2, cpu, requires_grad),), "
        "{'mask': Tensor(bool, ndim=1, cpu), 'flag': True}))"
    )
    nested = schema_of([Pair(Point(torch.ones(1), "s"), OrderedDict(k=None))], static_shapes=True)
    assert repr(nested) == (
        "Schema(input=[Pair(first=Point(x=Tensor(float32, shape=(1,), cpu), y='s'), "
        "second=OrderedDict({'k': None}))])"
    )
