"""Dropout under a fixed ``torch.manual_seed``: the same losses run after run, and with
``ORTMODULE_ATEN_DROPOUT=1`` the same masks as eager.

Issue #36 ("no silent wrong training"): the engine's generator was seeded from the clock, so
two runs of one script gave different losses. It is now seeded from PyTorch's generator before
each run of a graph that draws (``ortmodule_exporter.engine_random``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortmodule import DebugOptions, ORTModule
from ortmodule_testing.parity import assert_tree_close

RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(autouse=True)
def _engine_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    monkeypatch.delenv("ORTMODULE_ATEN_DROPOUT", raising=False)


class _Dropouts(nn.Module):
    """Three dropouts in a row: a module, ``F.dropout`` and an in-place module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.drop1 = nn.Dropout(0.3)
        self.fc2 = nn.Linear(32, 32)
        self.drop2 = nn.Dropout(0.5, inplace=True)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop1(torch.relu(self.fc1(x)))
        h = F.dropout(torch.tanh(self.fc2(h)), p=0.2, training=self.training)
        return self.head(self.drop2(h)).sum()  # type: ignore[no-any-return]


def _model() -> _Dropouts:
    torch.manual_seed(0)
    return _Dropouts()


def _losses(model: nn.Module, seed: int, steps: int = 3) -> list[float]:
    """``steps`` SGD steps after ``torch.manual_seed(seed)``, inputs drawn between steps."""
    torch.manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(torch.randn(4, 8))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _node_types(model: ORTModule) -> list[str]:
    graph = model._runner.transitions.current(True, True)
    return [n.op_type for n in graph.built.exported.model.graph.node]


def _aten_operators(model: ORTModule) -> list[str]:
    graph = model._runner.transitions.current(True, True)
    return [
        attr.s.decode()
        for n in graph.built.exported.model.graph.node
        if n.op_type == "ATen"
        for attr in n.attribute
        if attr.name == "operator"
    ]


# -- the engine's Dropout, seeded from PyTorch's generator -------------------------------------


def test_two_runs_in_one_process_give_the_same_losses() -> None:
    first = _losses(ORTModule(_model()), seed=1)
    second = _losses(ORTModule(_model()), seed=1)
    assert first == second
    # the masks do depend on the seed (dropout is on, the test can fail)
    assert _losses(ORTModule(_model()), seed=2) != first


def test_option_off_keeps_the_engines_dropout() -> None:
    model = ORTModule(_model())
    _losses(model, seed=1, steps=1)
    assert _node_types(model).count("Dropout") == 3
    assert "native_dropout" not in _aten_operators(model)


_SCRIPT = textwrap.dedent(
    """
    import json, os
    os.environ["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"
    import torch
    from torch import nn
    from ortmodule import ORTModule

    torch.manual_seed(0)
    model = ORTModule(
        nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 1))
    )
    torch.manual_seed(int(os.environ["SEED"]))
    losses = []
    for _ in range(3):
        loss = model(torch.randn(4, 8)).sum()
        loss.backward()
        losses.append(loss.item())
    print(json.dumps(losses))
    """
)


def _run_script(seed: int) -> list[float]:
    env = {**os.environ, "SEED": str(seed)}
    env.pop("ORTMODULE_ATEN_DROPOUT", None)
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_two_processes_give_the_same_losses() -> None:
    first = _run_script(seed=3)
    assert _run_script(seed=3) == first


def test_a_graph_without_randomness_leaves_the_generator_alone() -> None:
    # eager draws nothing for a model without dropout; neither may ORTModule, or inputs drawn
    # between steps would differ from an eager run's
    model = ORTModule(nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 1)))
    torch.manual_seed(5)
    before = torch.get_rng_state()
    model(torch.ones(2, 8)).sum().backward()
    assert torch.equal(torch.get_rng_state(), before)


# -- ORTMODULE_ATEN_DROPOUT=1: PyTorch's kernel, eager's masks ----------------------------------


