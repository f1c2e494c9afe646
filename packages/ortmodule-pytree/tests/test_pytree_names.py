"""Tensor names: readable, stable, unique, usable as ONNX input and output names."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from pytree_cases import Bag, CausalLMOutput, Color, Pair, Point

from ortmodule_pytree import flatten


def names(obj: Any, **kwargs: Any) -> tuple[str, ...]:
    return flatten(obj, **kwargs)[1].names


def test_names_follow_the_path() -> None:
    t = torch.ones(1)
    assert names({"input_ids": t, "attention_mask": t}) == (
        "input.input_ids",
        "input.attention_mask",
    )
    assert names(((t,), {"mask": t, "flag": True})) == ("input.0.0", "input.1.mask")
    assert names(t) == ("input",)
    assert names([Pair(t, Point(t, [t]))]) == (
        "input.0.first",
        "input.0.second.x",
        "input.0.second.y.0",
    )
    assert names(OrderedDict(a=t), prefix="output") == ("output.a",)


def test_model_output_names_use_fields_and_skip_absent_ones() -> None:
    t = torch.ones(1)
    out = CausalLMOutput(logits=t, hidden_states=(t, t))
    assert names(out, prefix="output") == (
        "output.logits",
        "output.hidden_states.0",
        "output.hidden_states.1",
    )


def test_registered_container_names() -> None:
    t = torch.ones(1)
    assert names(Bag([t, {"w": t}])) == ("input.0", "input.1.w")


def test_odd_keys_are_sanitized_and_kept_unique_in_order() -> None:
    t = torch.ones(1)
    obj = {"a b": t, "a_b": t, "x.y": t, "": t, 3: t, "3": t, Color.RED: t, (1, "t"): t}
    assert names(obj) == (
        "input.a_b",
        "input.a_b_1",
        "input.x_y",
        "input._",
        "input.3",
        "input.3_1",
        "input.Color_RED",
        "input._1___t__",
    )


def test_a_suffix_never_takes_a_name_that_exists_later() -> None:
    t = torch.ones(1)
    assert names({"a b": t, "a_b": t, "a_b_1": t}) == ("input.a_b", "input.a_b_2", "input.a_b_1")


def test_prefix_is_sanitized_for_names() -> None:
    assert names([torch.ones(1)], prefix="my input") == ("my_input.0",)


def test_names_skip_constants_but_keep_their_positions() -> None:
    t = torch.ones(1)
    assert names([None, t, "s", t]) == ("input.1", "input.3")
