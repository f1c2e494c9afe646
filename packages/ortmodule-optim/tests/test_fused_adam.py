"""FusedAdam against torch.optim.AdamW / Adam: same parameters, state and checkpoints.

FusedAdam runs torch's fused Adam kernel, so the bitwise reference is ``fused=True``; torch's
other two implementations order the arithmetic differently and agree to float rounding only.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ortmodule_optim import FusedAdam


def mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 32),
        torch.nn.GELU(),
        torch.nn.LayerNorm(32),
        torch.nn.Linear(32, 32, bias=False),
        torch.nn.Linear(32, 3),
    ).to(dtype)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(8, 12, generator=gen).to(dtype)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def assert_same_params(
    a: torch.nn.Module, b: torch.nn.Module, rtol: float = 0.0, atol: float = 0.0
) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        if rtol == 0.0 and atol == 0.0:
            assert torch.equal(p, q), name
        else:
            torch.testing.assert_close(q, p, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_matches_torch(adam_w_mode, weight_decay):
    ref, ours = mlp(), mlp()
    ref_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    kwargs = {"lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-7, "weight_decay": weight_decay}
    train(ref, ref_cls(ref.parameters(), fused=True, **kwargs), 60)
    train(ours, FusedAdam(ours.parameters(), adam_w_mode=adam_w_mode, **kwargs), 60)
    # The same kernel with the same arguments: bitwise equal on CPU.
    assert_same_params(ref, ours)
    default = mlp()
    train(default, ref_cls(default.parameters(), **kwargs), 60)
    assert_same_params(default, ours, rtol=1e-5, atol=1e-7)


def test_without_bias_correction_matches_the_formula():
    ref, ours = mlp(), mlp()
    opt = FusedAdam(ours.parameters(), lr=1e-2, bias_correction=False, weight_decay=0.05)
    train(ours, opt, 5)
    gen = torch.Generator().manual_seed(1)
    state = {p: (torch.zeros_like(p), torch.zeros_like(p)) for p in ref.parameters()}
    for _ in range(5):
        x = torch.randn(8, 12, generator=gen)
        ref.zero_grad()
        ref(x).pow(2).mean().backward()
        with torch.no_grad():
            for p in ref.parameters():
                m, v = state[p]
                p.mul_(1 - 1e-2 * 0.05)
                m.mul_(0.9).add_(p.grad, alpha=0.1)
                v.mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                p.sub_(1e-2 * m / (v.sqrt() + 1e-8))
    # the reference spells the moments differently (mul/add, not lerp): rounding differs
    assert_same_params(ref, ours, rtol=1e-5, atol=1e-7)


def test_parameters_without_grad_are_skipped():
    ref, ours = mlp(), mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = FusedAdam(ours.parameters(), lr=1e-2, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    frozen_name = "3.weight"
    for step in range(12):
        x = torch.randn(4, 12, generator=gen)
        for model, o in ((ref, ref_opt), (ours, opt)):
            o.zero_grad()
            model(x).sum().backward()
            if step % 3 == 0:  # a parameter without a gradient on some steps
                dict(model.named_parameters())[frozen_name].grad = None
            o.step()
    assert_same_params(ref, ours)
    steps = {n: float(opt.state[p]["step"]) for n, p in ours.named_parameters()}
    assert steps[frozen_name] == 8.0 and steps["0.weight"] == 12.0

    never = torch.nn.Parameter(torch.ones(3))
    opt.add_param_group({"params": [never]})
    train(ours, opt, 1)
    assert torch.equal(never, torch.ones(3)) and never not in opt.state


def test_groups_by_dtype_and_hyperparameters_per_group():
    ref, ours = mlp(), mlp()
    ref[4].double()
    ours[4].double()

    def groups(model):
        return [
            {"params": list(model[0].parameters()), "lr": 1e-2},
            {"params": [p for m in list(model)[1:] for p in m.parameters()], "weight_decay": 0.3},
        ]

    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-3, weight_decay=0.01, fused=True)
    opt = FusedAdam(groups(ours), lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        x = torch.randn(4, 12, generator=gen)
        for model, o in ((ref, ref_opt), (ours, opt)):
            o.zero_grad()
            model[4](model[:4](x).double()).sum().backward()
            o.step()
    assert_same_params(ref, ours)


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def count_step_ops(num_params: int) -> list[str]:
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(num_params)]
    opt = FusedAdam(params, weight_decay=0.1)
    for p in params:
        p.grad = torch.randn(5)
    opt.step()  # first step builds the state
    with OpCounter() as counter:
        opt.step()
    return counter.ops


def test_a_step_is_a_fixed_number_of_multi_tensor_ops():
    few, many = count_step_ops(3), count_step_ops(60)
    assert few == many, "the number of ops must not grow with the number of parameters"
    math_ops = [op for op in many if not op.startswith("profiler.")]
    # the step counts, then one fused kernel for every parameter
    assert math_ops == ["aten._foreach_add_", "aten._fused_adamw_"], many


def test_without_bias_correction_a_step_is_a_few_foreach_ops():
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(20)]
    opt = FusedAdam(params, weight_decay=0.1, bias_correction=False)
    for p in params:
        p.grad = torch.randn(5)
    opt.step()
    with OpCounter() as counter:
        opt.step()
    math_ops = [op for op in counter.ops if not op.startswith("profiler.")]
    assert len(math_ops) <= 9 and all("_foreach_" in op for op in math_ops), math_ops


def state_bytes(opt: torch.optim.Optimizer) -> dict:
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer)


def test_state_dict_round_trip():
    a = mlp()
    opt = FusedAdam(a.parameters(), lr=1e-2, weight_decay=0.1)
    train(a, opt, 5)
    b = copy.deepcopy(a)
    opt_b = FusedAdam(b.parameters(), lr=1.0)
    opt_b.load_state_dict(state_bytes(opt))
    assert opt_b.param_groups[0]["lr"] == 1e-2
    train(a, opt, 5, seed=2)
    train(b, opt_b, 5, seed=2)
    assert_same_params(a, b)


def test_loads_a_torch_adamw_checkpoint_and_back():
    ref = mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.05, fused=True)
    train(ref, ref_opt, 5)
    ours = copy.deepcopy(ref)
    opt = FusedAdam(ours.parameters(), adam_w_mode=False)
    opt.load_state_dict(state_bytes(ref_opt))
    assert opt.param_groups[0]["adam_w_mode"] is True
    assert opt.param_groups[0]["weight_decay"] == 0.05
    train(ref, ref_opt, 5, seed=2)
    train(ours, opt, 5, seed=2)
    assert_same_params(ref, ours)

    back = copy.deepcopy(ours)
    back_opt = torch.optim.AdamW(back.parameters())
    back_opt.load_state_dict(state_bytes(opt))
    back_opt.param_groups[0]["fused"] = True  # the bitwise reference (not in our checkpoint)
    train(ours, opt, 3, seed=3)
    train(back, back_opt, 3, seed=3)
    assert_same_params(ours, back)


def test_refuses_a_checkpoint_it_cannot_honour():
    ref = mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), amsgrad=True)
    train(ref, ref_opt, 1)
    opt = FusedAdam(mlp().parameters())
    with pytest.raises(ValueError, match=r"param_groups\[0\] was saved with amsgrad=True"):
        opt.load_state_dict(ref_opt.state_dict())


def test_sparse_gradient_is_refused_before_any_update():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    lin = torch.nn.Linear(4, 1)
    opt = FusedAdam([*lin.parameters(), *emb.parameters()], weight_decay=0.1)
    lin(emb(torch.tensor([1, 2]))).sum().backward()
    before = [p.detach().clone() for p in (*lin.parameters(), *emb.parameters())]
    with pytest.raises(
        RuntimeError, match=r"param_groups\[0\]\['params'\]\[2\] has a sparse gradient"
    ):
        opt.step()
    after = [*lin.parameters(), *emb.parameters()]
    assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))


def test_complex_parameter_is_refused():
    with pytest.raises(ValueError, match=r"\['params'\]\[1\] is complex"):
        FusedAdam(
            [
                torch.nn.Parameter(torch.ones(2)),
                torch.nn.Parameter(torch.ones(2, dtype=torch.cfloat)),
            ]
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, "lr must be"),
        ({"betas": (0.9, 1.0)}, "betas must be"),
        ({"eps": -1.0}, "eps"),
    ],
)
def test_invalid_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FusedAdam(mlp().parameters(), **kwargs)


@pytest.mark.parametrize("set_grad_none", [True, False])
def test_zero_grad(set_grad_none):
    model = mlp()
    opt = FusedAdam(model.parameters(), set_grad_none=set_grad_none)
    model(torch.randn(2, 12)).sum().backward()
    opt.zero_grad()
    grads = [p.grad for p in model.parameters()]
    if set_grad_none:
        assert all(g is None for g in grads)
    else:
        assert all(g is not None and not g.any() for g in grads)


def test_closure_is_evaluated_with_grad():
    model = mlp()
    opt = FusedAdam(model.parameters())

    def closure() -> float:
        opt.zero_grad()
        loss = model(torch.randn(2, 12)).sum()
        loss.backward()
        return float(loss.detach())

    assert isinstance(opt.step(closure), float)


def test_pickle_round_trip_keeps_training_identically():
    import pickle

    a = mlp()
    opt = FusedAdam(a.parameters(), lr=1e-2, set_grad_none=False)
    train(a, opt, 3)
    b, opt_b = pickle.loads(pickle.dumps((a, opt)))
    assert opt_b.set_grad_none is False
    train(a, opt, 3, seed=4)
    train(b, opt_b, 3, seed=4)
    assert_same_params(a, b)
