"""The row indices the sparsity rewrites move tokens by: the kept tokens of a padded batch
(:func:`kept_indices`) or the labelled ones (:func:`labelled_indices`), and the
:class:`RowBuilder` that writes their nodes.

>>> from ortmodule_exporter.sparsity.row_indices import RowBuilder
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper

__all__ = ["RowBuilder", "kept_indices", "labelled_indices"]


class RowBuilder:
    """New nodes, each named under ``prefix``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.count = 0

    def name(self, what: str) -> str:
        self.count += 1
        return f"{self.prefix}/{what}_{self.count}"

    def const(self, what: str, value: np.ndarray) -> str:
        name = self.name(what)
        self.initializers.append(onnx.numpy_helper.from_array(value, name))
        return name

    def op(
        self, op_type: str, inputs: list[str], what: str, outputs: int = 1, **attrs: Any
    ) -> list[str]:
        name = self.name(what)
        outs = [f"{name}/out{i}" for i in range(outputs)]
        self.nodes.append(onnx.helper.make_node(op_type, inputs, outs, name=name, **attrs))
        return outs

    def one(self, op_type: str, inputs: list[str], what: str, **attrs: Any) -> str:
        return self.op(op_type, inputs, what, **attrs)[0]


def kept_indices(
    b: RowBuilder,
    mask: str,
    mask_dtype: np.dtype,
    labels: list[tuple[str, int]],
    positions: set[int],
) -> tuple[str, str, str]:
    """Nodes computing the kept rows: (row indices [kept], inverse index [batch, seq], mask
    shape). ``positions``: token positions kept in every sequence (those a pick reads)."""
    zero = b.const("zero", np.zeros((), dtype=mask_dtype))
    shape = b.one("Shape", [mask], "mask_shape")
    real2d = b.one("Not", [b.one("Equal", [mask, zero], "is_pad")], "is_real")
    per_seq = b.one(
        "ReduceSum",
        [
            b.one("Cast", [real2d], "real_int", to=onnx.TensorProto.INT64),
            b.const("axis1", np.array([1], np.int64)),
        ],
        "real_per_seq",
        keepdims=1,
    )
    empty = b.one(
        "Expand",
        [b.one("Equal", [per_seq, b.const("zero_i64", np.array(0, np.int64))], "empty_seq"), shape],
        "empty_rows",
    )
    keep2d = b.one("Or", [real2d, empty], "keep_real")
    if positions:
        seq = b.one("Gather", [shape, b.const("one_i64", np.array(1, np.int64))], "seq_len")
        every = b.one(
            "Range",
            [
                b.const("zero_pos", np.array(0, np.int64)),
                seq,
                b.const("step", np.array(1, np.int64)),
            ],
            "positions",
        )
        for picked in sorted(positions):
            at = b.const("picked", np.array(picked, np.int64))
            keep2d = b.one("Or", [keep2d, b.one("Equal", [every, at], "is_picked")], "keep_picked")
    flat_shape = b.const("minus_one", np.array([-1], np.int64))
    keep = _or_labelled(b, b.one("Reshape", [keep2d, flat_shape], "keep_flat"), labels)
    rows, inverse_flat = _kept_rows(b, keep)
    return rows, b.one("Reshape", [inverse_flat, shape], "inverse"), shape


def _or_labelled(b: RowBuilder, keep: str, labels: list[tuple[str, int]]) -> str:
    """Nodes computing ``keep`` (flat; ``""`` for none) or each loss's counted labels."""
    for labels_name, ignore in labels:
        ignored = b.one(
            "Equal", [labels_name, b.const("ignore", np.array(ignore, np.int64))], "ignored"
        )
        counted = b.one("Not", [ignored], "labelled")
        keep = b.one("Or", [keep, counted], "keep_labelled") if keep else counted
    return keep


def _kept_rows(b: RowBuilder, keep: str) -> tuple[str, str]:
    """Nodes computing the flat positions ``keep`` marks (row indices [kept]) and the inverse
    index (flat position -> kept row, or the number of kept rows for a position left out)."""
    rows = b.one(
        "Squeeze",
        [b.one("NonZero", [keep], "kept"), b.const("axis0", np.array([0], np.int64))],
        "rows",
    )
    position = b.one(
        "Sub",
        [
            b.one(
                "CumSum",
                [
                    b.one("Cast", [keep], "keep_int", to=onnx.TensorProto.INT64),
                    b.const("axis0s", np.array(0, np.int64)),
                ],
                "running",
            ),
            b.const("one", np.array(1, np.int64)),
        ],
        "position",
    )
    count = b.one("Shape", [rows], "kept_count")
    return rows, b.one("Where", [keep, position, count], "inverse_flat")


def labelled_indices(b: RowBuilder, labels: list[tuple[str, int]]) -> tuple[str, str]:
    """Nodes computing the rows of the tokens any loss counts: (row indices [kept], inverse
    index [batch * seq]: flat position -> kept row, or the number of kept rows)."""
    keep = _or_labelled(b, "", labels)
    # a batch without a single label keeps its first token: no empty tensors (the engine's
    # kernels fail on some), and the ignored label adds nothing to the loss
    counts = b.one("Cast", [keep], "keep_count", to=onnx.TensorProto.INT64)
    none = b.one(
        "Equal",
        [
            b.one("ReduceMax", [counts], "any_label", keepdims=0),
            b.const("zero", np.array(0, np.int64)),
        ],
        "no_label",
    )
    first = b.one(
        "Equal",
        [
            b.one(
                "Range",
                [
                    b.const("zero_pos", np.array(0, np.int64)),
                    b.one("Size", [keep], "tokens"),
                    b.const("step", np.array(1, np.int64)),
                ],
                "positions",
            ),
            b.const("zero_i64", np.array(0, np.int64)),
        ],
        "is_first",
    )
    keep = b.one("Or", [keep, b.one("And", [first, none], "first_if_none")], "keep_some")
    return _kept_rows(b, keep)
