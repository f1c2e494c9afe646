"""The runtime calls the component plug-in points: session contributors and step hooks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from ortmodule import ORTModule
from ortmodule_exporter import components
from ortmodule_exporter.components import (
    SessionContext,
    SessionContribution,
    SessionInfo,
    StepContext,
    StepHook,
)
from ortmodule_exporter.engine import TrainingSession


class Recorder(StepHook):
    def __init__(self) -> None:
        self.events: list[str] = []
        self.sessions: list[SessionInfo] = []

    def on_session(self, ctx: StepContext, info: SessionInfo) -> None:
        self.events.append("session")
        self.sessions.append(info)

    def pre_forward(self, ctx: StepContext) -> None:
        self.events.append("pre_forward")

    def post_forward(self, ctx: StepContext, outputs: object) -> None:
        self.events.append("post_forward")

    def pre_backward(self, ctx: StepContext) -> None:
        self.events.append("pre_backward")

    def post_backward(self, ctx: StepContext) -> None:
        self.events.append("post_backward")


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    hook = Recorder()
    components.register_step_hook("test-recorder", hook)
    seen: list[SessionContext] = []

    def contribute(ctx: SessionContext) -> SessionContribution:
        seen.append(ctx)
        return SessionContribution({"session.test_component_entry": "42"})

    components.register_session_contributor("test-contributor", contribute)
    hook.contexts = seen  # type: ignore[attr-defined]
    try:
        yield hook
    finally:
        components.unregister_step_hook("test-recorder")
        components.unregister_session_contributor("test-contributor")


def test_hooks_run_around_forward_and_backward_and_entries_reach_the_engine(
    recorder: Recorder,
) -> None:
    model = ORTModule(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()))
    x = torch.randn(5, 4)
    model(x).sum().backward()
    assert recorder.events == [
        "pre_forward",
        "session",
        "post_forward",
        "pre_backward",
        "post_backward",
    ]
    (ctx,) = recorder.contexts  # type: ignore[attr-defined]
    assert ctx.training and ctx.input_shapes == {"input.input": (5, 4)}
    assert any(n.op_type == "Gemm" or n.op_type == "MatMul" for n in ctx.model.graph.node)
    assert ctx.options["ORTMODULE_FALLBACK_POLICY"].name == "FALLBACK_DISABLE"
    (info,) = recorder.sessions
    assert isinstance(info.session, TrainingSession)
    entry = info.session._session.get_session_options().get_session_config_entry(
        "session.test_component_entry"
    )
    assert entry == "42"
    # a second step reuses the session: hooks only
    model(x).sum().backward()
    assert recorder.events[5:] == ["pre_forward", "post_forward", "pre_backward", "post_backward"]


class NotForThisModel(Recorder):
    def applies_to(self, ctx: StepContext) -> bool:
        return bool(ctx.options.get("ORTMODULE_PRINT_MEMORY_STATS"))


def test_a_hook_that_does_not_apply_gets_only_the_session_and_a_registration_is_seen() -> None:
    skipped = NotForThisModel()
    components.register_step_hook("test-not-for-this", skipped)
    late = Recorder()
    try:
        model = ORTModule(torch.nn.Linear(4, 3))
        x = torch.randn(5, 4)
        model(x).sum().backward()
        model(x).sum().backward()
        assert skipped.events == ["session"]
        # registered between steps: the next step calls it
        components.register_step_hook("test-late", late)
        model(x).sum().backward()
        assert late.events == ["pre_forward", "post_forward", "pre_backward", "post_backward"]
    finally:
        components.unregister_step_hook("test-not-for-this")
        components.unregister_step_hook("test-late")
    model(x).sum().backward()
    assert len(late.events) == 4


class HookSuspender(StepHook):
    """Takes a submodule hook out for the export and marks it as handled, as ZeRO-3 does."""

    def __init__(self, sub: torch.nn.Module, fn: object) -> None:
        self.sub, self.fn = sub, fn
        self.exports = 0

    def pre_forward(self, ctx: StepContext) -> None:
        components.mark_module_hook_handled(self.fn, "test-suspender")  # type: ignore[arg-type]

    @contextlib.contextmanager
    def _suspend(self) -> Iterator[None]:
        saved = dict(self.sub._forward_pre_hooks)
        self.sub._forward_pre_hooks.clear()
        self.exports += 1
        try:
            yield
        finally:
            self.sub._forward_pre_hooks.update(saved)

    def exporting(self, ctx: StepContext) -> contextlib.AbstractContextManager[None]:
        return self._suspend()


def test_exporting_context_wraps_the_export_and_handled_hooks_are_not_warned_about(
    recwarn: pytest.WarningsRecorder,
) -> None:
    inner = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())

    def refuse(module: torch.nn.Module, args: object) -> None:
        raise AssertionError("the hook ran inside the export")

    inner[0].register_forward_pre_hook(refuse)
    hook = HookSuspender(inner[0], refuse)
    components.register_step_hook("test-suspender", hook)
    try:
        model = ORTModule(inner)
        model(torch.randn(5, 4)).sum().backward()
        model(torch.randn(5, 4)).sum().backward()
    finally:
        components.unregister_step_hook("test-suspender")
    assert hook.exports == 1  # one export, the second step reuses the graph
    assert len(inner[0]._forward_pre_hooks) == 1  # restored after the export
    assert not [w for w in recwarn if "hooks on submodules" in str(w.message)]
    # an unmarked hook is still warned about
    inner[0]._forward_pre_hooks.clear()
    inner[0].register_forward_hook(lambda m, a, o: None)
    with pytest.warns(UserWarning, match="hooks on submodules"):
        ORTModule(inner)(torch.randn(5, 4))
