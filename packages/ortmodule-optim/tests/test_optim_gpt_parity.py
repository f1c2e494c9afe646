"""200 steps of the zoo's GPT under FusedAdam and under torch.optim.AdamW."""

from __future__ import annotations

import copy

import torch

from ortmodule_optim import FusedAdam
from ortmodule_testing.zoo import GPTConfig, GPTDecoder


def max_relative_error(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(
        float(((p - q).abs() / p.abs().clamp_min(1e-12)).max().detach())
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def test_gpt_200_steps_match_adamw():
    config = GPTConfig.small()
    torch.manual_seed(0)
    ref = GPTDecoder(config)
    ours = copy.deepcopy(ref)
    hyper = {"lr": 2e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **hyper)
    opt = FusedAdam(ours.parameters(), **hyper)
    gen = torch.Generator().manual_seed(0)
    first = last = 0.0
    for step in range(200):
        ids = torch.randint(0, config.vocab_size, (4, config.seq_len), generator=gen)
        for model, o in ((ref, ref_opt), (ours, opt)):
            o.zero_grad()
            loss, _ = model(ids, labels=ids)
            loss.backward()
            o.step()
        first = float(loss.detach()) if step == 0 else first
        last = float(loss.detach())
    assert last < first, "the model should have learned something"
    assert max_relative_error(ref, ours) <= 1e-6
