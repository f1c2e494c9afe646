"""The harness passes eager against itself and fails, naming the culprit, when something differs."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch

from ortmodule_testing.parity import (
    TrainRecord,
    against_float64,
    assert_same_training,
    assert_tree_close,
    clone_model,
    eval_outputs,
    train_steps,
)
from ortmodule_testing.zoo import ZOO, DictIOOutput, FrozenSubmoduleModel


def _record(name: str, steps: int = 2, **kwargs: Any) -> TrainRecord:
    case = ZOO[name]
    return train_steps(case.build(seed=0), case, steps, **kwargs)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_eager_matches_itself(name: str) -> None:
    case = ZOO[name]
    model = case.build(seed=0)
    first = train_steps(clone_model(model), case, steps=2)
    second = train_steps(clone_model(model), case, steps=2)
    assert len(first.losses) == 2
    assert first.first_step_grads.keys() == dict(model.named_parameters()).keys()
    assert first.final_state.keys() == model.state_dict().keys()
    assert_same_training(first, second, *case.tolerance)
    assert_tree_close(eval_outputs(clone_model(model), case), eval_outputs(model, case))


class _PerturbGrad(torch.nn.Module):
    """A broken engine: the gradient of one parameter comes out 1% too large."""

    def __init__(self, model: torch.nn.Module, name: str) -> None:
        super().__init__()
        self.inner = model
        self.inner.get_parameter(name).register_hook(lambda g: g * 1.01)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.named_parameters(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.state_dict(*args, **kwargs)


def test_a_perturbed_gradient_fails_and_is_named() -> None:
    case = ZOO["gpt"]
    model = case.build(seed=0)
    eager = train_steps(clone_model(model), case, steps=2)
    broken = train_steps(_PerturbGrad(clone_model(model), "blocks.1.mlp.0.weight"), case, steps=2)
    with pytest.raises(AssertionError) as info:
        assert_same_training(eager, broken, *case.tolerance)
    message = str(info.value)
    assert "grad of 'blocks.1.mlp.0.weight' after step 1" in message
    assert "max abs err" in message and "max rel err" in message
    # Only that gradient is wrong after step 1; the others agree.
    assert message.count("after step 1") == 1
    # Adam's update is nearly invariant to a gradient's scale: the final parameters hardly show
    # this bug, which is why the first step's gradients are compared directly.


def test_a_missing_or_extra_none_gradient_fails() -> None:
    eager = _record("mlp")
    grads = dict(eager.first_step_grads)
    grads["head.bias"] = None
    other = dataclasses.replace(eager, first_step_grads=grads)
    with pytest.raises(AssertionError, match=r"grad of 'head.bias' after step 1: None vs a tensor"):
        assert_same_training(eager, other)
    with pytest.raises(AssertionError, match=r"'head.bias' after step 1: a tensor vs None"):
        assert_same_training(other, eager)


def test_missing_names_loss_and_buffer_differences_fail() -> None:
    eager = _record("cnn")
    state = dict(eager.final_state)
    state["features.1.num_batches_tracked"] = state["features.1.num_batches_tracked"] + 1
    del state["head.bias"]
    other = dataclasses.replace(
        eager, losses=[eager.losses[0], eager.losses[1] * 1.01], final_state=state
    )
    with pytest.raises(AssertionError) as info:
        assert_same_training(eager, other)
    message = str(info.value)
    assert "loss at step 1" in message and "loss at step 0" not in message
    assert "missing ['head.bias']" in message
    assert "final 'features.1.num_batches_tracked': 1 of 1 elements differ" in message
    # Buffers can be left out; the parameters still count.
    with pytest.raises(AssertionError, match="head.bias") as info:
        assert_same_training(eager, other, check_buffers=False)
    assert "num_batches_tracked" not in str(info.value)


def test_tolerance_is_relative_to_eager() -> None:
    eager = _record("mlp", steps=1)
    name = "head.weight"
    state = dict(eager.final_state)
    state[name] = state[name] + 1e-3 * state[name].abs() + 1e-6
    other = dataclasses.replace(eager, final_state=state)
    with pytest.raises(AssertionError, match=f"final '{name}'"):
        assert_same_training(eager, other)
    assert_same_training(eager, other, rtol=2e-3, atol=1e-5)


def test_grad_accum_averages_the_micro_batches() -> None:
    case = ZOO["mlp"]
    model = case.build(seed=0)
    record = train_steps(clone_model(model), case, steps=2, grad_accum=2)
    expected: dict[str, torch.Tensor] = {}
    losses = []
    for micro in (0, 1):
        args, kwargs = case.make_batch(micro)
        copy = clone_model(model)
        loss = case.loss_fn(copy(*args, **kwargs), args, kwargs)
        loss.backward()
        losses.append(loss.item())
        for name, p in copy.named_parameters():
            expected[name] = expected.get(name, 0) + p.grad / 2
    assert record.losses[0] == pytest.approx(sum(losses) / 2, rel=1e-6)
    for name, grad in expected.items():
        torch.testing.assert_close(record.first_step_grads[name], grad)


def test_train_steps_uses_the_given_optimizer() -> None:
    sgd = _record("mlp", steps=1, make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0))
    model = ZOO["mlp"].build(seed=0)
    for name, value in model.state_dict().items():
        assert torch.equal(sgd.final_state[name], value)
    with pytest.raises(ValueError, match="steps >= 1"):
        train_steps(model, ZOO["mlp"], steps=0)


def test_eval_outputs_restores_the_training_mode() -> None:
    case = ZOO["cnn"]
    model = case.build(seed=0).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    outputs = eval_outputs(model, case, steps=3)
    assert len(outputs) == 3 and model.training
    assert not outputs[0].requires_grad
    # eval(): BatchNorm running statistics are left alone.
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


class _IgnoresNoGrad(torch.nn.Module):
    """An engine that returns outputs attached to a graph even under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = FrozenSubmoduleModel()

    def forward(self, input_ids: torch.Tensor) -> Any:
        with torch.enable_grad():
            logits = self.inner(input_ids)
        return DictIOOutput(logits=logits, hidden=logits * 2)


