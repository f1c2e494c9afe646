"""Two ORTModules with different export options, in one process: each exports as if alone,
one after the other and from two threads at once (issue #39: an export is a function of its
own configuration, never of another model's switches)."""

from __future__ import annotations

import threading

import onnx
import pytest
import torch

from ortmodule import ORTModule
from ortmodule_exporter.aten import kernel_choice


class _Net(torch.nn.Module):
    """GELU and a dense cross-entropy, which the kernel choice routes, after a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.proj = torch.nn.Linear(8, 12)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.proj(torch.nn.functional.gelu(self.norm(x)))
        return torch.nn.functional.cross_entropy(logits, labels)


def _model(choice: str, monkeypatch: pytest.MonkeyPatch) -> ORTModule:
    torch.manual_seed(0)
    with monkeypatch.context() as m:
        m.setenv("ORTMODULE_KERNEL_CHOICE", choice)
        return ORTModule(_Net())


def _step(model: ORTModule) -> tuple[list[str], list[torch.Tensor]]:
    """One training step: the operators of the built gradient graph, and the gradients."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 8, generator=gen)
    labels = torch.randint(0, 12, (16,), generator=gen)
    model(x, labels).backward()
    graph = model._runner.transitions.current(True, True)
    assert graph is not None
    built = onnx.load_from_string(graph.built.model_bytes)
    ops = [
        next((a.s.decode() for a in n.attribute if a.name == "operator"), n.op_type)
        for n in built.graph.node
    ]
    return ops, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_two_models_with_different_kernel_choices_export_as_if_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    alone = {c: _step(_model(c, monkeypatch)) for c in ("TORCH", "ENGINE")}
    # the options make a difference, so a model exporting with the other's would show
    for routed in (kernel_choice.GELU, kernel_choice.CROSS_ENTROPY):
        assert routed in alone["TORCH"][0] and routed not in alone["ENGINE"][0]
    assert "SoftmaxCrossEntropyLoss" in alone["ENGINE"][0]

    models = {c: _model(c, monkeypatch) for c in ("TORCH", "ENGINE")}
    results: dict[str, tuple[list[str], list[torch.Tensor]]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run(choice: str) -> None:
        try:
            start.wait()
            results[choice] = _step(models[choice])
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(c,)) for c in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for choice, (ops, grads) in alone.items():
        assert sorted(results[choice][0]) == sorted(ops), choice
        for ours, theirs in zip(results[choice][1], grads, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # and the process's own switches are what they were before either export
    assert kernel_choice.current_mode() == "engine"
