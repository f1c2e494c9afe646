"""What the benchmarks that take turns in one process share (``arena_pairs.py``,
``product_turns.py``): GPT-2 small's model and batches, the common arguments, and one timed
forward + backward.

>>> args, model, step = gpt2_in_turns(argparse.ArgumentParser())  # doctest: +SKIP
>>> seconds = step(model, 0)  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .models import GPT2_BATCH, GPT2_SMALL, causal_lm_batch, gpt2_model

Step = Callable[[Callable[..., Any], int], float]


def gpt2_in_turns(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, nn.Module, Step]:
    """Add ``--layers``, ``--rounds`` and ``--threads`` to ``parser`` and parse; then GPT-2
    small (``--layers`` of them) under seed 0 at that thread count, fallback disabled unless
    the environment says otherwise, and ``step(stepper, i)``: the seconds of ``stepper``'s
    forward + backward on batch ``i`` (4 x 256 tokens, labels = inputs), gradients cleared
    after it."""
    parser.add_argument("--layers", type=int, default=GPT2_SMALL["n_layer"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = gpt2_model(dict(GPT2_SMALL, n_layer=args.layers))
    batch = causal_lm_batch(GPT2_SMALL["vocab_size"], GPT2_BATCH)

    def step(stepper: Callable[..., Any], i: int) -> float:
        _, kwargs = batch(i, False)
        start = time.perf_counter()
        stepper(**kwargs).loss.backward()
        took = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        return took

    return args, model, step
