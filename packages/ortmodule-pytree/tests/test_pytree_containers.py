"""Container types: dataclasses, ModelOutput look-alikes, subclasses, registration, errors."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict, deque
from typing import Any

import pytest
import torch
import torch.utils._pytree as torch_pytree
from pytree_cases import (
    Bag,
    CausalLMOutput,
    FrozenBox,
    ModelOutput,
    Point,
    TaggedDict,
    TaggedList,
    TaggedTuple,
    assert_same,
)

from ortmodule_pytree import (
    describe_difference,
    flatten,
    register_container,
    unflatten,
    unregister_container,
)


def round_trip(obj: Any) -> Any:
    tensors, schema = flatten(obj)
    back = unflatten(tensors, schema)
    assert_same(back, obj)
    return back


def test_model_output_keeps_absent_fields_absent() -> None:
    logits = torch.ones(2, 3)
    out = CausalLMOutput(logits=logits)
    assert list(out.keys()) == ["logits"]
    tensors, schema = flatten(out, prefix="output")
    assert tensors == [logits] and schema.names == ("output.logits",)
    back = unflatten(tensors, schema)
    assert type(back) is CausalLMOutput
    assert list(back.keys()) == ["logits"] and back.loss is None and back[0] is logits
    assert flatten(CausalLMOutput(loss=torch.ones(()), logits=logits))[1] != flatten(out)[1]


@dataclasses.dataclass
class HFStyleOutput(ModelOutput):
    """Registered with torch's pytree the way transformers registers ModelOutput classes."""

    loss: Any = None
    logits: Any = None


torch_pytree.register_pytree_node(
    HFStyleOutput,
    lambda out: (list(out.values()), list(out.keys())),
    lambda values, keys: HFStyleOutput(**dict(zip(keys, values, strict=True))),
)


def test_types_torch_already_knows_use_torchs_registration() -> None:
    out = HFStyleOutput(logits=torch.ones(1))
    back = round_trip({"out": out})
    assert list(back["out"].keys()) == ["logits"]
    assert flatten(out, prefix="output")[1].names == ("output.logits",)
    with pytest.raises(ValueError, match="already handled by torch.utils._pytree"):
        register_container(HFStyleOutput, lambda o: ([], None), lambda c, x: HFStyleOutput())


def test_dataclasses_are_not_added_to_torchs_registry() -> None:
    round_trip([Point(torch.ones(1)), FrozenBox({"k": Point(2)})])
    for cls in (Point, FrozenBox, TaggedList, CausalLMOutput):
        assert cls not in torch_pytree.SUPPORTED_NODES


def test_nested_private_containers_under_torch_containers() -> None:
    t = torch.ones(1)
    obj = Point({"inner": [FrozenBox(Point(t, (t, TaggedList([t]))))]}, OrderedDict(p=Point(t)))
    tensors, schema = flatten(obj)
    assert len(tensors) == 4
    assert schema.names == (
        "input.x.inner.0.content.x",
        "input.x.inner.0.content.y.0",
        "input.x.inner.0.content.y.1.0",
        "input.y.p.x",
    )
    round_trip(obj)


def test_dataclass_fields_outside_init_are_derived_again() -> None:
    @dataclasses.dataclass
    class Scaled:
        value: torch.Tensor
        factor: float = 2.0
        scaled: torch.Tensor = dataclasses.field(init=False)

        def __post_init__(self) -> None:
            self.scaled = self.value * self.factor

    obj = Scaled(torch.ones(2))
    tensors, schema = flatten(obj)
    assert schema.names == ("input.value",)
    back = unflatten([torch.full((2,), 3.0)], schema)
    assert torch.equal(back.scaled, torch.full((2,), 6.0))
    assert len(tensors) == 1


def test_subclasses_and_other_torch_containers() -> None:
    t = torch.ones(1)
    factory = defaultdict(list, {"a": t})
    obj = [
        TaggedList([t, 1]),
        TaggedTuple((t,)),
        TaggedDict(b=t),
        factory,
        deque([t, 2]),
        torch.max(torch.ones(2, 3), dim=1),
    ]
    back = round_trip(obj)
    assert back[3].default_factory is list
    assert flatten(obj)[1].num_tensors == 7


def test_torch_registrations_are_used_as_they_are() -> None:
    # torch registers torch.Size with an unflatten that gives a plain tuple.
    assert unflatten(*flatten(torch.Size([2, 3]))) == (2, 3)


def test_registered_container_round_trip_and_context_in_schema() -> None:
    t = torch.ones(1)
    back = round_trip(Bag([t, {"w": t}], tag="a"))
    assert back.tag == "a"
    a, b = flatten(Bag([t], tag="a"))[1], flatten(Bag([t], tag="b"))[1]
    assert a != b
    assert describe_difference(a, b) == "structure changed at input: Bag context changed 'a' -> 'b'"


