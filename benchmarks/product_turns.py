"""Matrix products on the engine or on PyTorch, against eager and torch.compile, in turns in one
process (``passes/matmul_routes.py``, issue #41).

    python -m benchmarks.product_turns                    # GPT-2 124M, 6 rounds
    python -m benchmarks.product_turns --layers 4 --rounds 3 --no-compile

One ``GPT2LMHeadModel`` (GPT-2 small's config, batch 4 x 256, 2 threads) is trained by four
steppers that share its weights: PyTorch eager, ``torch.compile``, ORTModule with the matrix
products kept on the engine (the kernel choice's products answered "engine" while its graph is
built; everything else as by default, the CPU arena included), ORTModule without the two
built-graph passes that sum a tied table's gradients and the logits' outside gradient in place
(``embedding_grad_sums``, ``output_grad_sums``, left out while its graph is built) and ORTModule
as by default. Each
step is forward + backward (gradients cleared between steps; no optimizer, so every stepper
sees the same weights). After warm-up steps (14 for ORTModule: its in-engine thread trial
settles by then), the four take turns, ABCD DCBA, for ``--rounds`` rounds; each one's median
and the ratios of medians are printed. Steps in separate processes vary by up to 30 % on a
2-core machine; turns in one process share its drift. Peak memory needs a process each
(``python -m benchmarks --scale``).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from .turns import gpt2_in_turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    args, model, timed = gpt2_in_turns(parser)
    from ortmodule import ORTModule
    from ortmodule_exporter.passes import built_graph, matmul_routes

    steppers: dict[str, Callable[..., object]] = {"eager": model}
    if not args.no_compile:
        steppers["compile"] = torch.compile(model)
    steppers["engine products"] = ORTModule(model)
    steppers["no in-place sums"] = ORTModule(model)
    steppers["default"] = ORTModule(model)
    in_place_sums = [
        p
        for p in built_graph.built_graph_passes()
        if p.name in ("embedding_grad_sums", "output_grad_sums")
    ]
    times: dict[str, list[float]] = {name: [] for name in steppers}

    def step(name: str, i: int) -> float:
        return timed(steppers[name], i)

    real_route = matmul_routes.matmul_route
    for name in steppers:
        # the products' decision is made while the first step builds the graph
        if name == "engine products":
            matmul_routes.matmul_route = lambda *a, **k: "engine"  # type: ignore[assignment]
        if name == "no in-place sums":
            for p in in_place_sums:
                built_graph.unregister_built_graph_pass(p.name)
        try:
            first = step(name, 0)
        finally:
            matmul_routes.matmul_route = real_route
            if name == "no in-place sums":
                for p in in_place_sums:
                    built_graph.register_built_graph_pass(p.name, p.fn, p.order)
        # ORTModule's in-engine thread trial settles by its 14th step
        warm = [step(name, i) for i in range(1, 14 if isinstance(steppers[name], ORTModule) else 3)]
        print(f"{name}: first step {first:.2f} s, warm-up {' '.join(f'{t:.2f}' for t in warm)}")
    order = list(steppers)
    for i in range(args.rounds):
        for name in order + order[::-1]:
            times[name].append(step(name, i))
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        ratios = "  ".join(f"{medians[name] / medians[o]:.2f}x {o}" for o in order if o != name)
        print(
            f"{name}: median {medians[name]:.3f} s  ({ratios})  [{' '.join(f'{x:.2f}' for x in t)}]"
        )


if __name__ == "__main__":
    main()
