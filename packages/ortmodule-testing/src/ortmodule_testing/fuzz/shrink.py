"""Shrink a failing program to a minimal one that fails the same way.

The same idea as hypothesis's shrinker: the program is its sequence of choices (see
:mod:`.generate`), and a shorter or smaller sequence is a simpler program. Passes delete runs
of choices and lower single choices (to 0, then by halving) while the failure keeps its
signature; candidates that give a program already tried, or a larger one, are skipped.

    smaller = shrink(program, lambda p: run(p).signature == "wrong")
"""

from __future__ import annotations

from collections.abc import Callable

from .generate import replay
from .ops import DEFAULT, GenConfig
from .program import Program

__all__ = ["shrink", "size"]


def size(program: Program) -> tuple[int, int, int, int]:
    """Smaller is simpler: live ops, inputs' total rank, parameters, source length."""
    live = program.live_ops()
    used = {a for op in live for a in op.args}
    return (
        len(live),
        sum(len(t.shape) for t in program.inputs),
        sum(1 for p in program.params if p.name in used),
        len(program.to_source()),
    )


def shrink(
    program: Program,
    fails: Callable[[Program], bool],
    config: GenConfig = DEFAULT,
    budget: int = 150,
) -> Program:
    """The smallest program found (within ``budget`` runs of ``fails``) for which ``fails``
    holds; ``program`` itself must fail."""
    best = program
    best_size = size(best)
    seen = {best.to_source()}
    runs = 0

    def attempt(choices: list[int]) -> bool:
        nonlocal best, best_size, runs
        if runs >= budget:
            return False
        candidate = replay(choices, config, program.seed)
        source = candidate.to_source()
        if source in seen:
            return False
        seen.add(source)
        cand_size = size(candidate)
        if cand_size >= best_size:
            return False
        runs += 1
        if fails(candidate):
            best, best_size = candidate, cand_size
            return True
        return False

    improved = True
    while improved and runs < budget:
        improved = False
        for chunk in (8, 4, 2, 1):
            i = 0
            while i < len(best.choices):
                choices = list(best.choices)
                if attempt(choices[:i] + choices[i + chunk :]):
                    improved = True
                else:
                    i += 1
        i = 0
        while i < len(best.choices):  # a success may shorten the choices
            choices = list(best.choices)
            value = choices[i]
            i += 1
            for lower in (0, value // 2, value - 1):
                if 0 <= lower < value:
                    trial = list(choices)
                    trial[i - 1] = lower
                    if attempt(trial):
                        improved = True
                        break
    return best