def _step_by_step(model: nn.Module, seed: int, steps: int = 3) -> list[dict[str, object]]:
    """Per step: the loss, every parameter's gradient and the generator's state after it."""
    torch.manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    record: list[dict[str, object]] = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(torch.randn(4, 8))
        loss.backward()
        record.append(
            {
                "loss": loss.detach(),
                "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                "rng": torch.get_rng_state().to(torch.float32),
            }
        )
        optimizer.step()
    return record


@pytest.mark.parametrize("how", ["environment", "DebugOptions"])
def test_aten_dropout_trains_as_eager(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    if how == "environment":
        monkeypatch.setenv("ORTMODULE_ATEN_DROPOUT", "1")
        model = ORTModule(_model())
    else:
        model = ORTModule(_model(), DebugOptions(aten_dropout=True))
    assert model.options.aten_dropout
    eager = _step_by_step(_model(), seed=11)
    ours = _step_by_step(model, seed=11)
    assert _aten_operators(model).count("native_dropout") == 3
    assert "Dropout" not in _node_types(model)
    assert_tree_close(ours, eager, RTOL, ATOL)


def test_aten_dropout_p0_and_eval_draw_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # p=0 and eval mode draw nothing in eager; the ATen route must not draw either
    monkeypatch.setenv("ORTMODULE_ATEN_DROPOUT", "1")
    torch.manual_seed(0)
    model = ORTModule(nn.Sequential(nn.Linear(8, 4), nn.Dropout(0.0), nn.Linear(4, 1)))
    torch.manual_seed(5)
    before = torch.get_rng_state()
    model(torch.ones(2, 8)).sum().backward()
    model.eval()
    with torch.no_grad():
        model(torch.ones(2, 8))
    assert torch.equal(torch.get_rng_state(), before)


class _FeatureDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.drop = nn.Dropout2d(0.4)
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.conv(x)))
        return self.head(h.mean(dim=(2, 3))).sum()  # type: ignore[no-any-return]


def _gpt() -> nn.Module:
    from ortmodule_testing.zoo.gpt import GPTConfig, GPTDecoder

    torch.manual_seed(0)
    small = GPTConfig.small()
    # dropout 0.1 everywhere, attention's dropout_p (scaled_dot_product_attention) included
    return GPTDecoder(GPTConfig(**{**small.__dict__, "dropout": 0.1}))


def _record(model: nn.Module, inputs: list[torch.Tensor], **kwargs: object) -> list[object]:
    torch.manual_seed(21)
    record: list[object] = []
    for x in inputs:
        out = model(x, **kwargs)
        loss = out[0] if isinstance(out, tuple) else out
        grads = torch.autograd.grad(loss, list(model.parameters()))
        record.append((loss.detach(), [g.clone() for g in grads], torch.get_rng_state().float()))
    return record


@pytest.mark.parametrize("case", ["gpt", "dropout2d"])
def test_aten_dropout_covers_attention_and_feature_dropout(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    monkeypatch.setenv("ORTMODULE_ATEN_DROPOUT", "1")
    gen = torch.Generator().manual_seed(0)
    if case == "gpt":
        make: Any = _gpt
        inputs = [torch.randint(0, 128, (2, 16), generator=gen) for _ in range(2)]
        kwargs: dict[str, object] = {"labels": inputs[0]}
    else:
        make = lambda: (torch.manual_seed(0), _FeatureDropout())[1]  # noqa: E731
        inputs = [torch.randn(2, 3, 5, 5, generator=gen) for _ in range(2)]
        kwargs = {}
    eager = _record(make(), inputs, **kwargs)
    model = ORTModule(make())
    ours = _record(model, inputs, **kwargs)
    assert "native_dropout" in _aten_operators(model)
    assert "Dropout" not in _node_types(model)
    assert_tree_close(ours, eager, RTOL, ATOL)