def test_register_with_named_children_and_unregister() -> None:
    class Pair2:
        def __init__(self, left: Any, right: Any) -> None:
            self.left, self.right = left, right

    register_container(
        Pair2,
        lambda p: ({"left": p.left, "right": p.right}, None),
        lambda children, _: Pair2(**children),
    )
    try:
        t = torch.ones(1)
        tensors, schema = flatten([Pair2(t, 3)])
        assert schema.names == ("input.0.left",)
        back = unflatten(tensors, schema)[0]
        assert type(back) is Pair2 and back.left is t and back.right == 3
        with pytest.raises(ValueError, match="already registered"):
            register_container(Pair2, lambda p: ([], None), lambda c, x: Pair2(1, 2))
    finally:
        unregister_container(Pair2)
    with pytest.raises(TypeError, match="register_container"):
        flatten([Pair2(1, 2)])
    with pytest.raises(KeyError):
        unregister_container(Pair2)


def test_register_with_subclasses_covers_the_whole_family() -> None:
    class Store:
        def __init__(self, data: Any) -> None:
            self.data = data

    class BigStore(Store):
        pass

    register_container(
        Store,
        lambda s: ({"data": s.data}, type(s)),
        lambda children, cls: cls(children["data"]),
        subclasses=True,
    )
    try:
        t = torch.ones(2)
        tensors, schema = flatten({"a": Store(t), "b": BigStore([t, 4])})
        assert schema.names == ("input.a.data", "input.b.data.0")
        back = unflatten(tensors, schema)
        assert type(back["a"]) is Store and type(back["b"]) is BigStore
        assert back["b"].data[0] is t and back["b"].data[1] == 4
    finally:
        unregister_container(Store)
    with pytest.raises(TypeError, match="register_container"):
        flatten([BigStore(1)])


def test_registration_overrides_the_default_dataclass_handling() -> None:
    @dataclasses.dataclass
    class Cached:
        value: Any
        cache: Any = None  # not part of the structure: dropped on flatten

    register_container(
        Cached, lambda c: ({"value": c.value}, None), lambda children, _: Cached(**children)
    )
    try:
        tensors, schema = flatten(Cached(torch.ones(1), cache=torch.ones(5)))
        assert schema.names == ("input.value",)
        assert unflatten(tensors, schema).cache is None
    finally:
        unregister_container(Cached)
    assert flatten(Cached(torch.ones(1), cache=torch.ones(5)))[1].num_tensors == 2


def test_register_rejects_leaves_and_non_classes() -> None:
    for leaf_type in (torch.Tensor, int, str, type(None)):
        with pytest.raises(ValueError, match="leaf type"):
            register_container(leaf_type, lambda o: ([], None), lambda c, x: None)
    with pytest.raises(TypeError, match="needs a class"):
        register_container("Bag", lambda o: ([], None), lambda c, x: None)  # type: ignore[arg-type]


def test_bad_flatten_fn_results_are_reported() -> None:
    class Broken:
        pass

    register_container(Broken, lambda o: ({1: "x"}, None), lambda c, x: Broken())  # type: ignore[arg-type,return-value]
    try:
        with pytest.raises(TypeError, match="non-str keys"):
            flatten(Broken())
    finally:
        unregister_container(Broken)


class Opaque:
    pass


@dataclasses.dataclass
class Holder:
    foo: Any


def test_unsupported_leaf_names_the_path_and_the_fix() -> None:
    t = torch.ones(1)
    with pytest.raises(TypeError) as info:
        flatten([t, {"mask": Holder(Opaque())}])
    message = str(info.value)
    assert "input[1]['mask'].foo" in message
    assert "test_pytree_containers.Opaque" in message
    assert "ortmodule_pytree.register_container(Opaque, flatten_fn, unflatten_fn)" in message

    with pytest.raises(TypeError, match=r"output\[0\]\.second of type builtins\.object"):
        from pytree_cases import Pair

        flatten((Pair(t, object()),), prefix="output")
    with pytest.raises(TypeError, match=r"cannot flatten input of type"):
        flatten(Opaque())


def test_unflatten_checks_the_tensor_count() -> None:
    tensors, schema = flatten({"a": torch.ones(1), "b": torch.ones(1)})
    with pytest.raises(ValueError, match=r"got 1 tensors for a schema of 2 \(input.a, input.b\)"):
        unflatten(tensors[:1], schema)


def test_prefix_must_be_a_word() -> None:
    with pytest.raises(ValueError, match="prefix"):
        flatten([], prefix="")


def test_odd_keys_cannot_inject_code_into_the_compiled_unflatten() -> None:
    t = torch.ones(1)
    obj = {"'); raise SystemExit('boom') #": t, ("k", 1): [t], None: OrderedDict({"\n": t})}
    round_trip(obj)


def test_deep_nesting_falls_back_to_torchs_unflatten() -> None:
    obj: Any = torch.ones(1)
    for i in range(120):
        obj = [obj, i] if i % 2 else {"k": obj}
    round_trip(obj)


def test_equal_schemas_share_the_compiled_unflatten() -> None:
    obj = {"a": (torch.ones(1), 2)}
    tensors, first = flatten(obj)
    unflatten(tensors, first)
    _, second = flatten(obj)
    assert second is not first
    assert unflatten(tensors, second) == unflatten(tensors, first)
    assert second._rebuild_cache is first._rebuild_cache
