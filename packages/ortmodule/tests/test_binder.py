"""The step path's argument binder gives what ``inspect.Signature.bind`` gives, call by call."""

from __future__ import annotations

import inspect

import pytest
import torch

from ortmodule.execution import _Binder
from ortmodule_exporter.export import bind_arguments


class Plain(torch.nn.Module):
    def forward(self, x, mask=None, labels=None, scale=1.0):  # noqa: ANN001
        return x


class Variadic(torch.nn.Module):
    def forward(self, x, *rest, flag=False, **extra):  # noqa: ANN001
        return x


x, m, y = torch.ones(1), torch.zeros(1), torch.ones(2)
CALLS = [
    ((x,), {}),
    ((x, m), {}),
    ((x, m, y, 2.0), {}),
    ((), {"x": x}),
    ((x,), {"labels": y}),
    ((), {"labels": y, "x": x}),  # keyword order differs from the signature's
    ((x,), {"mask": m, "scale": 3.0}),
    ((x,), {"x": x}),  # twice: inspect's error path
    ((x,), {"unknown": y}),
    ((), {"mask": m}),  # required x missing
    ((x, m, y, 2.0, 5), {}),  # too many
]


@pytest.mark.parametrize("module", [Plain(), Variadic()], ids=["plain", "variadic"])
@pytest.mark.parametrize("call", range(len(CALLS)))
def test_binder_matches_inspect(module, call):
    args, kwargs = CALLS[call]
    expected = bind_arguments(module, args, kwargs, inspect.signature(module.forward))
    got = _Binder(module)(args, kwargs)
    assert list(got) == list(expected)  # the order is part of the schema
    for key in expected:
        a, b = got[key], expected[key]
        assert a is b or (isinstance(a, (tuple, dict)) and a == b), key
