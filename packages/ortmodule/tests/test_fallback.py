"""ORTMODULE_FALLBACK_POLICY / ORTMODULE_FALLBACK_RETRY: the full matrix, with exact messages."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

from ortmodule import ExportError, ORTModule
from ortmodule import execution as execution_module
from ortmodule_exporter import EngineBuildError


class OddOutput(torch.nn.Module):
    """Exports fine up to its output, which holds an object the engine cannot hand back."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"y": self.fc(x), "meta": object()}


REASON = (
    "cannot flatten output['meta'] of type builtins.object: supported leaves are Tensor, None, "
    "bool, int, float, complex, str, bytes, torch.dtype, torch.device, Enum members, in lists, "
    "tuples, dicts, namedtuples, OrderedDicts and dataclasses. To pass it through, register it: "
    "ortmodule_pytree.register_container(object, flatten_fn, unflatten_fn)"
)
EXPECTED_WARNING = (
    f"ORTModule could not run {__name__}.OddOutput in ONNX Runtime "
    f"(FALLBACK_UNSUPPORTED_TORCH_MODEL): {__name__}.OddOutput returned an output ORTModule "
    f"cannot hand back: {REASON}. Training continues in PyTorch. To make this an error, set "
    "ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE."
)


def _count_export_attempts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    attempts = [0]
    real = execution_module.export

    def counting(*args: Any, **kwargs: Any) -> Any:
        attempts[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(execution_module, "export", counting)
    return attempts


POLICIES = {
    "default": None,
    "disabled": "FALLBACK_DISABLE",
    "matching": "FALLBACK_UNSUPPORTED_TORCH_MODEL|FALLBACK_UNSUPPORTED_DATA",
    "non-matching": "FALLBACK_UNSUPPORTED_DEVICE|FALLBACK_UNSUPPORTED_ONNX_MODEL",
}


@pytest.mark.parametrize("retry", [False, True], ids=["no-retry", "retry"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_fallback_matrix(
    monkeypatch: pytest.MonkeyPatch, training: bool, policy: str, retry: bool
) -> None:
    if POLICIES[policy] is None:
        monkeypatch.delenv("ORTMODULE_FALLBACK_POLICY", raising=False)
    else:
        monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", POLICIES[policy])
    monkeypatch.setenv("ORTMODULE_FALLBACK_RETRY", "1" if retry else "0")
    attempts = _count_export_attempts(monkeypatch)
    torch.manual_seed(0)
    eager = OddOutput().train(training)
    wrapped = ORTModule(copy.deepcopy(eager))
    x = torch.randn(4, 3)
    falls_back = policy in ("default", "matching")

    if not falls_back:
        with pytest.raises(ExportError) as info:
            wrapped(x)
        assert (
            str(info.value)
            == f"{__name__}.OddOutput returned an output ORTModule cannot hand back: {REASON}"
        )
        assert isinstance(info.value.__cause__, Exception)
        return

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            out = wrapped(x)
            if training:
                out["y"].sum().backward()
    messages = [str(w.message) for w in caught if "ORTModule could not run" in str(w.message)]
    assert messages == [EXPECTED_WARNING], (
        "one warning, naming the cause and how to make it an error"
    )
    assert caught[0].filename == __file__, "the warning points at the user's call"
    assert attempts[0] == (3 if retry else 1)
    ref = eager(x)
    torch.testing.assert_close(out["y"], ref["y"])
    if training:
        (ref["y"].sum() * 3).backward()
        for p, q in zip(eager.parameters(), wrapped.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad)


def test_force_torch_forward_never_exports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_FORCE_TORCH_FORWARD")
    attempts = _count_export_attempts(monkeypatch)
    model = torch.nn.Linear(3, 2)
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(wrapped(x), model(x))
    assert attempts[0] == 0


class Meta(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)

    def forward(self, x: Any) -> torch.Tensor:
        return self.fc(x.value if hasattr(x, "value") else x)


class Box:
    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


CAUSES = {
    # cause: (module factory, input factory, the flag named in the warning, error type without fallback)
    "data": (Meta, lambda: Box(torch.randn(2, 3)), "FALLBACK_UNSUPPORTED_DATA", TypeError),
    "device": (
        lambda: Meta().to("meta"),
        lambda: torch.randn(2, 3, device="meta"),
        "FALLBACK_UNSUPPORTED_DEVICE",
        RuntimeError,
    ),
    "onnx-model": (
        # no float64 GELU kernel on the CPU engine
        lambda: torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.GELU()).double(),
        lambda: torch.randn(2, 3, dtype=torch.float64),
        "FALLBACK_UNSUPPORTED_ONNX_MODEL",
        EngineBuildError,
    ),
}


@pytest.mark.parametrize("cause", list(CAUSES))
def test_each_cause_is_classified_and_only_its_flag_falls_back(
    monkeypatch: pytest.MonkeyPatch, cause: str
) -> None:
    make_model, make_input, flag, error = CAUSES[cause]
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", flag)
    with pytest.warns(UserWarning, match=rf"\({flag}\)"):
        out = ORTModule(make_model())(make_input())
    assert out.shape == (2, 2)
    others = [f for c, (_, _, f, _) in CAUSES.items() if c != cause]
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "|".join(others))
    with pytest.raises(error):
        ORTModule(make_model())(make_input())


def test_force_torch_backward_is_a_catch_all_not_a_switch_to_pytorch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the original ORTModule's meaning: fall back on every recognised failure; a model the
    # engine can run still runs there
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_FORCE_TORCH_BACKWARD")
    attempts = _count_export_attempts(monkeypatch)
    model = torch.nn.Linear(3, 2)
    wrapped = ORTModule(copy.deepcopy(model))
    x = torch.randn(2, 3)
    torch.testing.assert_close(wrapped(x), model(x), rtol=1e-4, atol=1e-5)
    assert attempts[0] == 1 and wrapped._fallback.cause is None

    from ortmodule.fallback import FallbackManager
    from ortmodule.options import FallbackPolicy, RuntimeOptions

    manager = FallbackManager(RuntimeOptions.resolve(environ={}), model)
    manager.policy = FallbackPolicy.FALLBACK_FORCE_TORCH_BACKWARD
    for flag in (
        FallbackPolicy.FALLBACK_UNSUPPORTED_DEVICE,
        FallbackPolicy.FALLBACK_UNSUPPORTED_DATA,
        FallbackPolicy.FALLBACK_UNSUPPORTED_TORCH_MODEL,
        FallbackPolicy.FALLBACK_UNSUPPORTED_ONNX_MODEL,
    ):
        assert manager.covers(flag)
    assert not manager.covers(FallbackPolicy.FALLBACK_BAD_INITIALIZATION)