def test_eval_outputs_copies_outputs_that_are_still_attached() -> None:
    (output,) = eval_outputs(_IgnoresNoGrad(), ZOO["frozen"], steps=1)
    assert type(output) is DictIOOutput and list(output) == ["logits", "hidden"]
    assert not output.logits.requires_grad and output["hidden"] is output.hidden
    torch.testing.assert_close(output.hidden, output.logits * 2)


Pair = namedtuple("Pair", "first second")


@pytest.mark.parametrize(
    ("a", "b", "message"),
    [
        (
            {"loss": torch.tensor(1.0), "logits": [torch.zeros(2, 3)]},
            {
                "loss": torch.tensor(1.0),
                "logits": [torch.zeros(2, 3).index_fill(1, torch.tensor([2]), 1.0)],
            },
            r"output\['logits'\]\[0\]: 2 of 6 elements differ; max abs err 1 at index \[0, 2\]",
        ),
        ((torch.zeros(2),), (torch.zeros(3),), r"output\[0\]: shape \(2,\) vs \(3,\) in eager"),
        (
            (torch.zeros(2),),
            (torch.zeros(2, dtype=torch.float64),),
            r"output\[0\]: dtype torch.float32",
        ),
        ({"a": 1}, OrderedDict(a=1), r"output: type dict vs OrderedDict in eager"),
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}, r"output: keys \['a', 'b'\] vs \['b', 'a'\] in eager"),
        (
            DictIOOutput(logits=torch.ones(1)),
            DictIOOutput(loss=torch.ones(()), logits=torch.ones(1)),
            r"output: keys \['logits'\] vs \['loss', 'logits'\] in eager",
        ),
        (
            DictIOOutput(logits=torch.ones(1), hidden=torch.ones(2)),
            DictIOOutput(logits=torch.ones(1), hidden=torch.zeros(2)),
            r"output\['hidden'\]: 2 of 2 elements differ",
        ),
        (Pair(torch.ones(1), 2.0), Pair(torch.ones(1), 2.5), r"output\[1\]: 2.0 vs 2.5 in eager"),
        (
            (torch.ones(1), None),
            (torch.ones(1), torch.ones(1)),
            r"output\[1\]: type NoneType vs Tensor",
        ),
        ([torch.ones(1)], [torch.ones(1), torch.ones(1)], r"output: length 1 vs 2 in eager"),
        (
            torch.tensor([True, False]),
            torch.tensor([True, True]),
            r"1 of 2 elements differ \(integer",
        ),
        (torch.tensor([float("nan")]), torch.tensor([0.0]), r"max abs err inf"),
    ],
)
def test_tree_close_names_the_path(a: Any, b: Any, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        assert_tree_close(a, b)


def test_tree_close_accepts_close_trees_and_matching_nans() -> None:
    nan = float("nan")
    a = DictIOOutput(logits=torch.tensor([1.0, nan]), hidden=torch.ones(2))
    b = DictIOOutput(logits=torch.tensor([1.0 + 1e-6, nan]), hidden=torch.ones(2))
    assert_tree_close(a, b)
    assert_tree_close((1.0, "relu", None), (1.0 + 1e-9, "relu", None))
    with pytest.raises(AssertionError, match=r"inputs\[0\]"):
        assert_tree_close((torch.ones(1),), (torch.zeros(1),), path="inputs")


def test_dataclass_fields_are_walked() -> None:
    @dataclasses.dataclass
    class Out:
        value: torch.Tensor

    with pytest.raises(AssertionError, match=r"output\.value"):
        assert_tree_close(Out(torch.ones(1)), Out(torch.zeros(1)))


def _one_step(loss: float, grad: torch.Tensor, final: torch.Tensor) -> TrainRecord:
    return TrainRecord([loss], {"w": grad}, {"w": final})


def test_against_float64_accepts_rounding_and_names_a_wrong_value() -> None:
    reference = _one_step(1.0, torch.tensor([1.0, 1e-7]), torch.tensor([0.5, 0.25]))
    eager = _one_step(1.0 + 1e-7, torch.tensor([1.0, 3e-7]), torch.tensor([0.5, 0.25 + 2e-5]))
    # as far from float64 as eager (AdamW turned a rounding-level gradient into a step)
    close = _one_step(1.0 - 1e-7, torch.tensor([1.0, -1e-7]), torch.tensor([0.5, 0.25 - 3e-5]))
    assert against_float64(eager, close, reference) == []
    # a gradient 1e-3 off where eager is 2e-7 off: wrong, named
    wrong = _one_step(1.0, torch.tensor([1.0 + 1e-3, 1e-7]), torch.tensor([0.5, 0.25]))
    problems = against_float64(eager, wrong, reference)
    assert len(problems) == 1 and problems[0].startswith("grad of 'w' after step 1")


def test_against_float64_passes_over_the_final_values_of_a_rounding_noise_gradient() -> None:
    # a bias the softmax is invariant to: 2e-17 in float64, 5.6e-9 off in eager float32; AdamW
    # turns that noise into steps, so the final values part in every float32 training
    reference = _one_step(1.0, torch.tensor([2e-17, -1e-17]), torch.tensor([0.25, 0.5]))
    eager = _one_step(1.0, torch.tensor([5.6e-9, -1e-9]), torch.tensor([0.25 + 8e-6, 0.5]))
    other = _one_step(1.0, torch.tensor([-2e-8, 3e-9]), torch.tensor([0.25 - 2e-4, 0.5]))
    assert against_float64(eager, other, reference) == []
    # a gradient exactly 0 in float64 and in eager (a zero-initialised LoRA factor) is no
    # noise: its final values are checked
    zero = _one_step(1.0, torch.zeros(2), torch.tensor([0.25, 0.5]))
    moved = _one_step(1.0, torch.zeros(2), torch.tensor([0.25 - 4.5e-3, 0.5]))
    problems = against_float64(zero, moved, zero)
    assert len(problems) == 1 and problems[0].startswith("final 'w'"), problems
