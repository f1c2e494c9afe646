"""Containers, leaves and hypothesis strategies shared by the ortmodule-pytree tests."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections import OrderedDict, namedtuple
from collections.abc import Mapping
from typing import Any

import torch
from hypothesis import strategies as st

import ortmodule_pytree

Pair = namedtuple("Pair", ["first", "second"])
Triple = namedtuple("Triple", ["a", "b", "c"])


class Color(enum.Enum):
    RED = 1
    BLUE = "blue"


@dataclasses.dataclass
class Point:
    x: Any
    y: Any = None


@dataclasses.dataclass(frozen=True)
class FrozenBox:
    content: Any
    label: str = "box"


class ModelOutput(OrderedDict):  # type: ignore[type-arg]
    """A small look-alike of Hugging Face's ModelOutput: fields that are None are not keys."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return dict(self.items())[key]
        return self.to_tuple()[key]

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(self[k] for k in self.keys())


@dataclasses.dataclass
class CausalLMOutput(ModelOutput):
    loss: Any = None
    logits: Any = None
    hidden_states: Any = None


class TaggedList(list):  # type: ignore[type-arg]
    pass


class TaggedTuple(tuple):  # type: ignore[type-arg]
    pass


class TaggedDict(dict):  # type: ignore[type-arg]
    pass


class Bag:
    """A user container registered through ortmodule_pytree.register_container."""

    def __init__(self, items: list[Any], tag: str = "bag") -> None:
        self.items = items
        self.tag = tag

    def __repr__(self) -> str:
        return f"Bag({self.items!r}, tag={self.tag!r})"


ortmodule_pytree.register_container(
    Bag,
    lambda bag: (list(bag.items), bag.tag),
    lambda children, tag: Bag(list(children), tag),
)


def make_tensors() -> list[torch.Tensor]:
    tensors = [
        torch.zeros(()),
        torch.ones(3),
        torch.ones(2, 3),
        torch.ones(2, 3, dtype=torch.float16),
        torch.ones(2, 5, dtype=torch.int64),
        torch.ones(1, 2, 3, dtype=torch.bool),
        torch.ones(4, 2, requires_grad=True),
        torch.nn.Parameter(torch.ones(3, 3)),
        torch.empty(2, 2, device="meta"),
    ]
    return tensors


TENSORS = make_tensors()

tensors_st = st.sampled_from(TENSORS)
constants_st = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.complex_numbers(max_magnitude=3, allow_nan=False),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.sampled_from([torch.float32, torch.int64, torch.device("cpu"), torch.device("meta")]),
    st.sampled_from(list(Color)),
)
leaves_st = st.one_of(tensors_st, tensors_st, constants_st)
keys_st = st.one_of(
    st.text(max_size=4),
    st.integers(-2, 10),
    st.sampled_from(["a b", "a_b", "x.y", "", "0", "'); import os #", Color.RED, (1, "t")]),
)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    small = {"max_size": 3}
    return st.one_of(
        st.lists(children, **small),
        st.lists(children, **small).map(tuple),
        st.dictionaries(keys_st, children, **small),
        st.dictionaries(keys_st, children, **small).map(OrderedDict),
        st.builds(Pair, children, children),
        st.builds(Point, children, children),
        st.builds(FrozenBox, children, st.text(max_size=2)),
        st.builds(
            CausalLMOutput,
            loss=st.one_of(st.none(), tensors_st),
            logits=st.one_of(st.none(), children),
            hidden_states=st.one_of(st.none(), children),
        ),
        st.lists(children, **small).map(TaggedList),
        st.lists(children, **small).map(TaggedTuple),
        st.dictionaries(st.text(max_size=3), children, **small).map(TaggedDict),
        st.builds(Bag, st.lists(children, **small), st.sampled_from(["a", "b"])),
    )


structures_st = st.recursive(leaves_st, _containers, max_leaves=16)


def assert_same(actual: Any, expected: Any, path: str = "obj") -> None:
    """Same types all the way down, the very same tensor objects, equal constants."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual is expected, f"{path}: a different tensor object"
    elif isinstance(expected, Bag):
        assert actual.tag == expected.tag
        assert_same(actual.items, expected.items, f"{path}.items")
    elif dataclasses.is_dataclass(expected):
        for field in dataclasses.fields(expected):
            name = field.name
            assert_same(getattr(actual, name), getattr(expected, name), f"{path}.{name}")
        if isinstance(expected, Mapping):
            assert list(actual.keys()) == list(expected.keys()), path
    elif isinstance(expected, Mapping):
        assert list(actual.keys()) == list(expected.keys()), path
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{path}[{i}]")
    elif isinstance(expected, (float, complex)):
        assert repr(actual) == repr(expected) or (
            isinstance(expected, float) and math.isnan(expected) and math.isnan(actual)
        ), path
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def resized(tensor: torch.Tensor) -> torch.Tensor:
    """Same dtype, rank, device and requires_grad; every dimension but those of size 1 one
    longer (a dim of size 1 counts in the schema)."""
    shape = tuple(size if size == 1 else size + 1 for size in tensor.shape)
    out = torch.zeros(shape, dtype=tensor.dtype, device=tensor.device)
    return out.requires_grad_(tensor.requires_grad)
