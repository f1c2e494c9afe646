"""FlattenMemo: the previous call's schema back for the same structure, flatten's result always."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ortmodule_pytree import FlattenMemo, flatten


def check_like_flatten(memo: FlattenMemo, obj: Any) -> Any:
    tensors, schema = memo(obj)
    expected_tensors, expected = flatten(obj, prefix=memo.prefix, static_shapes=memo.static_shapes)
    assert schema == expected and schema.names == expected.names
    assert len(tensors) == len(expected_tensors)
    assert all(a is b for a, b in zip(tensors, expected_tensors, strict=True))
    return schema


def test_same_structure_reuses_the_schema_object() -> None:
    memo = FlattenMemo(prefix="input")
    first = check_like_flatten(memo, {"z": torch.ones(2, 3), "a": torch.zeros(4), "flag": True})
    # new tensors, another batch size: the same schema object, tensors in dict order
    again = check_like_flatten(memo, {"z": torch.ones(5, 3), "a": torch.zeros(7), "flag": True})
    assert again is first


@pytest.mark.parametrize(
    "changed",
    [
        {"z": torch.ones(2, 3, dtype=torch.float64), "a": torch.zeros(4), "flag": True},  # dtype
        {"z": torch.ones(2), "a": torch.zeros(4), "flag": True},  # rank
        {"z": torch.ones(2, 3, requires_grad=True), "a": torch.zeros(4), "flag": True},
        {"z": torch.ones(2, 3), "a": torch.zeros(0), "flag": True},  # empty: shape counts
        {"z": torch.ones(2, 3), "a": torch.zeros(4), "flag": False},  # constant value
        {"z": torch.ones(2, 3), "a": torch.zeros(4), "flag": 1},  # constant type
        {"a": torch.zeros(4), "z": torch.ones(2, 3), "flag": True},  # key order
        {"z": torch.ones(2, 3), "b": torch.zeros(4), "flag": True},  # key name
        {"z": torch.ones(2, 3), "a": torch.zeros(4)},  # one key fewer
    ],
)
def test_any_change_gets_flattens_new_schema(changed: dict[str, Any]) -> None:
    memo = FlattenMemo()
    first = check_like_flatten(memo, {"z": torch.ones(2, 3), "a": torch.zeros(4), "flag": True})
    schema = check_like_flatten(memo, changed)
    assert schema is not first and schema != first


def test_static_shapes_make_a_new_shape_a_new_schema() -> None:
    memo = FlattenMemo(static_shapes=True)
    first = check_like_flatten(memo, {"x": torch.ones(2, 3)})
    assert check_like_flatten(memo, {"x": torch.ones(2, 3)}) is first
    assert check_like_flatten(memo, {"x": torch.ones(4, 3)}) != first


@pytest.mark.parametrize(
    "obj",
    [
        (torch.ones(2), {"m": torch.ones(3)}),  # not a dict
        {"x": torch.nn.Parameter(torch.ones(2))},  # a tensor subclass
        {"x": [torch.ones(2), torch.ones(3)]},  # a container value
        {"x": torch.ones(2), "dtype": torch.float32},  # a constant the token does not take
    ],
)
def test_other_structures_go_through_flatten_every_time(obj: Any) -> None:
    memo = FlattenMemo()
    first = check_like_flatten(memo, obj)
    second = check_like_flatten(memo, obj)
    assert second == first and second is not first


def test_unsupported_leaves_raise_flattens_error() -> None:
    memo = FlattenMemo()
    with pytest.raises(TypeError, match=r"cannot flatten input\[.x.\]"):
        memo({"x": object()})
