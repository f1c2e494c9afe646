"""Random programs from a sequence of choices.

Every decision of the generator is one integer choice: ``draw(n)`` returns a value in
``[0, n)``. A fresh program draws from a seeded ``random.Random``; a recorded sequence
regenerates the same program, and a shorter or smaller sequence a simpler one (past its end every
draw is 0, the simplest option). That is what makes programs shrinkable
(:mod:`.shrink`) and what the hypothesis strategy :func:`programs` draws.

    program = generate_program(seed=7)
    same = replay([*program.choices])
    assert same == program
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from .ir import Dim, Op, Shape, Tensor
from .ops import DEFAULT, OPS, Builder, GenConfig
from .program import Program

__all__ = ["Choices", "generate", "generate_program", "replay"]

SYMBOLS = {"B": (2, 3, 4), "T": (3, 4, 5)}


class Choices:
    """A source of choices: ``prefix`` first, then ``rng`` or ``source`` (or 0 without either);
    records them."""

    def __init__(
        self,
        prefix: Sequence[int] = (),
        rng: random.Random | None = None,
        source: Callable[[int], int] | None = None,
    ) -> None:
        self.prefix = list(prefix)
        self.rng = rng
        self.source = source
        self.record: list[int] = []

    def draw(self, n: int) -> int:
        if n <= 1:
            return 0
        i = len(self.record)
        if i < len(self.prefix):
            value = self.prefix[i] % n
        elif self.rng is not None:
            value = self.rng.randrange(n)
        elif self.source is not None:
            value = self.source(n)
        else:
            value = 0
        self.record.append(value)
        return value


def _weighted_kind(draw: Callable[[int], int], config: GenConfig) -> int:
    weights = [op.weight(config) for op in OPS]
    pick = draw(sum(weights))
    for i, w in enumerate(weights):
        if pick < w:
            return i
        pick -= w
    raise AssertionError("unreachable")


def generate(choices: Choices, config: GenConfig = DEFAULT, seed: int = 0) -> Program:
    """The program ``choices`` decide."""
    draw = choices.draw
    steps = max(1, config.steps)
    sizes: list[dict[str, int]] = [{} for _ in range(steps)]
    for sym, values in SYMBOLS.items():
        first = values[draw(len(values))]
        for step in range(steps):
            changes = config.dynamic_shapes and step > 0 and draw(2) == 1
            sizes[step][sym] = values[draw(len(values))] if changes else first
    min_size = {sym: min(s[sym] for s in sizes) for sym in SYMBOLS}
    dynamic = frozenset(sym for sym in SYMBOLS if len({s[sym] for s in sizes}) > 1)
    b = Builder(draw, config, min_size, dynamic)

    inputs: list[Tensor] = []
    for i in range(1 + draw(2)):
        shape: Shape
        if i > 0 and draw(2) == 1:  # broadcasts with the first input
            first_shape = inputs[0].shape
            shape = tuple(d if draw(3) else 1 for d in first_shape[draw(len(first_shape)) :])
            shape = shape or (1,)
        else:
            rank = 2 + draw(4)
            options: list[Dim] = [2, 1, 3, 4, 6, "B", "T"]
            shape = tuple(options[draw(len(options))] for _ in range(rank))
        grad = "grad" if draw(4) == 3 else "none"
        inputs.append(Tensor(f"x{i}", shape, grad))
        if grad == "none":
            b.plain_inputs.add(f"x{i}")
        b.env.append((f"x{i}", shape))

    ops: list[Op] = []
    for _ in range(1 + draw(config.max_ops)):
        op = OPS[_weighted_kind(draw, config)].gen(b)
        if op is not None:
            ops.append(op)
            b.env.append((op.out, op.shape))

    outputs = [b.env[-1][0]]
    if len(ops) > 1 and draw(3) == 2:  # a second output from earlier in the program
        extra = ops[draw(len(ops) - 1)].out
        if extra not in outputs:
            outputs.append(extra)
    program = Program(
        tuple(inputs),
        tuple(b.params),
        tuple(b.buffers),
        tuple(ops),
        tuple(outputs),
        tuple(tuple(sorted(s.items())) for s in sizes),
        seed,
        tuple(choices.record),
    )
    return _with_gradient(program)


def _with_gradient(program: Program) -> Program:
    """Scale the last output by a parameter when nothing live would get a gradient (the loss
    must need one)."""
    live = program.live_ops()
    reads = {a for op in live for a in op.args} | set(program.outputs)
    params = {p.name for p in program.params}
    if reads & params or any(t.kind == "grad" and t.name in reads for t in program.inputs):
        return program
    last = program.outputs[0]
    shape = next((op.shape for op in program.ops if op.out == last), None)
    if shape is None:
        shape = next(t.shape for t in program.inputs if t.name == last)
    scale = Tensor(f"p{len(program.params)}", (), "one")
    op = Op("out", "binary", (last, scale.name), (("fn", "mul"), ("swap", False)), shape)
    return Program(
        program.inputs,
        (*program.params, scale),
        program.buffers,
        (*program.ops, op),
        ("out", *program.outputs[1:]),
        program.sizes,
        program.seed,
        program.choices,
    )


def generate_program(seed: int, config: GenConfig = DEFAULT) -> Program:
    """The program of ``seed``: the same seed always gives the same program."""
    return generate(Choices(rng=random.Random(seed)), config, seed)


def replay(choices: Sequence[int], config: GenConfig = DEFAULT, seed: int = 0) -> Program:
    """The program a recorded choice sequence gives (draws past its end are 0)."""
    return generate(Choices(choices), config, seed)


def programs(config: GenConfig = DEFAULT):  # type: ignore[no-untyped-def]
    """A hypothesis strategy of programs (hypothesis shrinks the choices it draws).

    @given(programs())
    def test_valid(program): ...
    """
    from hypothesis import strategies as st  # hypothesis is a test dependency only

    @st.composite
    def strategy(draw):  # type: ignore[no-untyped-def]
        seed = draw(st.integers(0, 2**16))
        return generate(Choices(source=lambda n: draw(st.integers(0, n - 1))), config, seed)

    return strategy()
