"""The lines of one generated kernel body and the values they define.

Every floating-point value lives in fp32 registers; a value whose ONNX type is fp16 or bf16 is
rounded to that type where it is produced, so a chain of half-precision ops rounds after each op
as ONNX (and the reference evaluator) does, while reductions accumulate in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

__all__ = ["FLOAT_TYPES", "KIND_ORDER", "Emitter", "Val", "triton_type"]

TP = onnx.TensorProto
FLOAT_TYPES: frozenset[int] = frozenset({TP.FLOAT, TP.FLOAT16, TP.BFLOAT16})
_TRITON_TYPES: dict[int, str] = {
    TP.FLOAT: "tl.float32",
    TP.FLOAT16: "tl.float16",
    TP.BFLOAT16: "tl.bfloat16",
    TP.INT64: "tl.int64",
    TP.INT32: "tl.int32",
    TP.INT8: "tl.int8",
    TP.UINT8: "tl.uint8",
    TP.BOOL: "tl.int1",
}
#: how a value varies inside one program: a literal, one value per row (after a reduction over
#: the trailing axes), or one value per element
KIND_ORDER = {"const": 0, "row": 1, "full": 2}


def triton_type(elem_type: int, what: str) -> str:
    try:
        return _TRITON_TYPES[elem_type]
    except KeyError:
        raise NotImplementedError(
            f"{what}: ONNX element type {onnx.helper.tensor_dtype_to_string(elem_type)} is not "
            "supported by the Triton code generator (float32, float16, bfloat16, int64, int32, "
            "int8, uint8 and bool are)"
        ) from None


@dataclass(frozen=True)
class Val:
    """One value of the subgraph inside the kernel: a Python/Triton expression (a variable name
    or a literal), its ONNX element type, its kind and its rank in the ONNX graph."""

    expr: str
    dtype: int
    kind: str
    rank: int
    #: the literal's Python value when ``kind == "const"``
    literal: float | int | bool | None = None

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_TYPES


@dataclass
class Emitter:
    """Collects kernel body lines; ``reduced`` is True in the row template."""

    reduced: bool
    lines: list[str] = field(default_factory=list)
    _count: int = 0
    #: extra runtime scalar arguments (dropout seeds) the launcher must pass, by argument name
    seeds: list[tuple[str, int | None]] = field(default_factory=list)

    def line(self, text: str) -> None:
        self.lines.append(text)

    def value(self, expr: str, dtype: int, kind: str, rank: int) -> Val:
        """Bind ``expr`` to a new variable, rounded to ``dtype`` when that is half precision."""
        self._count += 1
        name = f"v{self._count}"
        if dtype in (TP.FLOAT16, TP.BFLOAT16):
            expr = f"({expr}).to({_TRITON_TYPES[dtype]}).to(tl.float32)"
        self.lines.append(f"{name} = {expr}")
        return Val(name, dtype, kind, rank)

    def fresh(self, expr: str) -> str:
        """A temporary variable (no rounding) for sub-expressions used twice."""
        self._count += 1
        name = f"t{self._count}"
        self.lines.append(f"{name} = {expr}")
        return name

    def seed(self, fixed: int | None) -> str:
        name = f"seed{len(self.seeds)}"
        self.seeds.append((name, fixed))
        return name
