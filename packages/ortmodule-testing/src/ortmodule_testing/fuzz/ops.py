"""The op catalogue: how each kind of op is generated (shape-aware) and rendered to Python.

Each :class:`OpDef` has a ``gen`` that picks operands of fitting shapes from the builder's
tensors and returns the :class:`~.ir.Op` with its output shape (``None`` when nothing fits), and
a ``render`` giving the lines of ``forward`` that compute it. Choice 0 of every draw is the
simplest option, so that shrinking (which lowers choices) simplifies programs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .ir import Dim, Op, Shape, Tensor

MAX_RANK = 5


@dataclass(frozen=True)
class GenConfig:
    """What the generator may produce.

    ``data_dependent``: Python control flow on tensor values (``if t.sum() > 0``, ``float(t)``).
    ``linspace_by_shape``: ``torch.linspace`` with a size read from a traced shape.
    ``input_inplace``: in-place writes to the module's inputs inside ``forward``.
    ``creation``: weight of the tensor-creation ops (``arange``, ``full``, ``eye``, ...).
    ``dynamic_shapes``: symbolic dims may take other values in later steps.
    ``dynamic_loops``: Python loops over a dim whose size changes between steps (the trace
    unrolls the loop; a guard on the size picks the graph for each trip count).
    ``vector_batched_matmul``: ``torch.matmul(v, x)`` with ``v`` 1-D and ``x`` batched (the
    engine's MatMul gradient for it was wrong, found 2026-11-26 by this fuzzer; exported as a
    batch of rows since).
    ``grad_cuts``: ``x.detach()`` and ``torch.no_grad()`` blocks, among them ops that hand back
    their input itself there (``x.float()``, ``x.contiguous()``), read again after the block
    (both frontends cut such a read, found 2026-11-28 in a Hugging Face model).
    Each switch is on; turning one off keeps a run away from that feature.
    """

    max_ops: int = 8
    steps: int = 3
    data_dependent: bool = True
    linspace_by_shape: bool = True
    input_inplace: bool = True
    creation: int = 4
    dynamic_shapes: bool = True
    dynamic_loops: bool = True
    vector_batched_matmul: bool = True
    grad_cuts: bool = True


DEFAULT = GenConfig()


@dataclass
class Builder:
    """Generation state: the tensors so far, parameters, buffers and the choice source."""

    draw: Callable[[int], int]
    config: GenConfig
    #: smallest value each symbol takes over the steps
    min_size: dict[str, int]
    #: the symbols whose value changes between steps
    dynamic: frozenset[str] = frozenset()
    env: list[tuple[str, Shape]] = field(default_factory=list)
    params: list[Tensor] = field(default_factory=list)
    buffers: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    #: inputs that do not require grad (the only ones an in-place write may touch)
    plain_inputs: set[str] = field(default_factory=set)
    count: int = 0

    def fresh(self) -> str:
        self.count += 1
        return f"t{self.count}"

    def coin(self) -> bool:
        return self.draw(2) == 1

    def one_of(self, options: Sequence[Any]) -> Any:
        return options[self.draw(len(options))]

    def pick(self, fits: Callable[[Shape], bool] = lambda s: True) -> tuple[str, Shape] | None:
        """A tensor whose shape fits, the most recent first (choice 0)."""
        found = [e for e in reversed(self.env) if fits(e[1])]
        return found[self.draw(len(found))] if found else None

    def param(self, shape: Shape, kind: str = "randn") -> str:
        name = f"p{len(self.params)}"
        self.params.append(Tensor(name, shape, kind))
        return name

    def buffer(self, shape: tuple[int, ...], values: tuple[int, ...]) -> str:
        name = f"idx{len(self.buffers)}"
        self.buffers.append((name, shape, values))
        return name

    def low(self, d: Dim) -> int:
        """The smallest size dim ``d`` has in any step."""
        return d if isinstance(d, int) else self.min_size[d]


@dataclass(frozen=True)
class OpDef:
    kind: str
    weight: Callable[[GenConfig], int]
    gen: Callable[[Builder], Op | None]
    render: Callable[[Op], list[str]]


# --- shape helpers --------------------------------------------------------------------------------


def broadcast(a: Shape, b: Shape) -> Shape | None:
    """The broadcast shape of ``a`` and ``b``; None where they do not broadcast."""
    out: list[Dim] = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None
    return tuple(reversed(out))


def _const(shape: Shape) -> bool:
    return all(isinstance(d, int) for d in shape)


def _dims(name: str, shape: Shape) -> str:
    """Sizes for ``reshape``/``expand``: constants as numbers, symbols read from the tensor."""
    return ", ".join(
        str(d) if isinstance(d, int) else f"{name}.shape[{i}]" for i, d in enumerate(shape)
    )


def _index(rank: int, dim: int, item: str) -> str:
    return "[" + ", ".join([":"] * dim + [item]) + "]"


def _broadcast_partner(b: Builder, shape: Shape) -> str | None:
    """Another operand broadcasting with ``shape``: a python scalar (None), a tensor, or a
    parameter of a broadcast shape (size-1 dims, missing leading dims)."""
    how = b.draw(4)
    if how == 0:
        return None
    if how == 1:
        found = b.pick(lambda s: broadcast(shape, s) == shape)
        if found:
            return found[0]
    drop = b.draw(len(shape) + 1)
    pshape = tuple(d if isinstance(d, int) and b.coin() else 1 for d in shape[drop:])
    return b.param(pshape)


# --- ops --------------------------------------------------------------------------------------------

UNARY = {
    "tanh": "torch.tanh({x})",
    "sigmoid": "torch.sigmoid({x})",
    "relu": "torch.relu({x})",
    "gelu": "F.gelu({x})",
    "softplus": "F.softplus({x})",
    "exp": "torch.exp(torch.tanh({x}))",
    "log1p_exp": "torch.log1p(torch.exp(torch.tanh({x})))",
    "square": "{x} * {x}",
    "neg": "-{x}",
    "sin": "torch.sin({x})",
    "clamp": "{x}.clamp(-0.5, 0.8)",
    "clamp_min": "torch.clamp({x}, min=0.1)",
    "masked_fill": "{x}.masked_fill({x} > 0.3, -0.2)",
    "scale_by_shape": "{x} / {x}.shape[-1]",
}


def _gen_unary(b: Builder) -> Op | None:
    x, shape = b.pick() or (None, ())
    fn = b.one_of(list(UNARY))
    if x is None or (fn == "scale_by_shape" and not shape):
        return None
    return Op(b.fresh(), "unary", (x,), (("fn", fn),), shape)


def _render_unary(op: Op) -> list[str]:
    return [f"{op.out} = " + UNARY[op.attr("fn")].format(x=op.args[0])]


BINARY = {
    "add": "{a} + {b}",
    "sub": "{a} - {b}",
    "mul": "{a} * {b}",
    "div": "{a} / (1.0 + {b} * {b})",
    "maximum": "torch.maximum({a}, {b})",
    "minimum": "torch.minimum({a}, {b})",
    "where": "torch.where({a} > 0, {a}, {b})",
}


def _gen_binary(b: Builder) -> Op | None:
    found = b.pick()
    if found is None:
        return None
    x, shape = found
    fn = b.one_of(list(BINARY))
    if b.coin():  # a tensor of another shape: the result broadcasts both ways
        other = b.pick(lambda s: broadcast(shape, s) is not None)
        if other is not None:
            out = broadcast(shape, other[1])
            assert out is not None
            return Op(b.fresh(), "binary", (x, other[0]), (("fn", fn), ("swap", b.coin())), out)
    partner = _broadcast_partner(b, shape)
    if partner is None:
        scalar = b.one_of([0.5, -1.5, 2.0])
        return Op(b.fresh(), "scalar", (x,), (("fn", fn), ("value", scalar)), shape)
    return Op(b.fresh(), "binary", (x, partner), (("fn", fn), ("swap", b.coin())), shape)


def _render_binary(op: Op) -> list[str]:
    a, c = op.args
    if op.attr("swap"):
        a, c = c, a
    return [f"{op.out} = " + BINARY[op.attr("fn")].format(a=a, b=c)]


def _render_scalar(op: Op) -> list[str]:
    value = op.attr("value")
    fn = op.attr("fn")
    if fn in ("maximum", "minimum", "where"):
        text = {
            "maximum": "{a}.clamp(min={v})",
            "minimum": "{a}.clamp(max={v})",
            "where": "torch.where({a} > 0, {a}, {v})",
        }[fn]
        return [f"{op.out} = " + text.format(a=op.args[0], v=value)]
    return [f"{op.out} = " + BINARY[fn].format(a=op.args[0], b=value)]


REDUCE = {
    "sum": "{x}.sum(dim={d}, keepdim={k})",
    "mean": "{x}.mean(dim={d}, keepdim={k})",
    "amax": "{x}.amax(dim={d}, keepdim={k})",
    "amin": "{x}.amin(dim={d}, keepdim={k})",
    "max": "{x}.max(dim={d}, keepdim={k}).values",
    "min": "{x}.min(dim={d}, keepdim={k}).values",
    "var": "{x}.var(dim={d}, keepdim={k})",
    "norm": "torch.linalg.vector_norm({x}, dim={d}, keepdim={k})",
    "logsumexp": "torch.logsumexp({x}, dim={d}, keepdim={k})",
}


def _gen_reduce(b: Builder) -> Op | None:
    found = b.pick(lambda s: len(s) >= 1)
    if found is None:
        return None
    x, shape = found
    fn = b.one_of(list(REDUCE))
    d = b.draw(len(shape))
    if fn == "var" and b.low(shape[d]) < 2:
        fn = "sum"
    keep = b.coin()
    out = shape[:d] + ((1,) if keep else ()) + shape[d + 1 :]
    neg = b.coin()  # negative axis numbering
    return Op(
        b.fresh(),
        "reduce",
        (x,),
        (("fn", fn), ("dim", d - len(shape) if neg else d), ("keepdim", keep)),
        out,
    )


def _render_reduce(op: Op) -> list[str]:
    text = REDUCE[op.attr("fn")].format(x=op.args[0], d=op.attr("dim"), k=op.attr("keepdim"))
    return [f"{op.out} = {text}"]


ALONG = {
    "softmax": "torch.softmax({x}, dim={d})",
    "log_softmax": "F.log_softmax({x}, dim={d})",
    "cumsum": "torch.cumsum({x}, dim={d})",
    "flip": "torch.flip({x}, dims=({d},))",
    "roll": "torch.roll({x}, shifts=1, dims={d})",
}


def _gen_along(b: Builder) -> Op | None:
    found = b.pick(lambda s: len(s) >= 1)
    if found is None:
        return None
    x, shape = found
    fn = b.one_of(list(ALONG))
    return Op(b.fresh(), "along", (x,), (("fn", fn), ("dim", b.draw(len(shape)))), shape)


def _render_along(op: Op) -> list[str]:
    return [f"{op.out} = " + ALONG[op.attr("fn")].format(x=op.args[0], d=op.attr("dim"))]


def _gen_tril(b: Builder) -> Op | None:
    found = b.pick(lambda s: len(s) >= 2)
    if found is None:
        return None
    return Op(b.fresh(), "tril", (found[0],), (("diagonal", b.draw(3) - 1),), found[1])


def _render_tril(op: Op) -> list[str]:
    return [f"{op.out} = torch.tril({op.args[0]}, diagonal={op.attr('diagonal')})"]


def _gen_layout(b: Builder) -> Op | None:
    """transpose, permute, unsqueeze, squeeze, expand."""
    found = b.pick()
    if found is None:
        return None
    x, shape = found
    how = b.draw(5)
    r = len(shape)
    if how == 0 and r >= 2:
        i, j = b.draw(r), b.draw(r)
        swapped = list(shape)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        return Op(b.fresh(), "transpose", (x,), (("dims", (i, j)),), tuple(swapped))
    if how == 1 and r >= 2:
        perm = list(range(r))
        for i in range(r - 1, 0, -1):  # Fisher-Yates on the choices
            j = b.draw(i + 1)
            perm[i], perm[j] = perm[j], perm[i]
        return Op(
            b.fresh(), "permute", (x,), (("perm", tuple(perm)),), tuple(shape[p] for p in perm)
        )
    if how == 2 and r < MAX_RANK:
        d = b.draw(r + 1)
        return Op(b.fresh(), "unsqueeze", (x,), (("dim", d),), shape[:d] + (1,) + shape[d:])
    ones = [i for i, d in enumerate(shape) if d == 1]
    if how == 3 and ones:
        d = b.one_of(ones)
        return Op(b.fresh(), "squeeze", (x,), (("dim", d),), shape[:d] + shape[d + 1 :])
    if how == 4 and ones:
        d = b.one_of(ones)
        size = b.one_of([2, 3])
        out = shape[:d] + (size,) + shape[d + 1 :]
        return Op(b.fresh(), "expand", (x,), (("dim", d), ("size", size)), out)
    return None


def _render_layout(op: Op) -> list[str]:
    x = op.args[0]
    if op.kind == "transpose":
        i, j = op.attr("dims")
        return [f"{op.out} = {x}.transpose({i}, {j})"]
    if op.kind == "permute":
        return [f"{op.out} = {x}.permute{op.attr('perm')}"]
    if op.kind == "unsqueeze":
        return [f"{op.out} = {x}.unsqueeze({op.attr('dim')})"]
    if op.kind == "squeeze":
        return [f"{op.out} = {x}.squeeze({op.attr('dim')})"]
    sizes = ["-1"] * len(op.shape)
    sizes[op.attr("dim")] = str(op.attr("size"))
    return [f"{op.out} = {x}.expand({', '.join(sizes)})"]


def _gen_reshape(b: Builder) -> Op | None:
    """Split a constant dim in two, or merge two adjacent constant dims; symbolic sizes are
    read from the tensor (``x.shape[i]``)."""
    found = b.pick()
    if found is None:
        return None
    x, shape = found
    if b.coin():
        splits = [i for i, d in enumerate(shape) if isinstance(d, int) and d in (4, 6, 8, 9, 12)]
        if splits and len(shape) < MAX_RANK:
            i = b.one_of(splits)
            n = shape[i]
            assert isinstance(n, int)
            a = 2 if n % 2 == 0 else 3
            out = shape[:i] + (a, n // a) + shape[i + 1 :]
            return Op(b.fresh(), "reshape", (x,), (("split", i),), out)
    merges = [
        i
        for i in range(len(shape) - 1)
        if isinstance(shape[i], int) and isinstance(shape[i + 1], int)
    ]
    if not merges:
        return None
    i = b.one_of(merges)
    a, c = shape[i], shape[i + 1]
    assert isinstance(a, int) and isinstance(c, int)
    out = shape[:i] + (a * c,) + shape[i + 2 :]
    return Op(b.fresh(), "reshape", (x,), (("merge", i),), out)


def _render_reshape(op: Op) -> list[str]:
    x = op.args[0]
    # Sizes of the output, with each symbolic one read from the input's matching dim.
    attrs = dict(op.attrs)
    if "split" in attrs:
        i = attrs["split"]
        src = [*range(i), None, None, *range(i + 1, len(op.shape) - 1)]
    else:
        i = attrs["merge"]
        src = [*range(i), None, *range(i + 2, len(op.shape) + 1)]
    sizes = [
        str(d) if isinstance(d, int) else f"{x}.shape[{s}]"
        for d, s in zip(op.shape, src, strict=True)
    ]
    return [f"{op.out} = {x}.reshape({', '.join(sizes)})"]


def _gen_slice(b: Builder) -> Op | None:
    """Basic slicing and integer indexing along one dim."""
    found = b.pick(lambda s: len(s) >= 1)
    if found is None:
        return None
    x, shape = found
    d = b.draw(len(shape))
    n = shape[d]
    low = b.low(n)
    how = b.draw(4)
    if how == 0 and low >= 2:  # x[:, -2:]
        out = shape[:d] + (2,) + shape[d + 1 :]
        return Op(b.fresh(), "slice", (x,), (("dim", d), ("item", "-2:")), out)
    if how == 1 and isinstance(n, int) and n >= 3:  # x[:, 1:n:2]
        out = shape[:d] + (len(range(1, n, 2)),) + shape[d + 1 :]
        return Op(b.fresh(), "slice", (x,), (("dim", d), ("item", "1::2")), out)
    if how == 2 and len(shape) >= 2:  # x[:, i]
        i = b.draw(low) - (low if b.coin() else 0)
        return Op(
            b.fresh(), "slice", (x,), (("dim", d), ("item", str(i))), shape[:d] + shape[d + 1 :]
        )
    if how == 3:  # index_select with fixed indices (repeats too)
        k = 1 + b.draw(4)
        values = tuple(b.draw(low) for _ in range(k))
        idx = b.buffer((k,), values)
        out = shape[:d] + (k,) + shape[d + 1 :]
        return Op(b.fresh(), "index_select", (x, idx), (("dim", d),), out)
    return None


def _render_slice(op: Op) -> list[str]:
    x = op.args[0]
    if op.kind == "index_select":
        return [f"{op.out} = {x}.index_select({op.attr('dim')}, {op.args[1]})"]
    d = op.attr("dim")
    rank = len(op.shape) + (0 if ":" in op.attr("item") else 1)
    return [f"{op.out} = {x}{_index(rank, d, op.attr('item'))}"]


def _gen_gather(b: Builder) -> Op | None:
    found = b.pick(lambda s: len(s) >= 1 and _const(s))
    if found is None:
        return None
    x, shape = found
    d = b.draw(len(shape))
    n = shape[d]
    assert isinstance(n, int)
    k = 1 + b.draw(3)
    ishape = tuple(int(s) for s in shape[:d]) + (k,) + tuple(int(s) for s in shape[d + 1 :])
    count = 1
    for s in ishape:
        count *= s
    values = tuple(b.draw(n) for _ in range(count))
    idx = b.buffer(ishape, values)
    return Op(b.fresh(), "gather", (x, idx), (("dim", d),), ishape)


def _render_gather(op: Op) -> list[str]:
    return [f"{op.out} = torch.gather({op.args[0]}, {op.attr('dim')}, {op.args[1]})"]


def _gen_matmul(b: Builder) -> Op | None:
    found = b.pick(lambda s: len(s) >= 1)
    if found is None:
        return None
    x, shape = found
    k = shape[-1]
    how = b.draw(5)
    if how == 4 and len(shape) >= 2:  # x @ x^T: batch dims shared, n x n
        out = shape[:-1] + (shape[-2],)
        return Op(b.fresh(), "matmul_self", (x,), (), out)
    if not isinstance(k, int):
        return None
    if how == 1:  # matrix-vector
        w = b.param((k,))
        return Op(b.fresh(), "matmul", (x, w), (), shape[:-1])
    if how == 2 and len(shape) >= 2:  # vector-matrix: w (n,) @ x (..., n, k)
        n = shape[-2]
        if not isinstance(n, int) or (len(shape) > 2 and not b.config.vector_batched_matmul):
            return None
        w = b.param((n,))
        return Op(b.fresh(), "matmul", (w, x), (), shape[:-2] + (k,))
    m = b.one_of([3, 2, 4])
    if how == 3 and len(shape) >= 2:  # broadcast batch dims on the weight
        batch = b.one_of([1, 2])
        w = b.param((batch, k, m))
        lead = shape[:-2]
        batch_out = broadcast(lead, (batch,))
        if batch_out is None:
            return None
        return Op(b.fresh(), "matmul", (x, w), (), batch_out + (shape[-2], m))
    if how == 0 and b.coin():  # F.linear with a bias
        w, bias = b.param((m, k)), b.param((m,))
        return Op(b.fresh(), "linear", (x, w, bias), (), shape[:-1] + (m,))
    w = b.param((k, m))
    return Op(b.fresh(), "matmul", (x, w), (), shape[:-1] + (m,))


def _render_matmul(op: Op) -> list[str]:
    if op.kind == "matmul_self":
        x = op.args[0]
        return [f"{op.out} = torch.matmul({x}, {x}.transpose(-1, -2))"]
    if op.kind == "linear":
        return [f"{op.out} = F.linear({op.args[0]}, {op.args[1]}, {op.args[2]})"]
    return [f"{op.out} = torch.matmul({op.args[0]}, {op.args[1]})"]


def _gen_norm(b: Builder) -> Op | None:
    found = b.pick(lambda s: len(s) >= 1 and isinstance(s[-1], int) and s[-1] >= 2)
    if found is None:
        return None
    x, shape = found
    k = shape[-1]
    w, bias = b.param((k,), "one"), b.param((k,))
    return Op(b.fresh(), "layer_norm", (x, w, bias), (), shape)


def _render_norm(op: Op) -> list[str]:
    x, w, bias = op.args
    return [f"{op.out} = F.layer_norm({x}, ({x}.shape[-1],), {w}, {bias})"]


def _gen_conv(b: Builder) -> Op | None:
    found = b.pick(lambda s: len(s) == 3 and isinstance(s[1], int))
    if found is None:
        return None
    x, shape = found
    c = shape[1]
    assert isinstance(c, int)
    groups = b.one_of([g for g in (1, 2, 3) if c % g == 0])
    kernel = b.one_of([1, 3])
    cout = groups * b.one_of([1, 2])
    w, bias = b.param((cout, c // groups, kernel)), b.param((cout,))
    out = (shape[0], cout, shape[2])
    return Op(
        b.fresh(), "conv1d", (x, w, bias), (("groups", groups), ("padding", kernel // 2)), out
    )


def _render_conv(op: Op) -> list[str]:
    x, w, bias = op.args
    return [
        f"{op.out} = F.conv1d({x}, {w}, {bias}, padding={op.attr('padding')}, groups={op.attr('groups')})"
    ]


def _gen_loop(b: Builder) -> Op | None:
    """A Python loop over a dim, joined with stack or cat: a recurrence or a per-step op."""
    found = b.pick(lambda s: len(s) >= 2)
    if found is None:
        return None
    x, shape = found
    dims = [i for i, d in enumerate(shape) if b.config.dynamic_loops or d not in b.dynamic]
    if not dims:
        return None
    d = b.one_of(dims)
    row = shape[:d] + shape[d + 1 :]
    decay = b.param(tuple(d if isinstance(d, int) and b.coin() else 1 for d in row[-1:]))
    body = b.one_of(["recurrence", "scaled"])
    join = b.one_of(["stack", "cat"])
    return Op(b.fresh(), "loop", (x, decay), (("dim", d), ("body", body), ("join", join)), shape)


def _render_loop(op: Op) -> list[str]:
    x, decay = op.args
    d = op.attr("dim")
    o = op.out
    lines = []
    if op.attr("body") == "recurrence":
        lines += [
            f"h = torch.zeros_like({x}.select({d}, 0))",
            f"{o}_steps = []",
            f"for i in range({x}.shape[{d}]):",
            f"    h = torch.tanh(h * {decay} + {x}.select({d}, i))",
            f"    {o}_steps.append(h)",
        ]
    else:
        lines += [
            f"{o}_steps = []",
            f"for i in range({x}.shape[{d}]):",
            f"    {o}_steps.append({x}.select({d}, i) * {decay} * (i + 1))",
        ]
    if op.attr("join") == "stack":
        lines.append(f"{o} = torch.stack({o}_steps, dim={d})")
    else:
        lines.append(f"{o} = torch.cat([s.unsqueeze({d}) for s in {o}_steps], dim={d})")
    return lines


INPLACE = {
    "add_": ["{o} = {x} * 1.0", "{o}.add_({y})"],
    "mul_": ["{o} = {x} + 0.0", "{o}.mul_({y})"],
    "clamp_": ["{o} = {x} * 1.0", "{o}.clamp_(-0.5, 0.5)"],
    "index_put": ["{o} = {x}.clone()", "{o}[..., 0] = 0.25"],
    "masked_fill_": ["{o} = {x} * 2.0", "{o}.masked_fill_({o} > 0.5, 0.5)"],
}


def _gen_inplace(b: Builder) -> Op | None:
    """In-place ops on an intermediate (a fresh tensor of forward, never an input)."""
    found = b.pick(lambda s: len(s) >= 1)
    if found is None:
        return None
    x, shape = found
    fn = b.one_of(list(INPLACE))
    args: tuple[str, ...] = (x,)
    if fn in ("add_", "mul_"):
        y = _broadcast_partner(b, shape)
        if y is not None:
            args = (x, y)
    return Op(b.fresh(), "inplace", args, (("fn", fn),), shape)


def _render_inplace(op: Op) -> list[str]:
    y = op.args[1] if len(op.args) > 1 else "0.5"
    return [line.format(o=op.out, x=op.args[0], y=y) for line in INPLACE[op.attr("fn")]]


CREATE = {
    "linspace": "{x} * torch.linspace(-1.0, 1.0, {x}.shape[-1])",
    "arange": "{x} + torch.arange({x}.shape[-1]) * 0.25",
    "arange_float": "{x} + torch.arange(0.0, {x}.shape[-1] * 0.5, 0.5)",
    "full": "{x} + torch.full(({x}.shape[-1],), 0.3)",
    "ones_like": "{x} * torch.ones_like({x}) * 0.5",
    "zeros": "{x} + torch.zeros({x}.shape[-1])",
    "new_ones": "{x} - {x}.new_ones({x}.shape[-1])",
    "eye": "{x} + torch.eye({x}.shape[-2], {x}.shape[-1])",
}


def _gen_create(b: Builder) -> Op | None:
    found = b.pick(lambda s: len(s) >= 1)
    if found is None:
        return None
    x, shape = found
    names = [n for n in CREATE if b.config.linspace_by_shape or n != "linspace"]
    fn = b.one_of(names)
    if fn == "eye" and len(shape) < 2:
        fn = "full"
    return Op(b.fresh(), "create", (x,), (("fn", fn),), shape)


def _render_create(op: Op) -> list[str]:
    return [f"{op.out} = " + CREATE[op.attr("fn")].format(x=op.args[0])]


def _gen_data_dependent(b: Builder) -> Op | None:
    found = b.pick()
    if found is None:
        return None
    return Op(
        b.fresh(), "data_dependent", (found[0],), (("fn", b.one_of(["if", "float"])),), found[1]
    )


def _render_data_dependent(op: Op) -> list[str]:
    x, o = op.args[0], op.out
    if op.attr("fn") == "float":
        return [f"{o} = {x} * float({x}.mean())"]
    return [f"if {x}.sum() > 0:", f"    {o} = {x} * 2.0", "else:", f"    {o} = {x} - 1.0"]


#: each keeps a gradient path from its input to its output in eager, beside the cut one
GRAD_CUTS = {
    "detach": ["{o} = {x} * {x}.detach()"],
    "no_grad": ["with torch.no_grad():", "    {c} = torch.tanh({x})", "{o} = {x} + {c}"],
    # {x}.float() is {x} itself, which still requires grad
    "no_grad_same_tensor": [
        "with torch.no_grad():",
        "    {c} = {x}.float()",
        "{o} = {c} * 2.0 + {x}",
    ],
    # {x} itself where it is contiguous, a copy without grad where not
    "no_grad_contiguous": [
        "with torch.no_grad():",
        "    {c} = {x}.contiguous()",
        "{o} = {c} * {x}",
    ],
    "no_grad_copy": [
        "with torch.no_grad():",
        "    {c} = {x}.to(torch.float32, copy=True)",
        "{o} = {c} * {x}",
    ],
    # {x} read after a block that handed it back as is
    "no_grad_reread": ["with torch.no_grad():", "    {c} = {x}.float().mean()", "{o} = {x} * {c}"],
}


def _gen_grad_cut(b: Builder) -> Op | None:
    found = b.pick()
    if found is None:
        return None
    return Op(b.fresh(), "grad_cut", (found[0],), (("fn", b.one_of(list(GRAD_CUTS))),), found[1])


def _render_grad_cut(op: Op) -> list[str]:
    x, o = op.args[0], op.out
    return [line.format(x=x, o=o, c=f"{o}_cut") for line in GRAD_CUTS[op.attr("fn")]]


def _gen_input_inplace(b: Builder) -> Op | None:
    # only as the first op: a write after an op read the input is invalid in eager when that
    # op saved it for backward (layer_norm, mul)
    inputs = [(n, s) for n, s in b.env if n in b.plain_inputs]
    if not inputs or b.count:
        return None
    x, shape = b.one_of(inputs)
    return Op(b.fresh(), "input_inplace", (x,), (), shape)


def _render_input_inplace(op: Op) -> list[str]:
    return [f"{op.out} = {op.args[0]}.mul_(0.5).add_(0.1)"]


def _gen_none(b: Builder) -> Op | None:
    return None


def _always(w: int) -> Callable[[GenConfig], int]:
    return lambda config: w


OPS: tuple[OpDef, ...] = (
    # first: no op at all, so that shrinking a choice to 0 removes the op
    OpDef("none", _always(1), _gen_none, lambda op: []),
    OpDef("unary", _always(14), _gen_unary, _render_unary),
    OpDef("binary", _always(14), _gen_binary, _render_binary),
    OpDef("reduce", _always(10), _gen_reduce, _render_reduce),
    OpDef("along", _always(8), _gen_along, _render_along),
    OpDef("tril", _always(2), _gen_tril, _render_tril),
    OpDef("layout", _always(10), _gen_layout, _render_layout),
    OpDef("reshape", _always(5), _gen_reshape, _render_reshape),
    OpDef("slice", _always(7), _gen_slice, _render_slice),
    OpDef("gather", _always(2), _gen_gather, _render_gather),
    OpDef("matmul", _always(9), _gen_matmul, _render_matmul),
    OpDef("layer_norm", _always(3), _gen_norm, _render_norm),
    OpDef("conv1d", _always(3), _gen_conv, _render_conv),
    OpDef("loop", _always(4), _gen_loop, _render_loop),
    OpDef("inplace", _always(5), _gen_inplace, _render_inplace),
    OpDef("create", lambda c: c.creation, _gen_create, _render_create),
    OpDef(
        "data_dependent",
        lambda c: 3 if c.data_dependent else 0,
        _gen_data_dependent,
        _render_data_dependent,
    ),
    OpDef(
        "input_inplace",
        lambda c: 2 if c.input_inplace else 0,
        _gen_input_inplace,
        _render_input_inplace,
    ),
    OpDef("grad_cut", lambda c: 3 if c.grad_cuts else 0, _gen_grad_cut, _render_grad_cut),
)

_RENDER: dict[str, Callable[[Op], list[str]]] = {
    "unary": _render_unary,
    "binary": _render_binary,
    "scalar": _render_scalar,
    "reduce": _render_reduce,
    "along": _render_along,
    "tril": _render_tril,
    "transpose": _render_layout,
    "permute": _render_layout,
    "unsqueeze": _render_layout,
    "squeeze": _render_layout,
    "expand": _render_layout,
    "reshape": _render_reshape,
    "slice": _render_slice,
    "index_select": _render_slice,
    "gather": _render_gather,
    "matmul": _render_matmul,
    "matmul_self": _render_matmul,
    "linear": _render_matmul,
    "layer_norm": _render_norm,
    "conv1d": _render_conv,
    "loop": _render_loop,
    "inplace": _render_inplace,
    "create": _render_create,
    "data_dependent": _render_data_dependent,
    "input_inplace": _render_input_inplace,
    "grad_cut": _render_grad_cut,
}


def render_op(op: Op) -> list[str]:
    """The lines of ``forward`` computing ``op``."""
    return _RENDER[op.kind](op)
