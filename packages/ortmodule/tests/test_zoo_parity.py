"""The model zoo trained under ORTModule equals PyTorch eager: per-step losses, step-1 gradients,
final parameters and buffers, eval outputs. Fallback is disabled (conftest), so every step here
ran in the engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ortmodule import ORTModule
from ortmodule_testing.parity import (
    assert_same_training,
    assert_tree_close,
    clone_model,
    eval_outputs,
    train_steps,
)
from ortmodule_testing.zoo import ZOO

STEPS = 20


def _sgd(params: Iterator[torch.nn.Parameter]) -> torch.optim.Optimizer:
    # SGD with momentum, not AdamW: AdamW divides each step by the gradient's running RMS, so an
    # element whose gradient is analytically zero (an attention key bias: softmax is
    # shift-invariant) takes full-size steps driven by rounding noise, in eager as much as in
    # the engine, and its final value is noise. With SGD every element of the final state is
    # compared; AdamW itself is covered by the gradient-accumulation test below (3 steps).
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_training_matches_eager(name: str) -> None:
    case = ZOO[name]
    model = case.build(seed=0)
    eager = train_steps(clone_model(model), case, STEPS, _sgd)
    wrapped = ORTModule(clone_model(model))
    ours = train_steps(wrapped, case, STEPS, _sgd)
    rtol, atol = case.tolerance
    # every element of every loss, step-1 gradient and final parameter and buffer
    assert_same_training(eager=eager, other=ours, rtol=rtol, atol=atol)
    assert wrapped._runner.transitions.builds == 1, wrapped._runner.transitions.history


@pytest.mark.parametrize("name", sorted(ZOO))
def test_eval_outputs_match_eager(name: str) -> None:
    case = ZOO[name]
    model = case.build(seed=0)
    rtol, atol = case.tolerance
    assert_tree_close(
        eval_outputs(ORTModule(clone_model(model)), case),
        eval_outputs(model, case),
        rtol=rtol,
        atol=atol,
    )


@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_gradient_accumulation_over_four_micro_batches(name: str) -> None:
    case = ZOO[name]
    model = case.build(seed=0)
    eager = train_steps(clone_model(model), case, 3, grad_accum=4)
    ours = train_steps(ORTModule(clone_model(model)), case, 3, grad_accum=4)
    assert_same_training(eager=eager, other=ours, rtol=case.tolerance[0], atol=case.tolerance[1])


def test_frozen_submodule_gets_no_gradient_and_no_gradient_work() -> None:
    case = ZOO["frozen"]
    wrapped = ORTModule(case.build(seed=0))
    record = train_steps(wrapped, case, 1)
    frozen = {n for n, p in wrapped.named_parameters() if not p.requires_grad}
    assert frozen, "the case freezes a submodule"
    assert all(record.first_step_grads[n] is None for n in frozen)
    graph = wrapped._runner.transitions.current(True, True)
    assert not frozen & set(graph.built.config.params_to_train)
    assert not frozen & set(graph.built.grad_of.values()), "no gradient output for frozen weights"


def test_state_dict_round_trip_both_ways() -> None:
    case = ZOO["bert"]
    plain = case.build(seed=0)
    wrapped = ORTModule(case.build(seed=1))
    train_steps(wrapped, case, 2)
    plain.load_state_dict(wrapped.state_dict())
    args, kwargs = case.make_batch(5)
    with torch.no_grad():
        assert_tree_close(
            wrapped.eval()(*args, **kwargs), plain.eval()(*args, **kwargs), rtol=1e-4, atol=1e-5
        )
    wrapped.load_state_dict(case.build(seed=2).state_dict())
    fresh = case.build(seed=2).eval()
    with torch.no_grad():
        assert_tree_close(wrapped(*args, **kwargs), fresh(*args, **kwargs), rtol=1e-4, atol=1e-5)


def test_no_re_export_when_only_batch_or_sequence_length_changes() -> None:
    case = ZOO["gpt"]
    wrapped = ORTModule(case.build(seed=0))
    (ids,), kwargs = case.make_batch(0)[0], case.make_batch(0)[1]
    shapes = [(ids.shape[0], ids.shape[1]), (3, ids.shape[1] // 2), (2, ids.shape[1] - 1)]
    # a batch of one is its own graph (a size-1 dim stays a fixed 1), kept beside the other
    shapes += [(1, ids.shape[1]), (3, ids.shape[1]), (1, 5)]
    for b, s in shapes:
        sub = ids[:b, :s].contiguous()
        sub_kwargs = {k: v[:b, :s].contiguous() for k, v in kwargs.items()}
        case.loss_fn(wrapped(sub, **sub_kwargs), (sub,), sub_kwargs).backward()
    assert wrapped._runner.transitions.builds == 2, wrapped._runner.transitions.history
