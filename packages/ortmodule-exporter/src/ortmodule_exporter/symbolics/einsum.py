"""``einsum`` and ``outer`` symbolics."""

from __future__ import annotations

import string
from typing import Any

import torch

from ..torchscript_onnx import symbolic_helper as sh
from .helpers import (
    _FLOAT_TYPES,
    Value,
    _cast,
    _concat,
    _const,
    _dim_scalar,
    _dims,
    _float_type,
    _ints,
    _rank,
    _reduce,
    _scalar_type,
    _unsqueeze,
)

# -- einsum ----------------------------------------------------------------------------------


def _prod(g: Any, dims: Value, count: int) -> Value:
    """Product of a 1-D int64 shape slice as a 1-element tensor ([1] when empty)."""
    if count == 0:
        return _ints(g, [1])
    if count == 1:
        return dims
    return g.op("ReduceProd", dims, keepdims_i=1)


class _Einsum:
    """A decomposition of einsum into Transpose, Reshape, MatMul, Mul and ReduceSum (the
    default export's Einsum node has no gradient in the engine). Operands are folded left to
    right; each pairwise contraction is one batched MatMul."""

    def __init__(self, g: Any, equation: str, operands: list[Value]) -> None:
        self.g = g
        self.equation = equation.replace(" ", "")
        self.operands = operands

    def _labels(self) -> tuple[list[list[str]], list[str]]:
        eq = self.equation
        lhs, arrow, rhs = eq.partition("->")
        terms = lhs.split(",")
        if len(terms) != len(self.operands):
            raise ValueError(
                f"aten::einsum: {eq!r} names {len(terms)} operands, got {len(self.operands)}"
            )
        spare = [c for c in string.ascii_letters if c not in eq]
        ranks = [_rank(v, "aten::einsum") for v in self.operands]
        ellipsis_rank = max(
            [
                r - len(t.replace("...", ""))
                for t, r in zip(terms, ranks, strict=True)
                if "..." in t
            ],
            default=0,
        )
        ell = spare[:ellipsis_rank]
        labels = []
        for term, rank in zip(terms, ranks, strict=True):
            if "..." in term:
                head, tail = term.split("...")
                n = rank - len(head) - len(tail)
                labels.append([*head, *ell[ellipsis_rank - n :], *tail])
            else:
                if len(term) != rank:
                    raise ValueError(
                        f"aten::einsum: {term!r} does not match an operand of rank {rank}"
                    )
                labels.append(list(term))
        if arrow:
            head, dots, tail = rhs.partition("...")
            out = [*head, *(ell if dots else []), *tail]
        else:
            counts: dict[str, int] = {}
            for ls in labels:
                for c in ls:
                    counts[c] = counts.get(c, 0) + 1
            out = [*ell, *sorted(c for c, n in counts.items() if n == 1 and c not in ell)]
        return labels, out

    def run(self) -> Value:
        labels, out = self._labels()
        items = [self._diagonal(v, ls) for v, ls in zip(self.operands, labels, strict=True)]
        value, current = items[0]
        for i in range(1, len(items)):
            later = {c for _, ls in items[i + 1 :] for c in ls} | set(out)
            other, other_labels = items[i]
            value, current = self._sum_unused(value, current, set(other_labels) | later)
            other, other_labels = self._sum_unused(other, other_labels, set(current) | later)
            value, current = self._pair(value, current, other, other_labels, later)
        value, current = self._sum_unused(value, current, set(out))
        missing = [c for c in out if c not in current]
        if missing:
            raise ValueError(
                f"aten::einsum: output labels {missing} appear in no operand of {self.equation!r}"
            )
        return self._transpose(value, current, out)

    def _transpose(self, x: Value, labels: list[str], order: list[str]) -> Value:
        perm = [labels.index(c) for c in order]
        return x if perm == list(range(len(perm))) else self.g.op("Transpose", x, perm_i=perm)

    def _sum_unused(self, x: Value, labels: list[str], needed: set[str]) -> tuple[Value, list[str]]:
        axes = [i for i, c in enumerate(labels) if c not in needed]
        if not axes:
            return x, labels
        x = _reduce(self.g, "ReduceSum", x, axes, keepdims=False)
        return x, [c for c in labels if c in needed]

    def _diagonal(self, x: Value, labels: list[str]) -> tuple[Value, list[str]]:
        """Collapse repeated labels of one operand to their diagonal (a masked sum)."""
        g = self.g
        labels = list(labels)
        while len(set(labels)) != len(labels):
            first = next(c for c in labels if labels.count(c) > 1)
            i = labels.index(first)
            j = labels.index(first, i + 1)
            n = _dim_scalar(g, x, i)
            idx = g.op("Range", _const(g, 0, torch.int64), n, _const(g, 1, torch.int64))
            eye = _cast(
                g, g.op("Equal", _unsqueeze(g, idx, [1]), _unsqueeze(g, idx, [0])), _float_type(x)
            )
            rank = len(labels)
            shape_axes = [a for a in range(rank) if a not in (i, j)]
            mask = _unsqueeze(g, eye, shape_axes) if shape_axes else eye
            x = _reduce(g, "ReduceSum", g.op("Mul", x, mask), [j], keepdims=False)
            del labels[j]
        return x, labels

    def _pair(
        self, a: Value, la: list[str], b: Value, lb: list[str], keep: set[str]
    ) -> tuple[Value, list[str]]:
        g = self.g
        batch = [c for c in la if c in lb and c in keep]
        contracted = [c for c in la if c in lb and c not in keep]
        a_only = [c for c in la if c not in lb]
        b_only = [c for c in lb if c not in la]
        nb, na, nc, nbo = len(batch), len(a_only), len(contracted), len(b_only)
        if not (contracted or a_only or b_only):
            # the same labels on both sides: elementwise
            return g.op("Mul", a, self._transpose(b, lb, la)), la
        # Otherwise one batched MatMul, also for outer products (an empty contraction is a
        # contraction over size 1): the engine loses the shape of a broadcasting Mul between
        # dims of different symbolic names and then cannot build its gradient.
        at = self._transpose(a, la, batch + a_only + contracted)
        bt = self._transpose(b, lb, batch + contracted + b_only)
        a_shape = _concat(
            g,
            _dims(g, at, 0, nb) if nb else _ints(g, []),
            _prod(g, _dims(g, at, nb, nb + na), na),
            _prod(g, _dims(g, at, nb + na, nb + na + nc), nc),
        )
        b_shape = _concat(
            g,
            _dims(g, bt, 0, nb) if nb else _ints(g, []),
            _prod(g, _dims(g, bt, nb, nb + nc), nc),
            _prod(g, _dims(g, bt, nb + nc), nbo),
        )
        product = g.op("MatMul", g.op("Reshape", at, a_shape), g.op("Reshape", bt, b_shape))
        out_shape = _concat(
            g,
            _dims(g, product, 0, nb) if nb else _ints(g, []),
            _dims(g, at, nb, nb + na) if na else _ints(g, []),
            _dims(g, bt, nb + nc) if nbo else _ints(g, []),
        )
        return g.op("Reshape", product, out_shape), batch + a_only + b_only


@sh.parse_args("s", "v", "is")
def einsum(g: Any, equation: str, tensor_list: Value, _path: list[int] | None = None) -> Value:
    return _Einsum(g, equation, sh._unpack_list(tensor_list)).run()


@sh.parse_args("v", "v")
def outer(g: Any, a: Value, b: Value) -> Value:
    # the default export is an Einsum, which the engine cannot differentiate
    if _scalar_type(b) != _scalar_type(a) and _scalar_type(a) in _FLOAT_TYPES:
        b = _cast(g, b, _float_type(a))
    return g.op("Mul", _unsqueeze(g, a, [1]), _unsqueeze(g, b, [0]))
