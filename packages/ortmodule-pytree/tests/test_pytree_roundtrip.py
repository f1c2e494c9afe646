"""Property tests: flatten then unflatten gives the same structure back, for any nesting."""

from __future__ import annotations

import re
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from pytree_cases import assert_same, resized, structures_st

from ortmodule_pytree import flatten, unflatten

PROPERTY = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
NAME = re.compile(r"^input(\.[0-9A-Za-z_]+)*$")


@PROPERTY
@given(structures_st)
def test_round_trip_gives_same_types_and_tensors(obj: Any) -> None:
    tensors, schema = flatten(obj)
    assert all(isinstance(t, torch.Tensor) for t in tensors)
    assert schema.num_tensors == len(tensors)
    assert_same(unflatten(tensors, schema), obj)


@PROPERTY
@given(structures_st)
def test_schema_is_deterministic_and_survives_the_round_trip(obj: Any) -> None:
    tensors, schema = flatten(obj)
    again_tensors, again = flatten(obj)
    assert again == schema and hash(again) == hash(schema)
    assert again.names == schema.names
    assert all(a is b for a, b in zip(again_tensors, tensors, strict=True))
    rebuilt_tensors, rebuilt = flatten(unflatten(tensors, schema))
    assert rebuilt == schema
    assert all(a is b for a, b in zip(rebuilt_tensors, tensors, strict=True))


@PROPERTY
@given(structures_st)
def test_names_are_unique_identifiers(obj: Any) -> None:
    _, schema = flatten(obj)
    names = schema.names
    assert len(names) == schema.num_tensors
    assert len(set(names)) == len(names)
    assert all(NAME.match(name) for name in names), names
    assert [spec.name for spec in schema.tensor_specs] == list(names)


@PROPERTY
@given(structures_st)
def test_new_shapes_keep_the_schema_unless_shapes_are_static(obj: Any) -> None:
    tensors, schema = flatten(obj)
    other = unflatten([resized(t) for t in tensors], schema)
    assert flatten(other)[1] == schema
    _, static = flatten(obj, static_shapes=True)
    _, other_static = flatten(other, static_shapes=True)
    some_shape_changed = any(t.dim() > 0 for t in tensors)
    assert (other_static != static) == some_shape_changed
