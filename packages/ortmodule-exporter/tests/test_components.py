"""The component plug-in points: discovery through entry points, session contributors, step hooks."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import onnx
import pytest
import torch

from ortmodule_exporter import components
from ortmodule_exporter.components import (
    Component,
    ComponentError,
    SessionContext,
    SessionContribution,
    StepHook,
)
from ortmodule_exporter.ordered import OrderedRegistry


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(components, "_COMPONENTS", {})
    monkeypatch.setattr(components, "_FAILURES", {})
    monkeypatch.setattr(components, "_DISCOVERED", [False])
    monkeypatch.setattr(components, "_CONTRIBUTORS", OrderedRegistry(components._check_contributor))


def _install_fake_distribution(root: Path, body: str, entry: str) -> None:
    """A real installed distribution (dist-info on sys.path) announcing one component."""
    (root / "fake_component.py").write_text(textwrap.dedent(body))
    info = root / "fake_component-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-component\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[ortmodule.components]\nfake = {entry}\n")


def test_entry_point_component_is_discovered_and_registered_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_registry: None
) -> None:
    _install_fake_distribution(
        tmp_path,
        """
        from ortmodule_exporter.components import Component
        CALLS = []
        COMPONENT = Component(
            name="fake-component", version="0.1.0", register=lambda: CALLS.append(1),
            options=("ORTMODULE_FAKE_SWITCH",), check=lambda: "needs a GPU",
        )
        """,
        "fake_component:COMPONENT",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    found = components.load_components()
    components.load_components()
    # other installed components (a dev environment has them all) may be found too
    assert "fake-component" in found
    assert sys.modules["fake_component"].CALLS == [1]
    assert "ORTMODULE_FAKE_SWITCH" in components.handled_options()
    assert found["fake-component"].problem() == "needs a GPU"


def test_broken_component_is_skipped_with_its_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fresh_registry: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _install_fake_distribution(tmp_path, "NOT_A_COMPONENT = 3\n", "fake_component:NOT_A_COMPONENT")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fake_component", raising=False)
    assert "fake-component" not in components.load_components()
    assert "must name a Component" in components.component_failures()["fake"]
    assert "could not be loaded and is skipped" in caplog.text


def test_register_component_rejects_other_objects(fresh_registry: None) -> None:
    with pytest.raises(ComponentError, match="expects an ortmodule_exporter.components.Component"):
        components.register_component(object())  # type: ignore[arg-type]


def _context(training: bool = True) -> SessionContext:
    return SessionContext(onnx.ModelProto(), training, torch.device("cpu"), {})


def test_session_contributions_merge_in_order_and_conflicts_name_both(
    fresh_registry: None,
) -> None:
    components.register_session_contributor(
        "a", lambda ctx: SessionContribution({"k": "1"}), order=10
    )
    components.register_session_contributor(
        "b", lambda ctx: SessionContribution({"j": "2"}, memory_efficient_order=ctx.training)
    )
    merged = components.session_contribution(_context())
    assert dict(merged.config_entries) == {"k": "1", "j": "2"}
    assert merged.memory_efficient_order
    assert not components.session_contribution(_context(False)).memory_efficient_order
    components.register_session_contributor("c", lambda ctx: SessionContribution({"k": "3"}))
    with pytest.raises(ComponentError, match="'k': contributor 'a' sets '1' and 'c' sets '3'"):
        components.session_contribution(_context())


def test_contributor_must_return_a_contribution(fresh_registry: None) -> None:
    components.register_session_contributor("bad", lambda ctx: {"k": "1"})  # type: ignore[arg-type, return-value]
    with pytest.raises(ComponentError, match="'bad' returned dict"):
        components.session_contribution(_context())


def test_step_hooks_are_ordered_and_typed() -> None:
    class A(StepHook):
        pass

    first, second = A(), A()
    components.register_step_hook("zz-second", second, order=5)
    components.register_step_hook("aa-first", first, order=1)
    try:
        hooks = components.step_hooks()
        assert hooks.index(first) < hooks.index(second)
    finally:
        components.unregister_step_hook("zz-second")
        components.unregister_step_hook("aa-first")
    assert first not in components.step_hooks()
    with pytest.raises(TypeError, match="must subclass"):
        components.register_step_hook("x", object())  # type: ignore[arg-type]


def test_step_phases_list_only_hooks_that_apply_and_override_the_phase() -> None:
    class Forward(StepHook):
        def pre_forward(self, ctx: components.StepContext) -> None:
            return None

        def post_forward(self, ctx: components.StepContext, outputs: object) -> None:
            return None

    class Backward(StepHook):
        def post_backward(self, ctx: components.StepContext) -> None:
            return None

    class OnlyWhenAsked(Forward):
        def applies_to(self, ctx: components.StepContext) -> bool:
            return bool(ctx.options.get("WANTED"))

    first, second, backward, optional = Forward(), Forward(), Backward(), OnlyWhenAsked()
    names = {"p-first": (first, 1), "p-second": (second, 2), "p-bw": (backward, 3)}
    names["p-optional"] = (optional, 4)
    for name, (hook, order) in names.items():
        components.register_step_hook(name, hook, order=order)
    try:
        plain = components.StepContext(torch.nn.Linear(2, 2), {})
        phases = components.step_phases(plain)
        ours = {first, second, backward, optional}
        pick = lambda hooks: [h for h in hooks if h in ours]  # noqa: E731
        assert pick(phases.pre_forward) == [first, second]
        assert pick(phases.post_forward) == [second, first]  # reversed
        assert pick(phases.pre_backward) == []
        assert pick(phases.post_backward) == [backward]
        # nothing registered since: the same object; another context: chosen for it
        assert components.step_phases(plain, phases) is phases
        wanted = components.StepContext(plain.module, {"WANTED": True})
        other = components.step_phases(wanted, phases)
        assert pick(other.pre_forward) == [first, second, optional]
        # a registration makes the next call choose again
        components.unregister_step_hook("p-first")
        assert pick(components.step_phases(plain, phases).pre_forward) == [second]
    finally:
        for name in names:
            components.unregister_step_hook(name)


def test_component_problem_reports_a_failing_check() -> None:
    def boom() -> str | None:
        raise OSError("no driver")

    c = Component(name="c", version="0", register=lambda: None, check=boom)
    assert c.problem() == "its check failed: OSError: no driver"


def test_step_hook_exporting_defaults_to_a_no_op_context() -> None:
    ctx = components.StepContext(torch.nn.Linear(2, 2), {})
    with StepHook().exporting(ctx):
        pass


def test_marked_module_hooks_are_reported_handled() -> None:
    def hook(module: torch.nn.Module, args: object) -> None:
        return None

    assert not components.is_module_hook_handled(hook)
    components.mark_module_hook_handled(hook, "zero")
    assert components.is_module_hook_handled(hook)
    # builtins cannot carry the mark: they stay unhandled instead of failing
    components.mark_module_hook_handled(len, "zero")
    assert not components.is_module_hook_handled(len)


def test_untracked_attribute_prefixes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(components, "_UNTRACKED_PREFIXES", set())
    assert components.attribute_changes_graph("ds_grads_remaining")
    components.register_untracked_attributes("ds_", "pre_bwd_fn")
    assert not components.attribute_changes_graph("ds_grads_remaining")
    assert not components.attribute_changes_graph("pre_bwd_fn")
    assert components.attribute_changes_graph("use_cache")
