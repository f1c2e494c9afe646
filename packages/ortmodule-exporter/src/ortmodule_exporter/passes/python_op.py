"""The PythonOp post-export passes: refuse Functions this process did not export (order 0), then
give PythonOp outputs the dims their shape functions compute (order 20).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..python_op.checks import check_model
from ..python_op.shape_inference import infer_python_op_shapes
from .registry import register_post_export_pass


def _check_pass(exported: Any, _options: Mapping[str, Any]) -> None:
    check_model(exported.model)


def _shape_pass(exported: Any, _options: Mapping[str, Any]) -> None:
    infer_python_op_shapes(exported.model)


register_post_export_pass("python_op_check", _check_pass, order=0)
register_post_export_pass("python_op_shapes", _shape_pass, order=20)
