"""PyTorch's CPU flash attention on (batch, tokens, heads, head dim) tensors, without Transposes.

A model splits its heads with ``view(batch, seq, heads, dim).transpose(1, 2)`` and merges them
with ``transpose(1, 2).reshape(...)``. In eager those transposes are free views and the attention
kernel reads the strided tensors; exported, each is a ``Transpose`` node that copies (32 per GPT
training step), and the kernel then gets contiguous (batch, heads, tokens, dim) tensors, on which
PyTorch's CPU flash attention backward is slower: 2.2 ms against 1.3 ms at batch 16, 4 heads,
64 tokens, head dim 32, one thread (6.8 against 5.8 ms at the GPT benchmark's size).

``passes/attention_layout.py`` therefore hands the untransposed tensors straight to
:data:`FLASH_BSHD`, which transposes them back as views, as eager does. Its overload names which
of query, key, value and output (``q``, ``k``, ``v``, ``o``) are in the token-major layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import parallel
from .executor import AtenFunction, register_aten_function
from .gradients import GradientNode, register_aten_gradient, register_stop_gradient_edges
from .output_shapes import Shape, register_output_shapes

__all__ = ["FLASH", "FLASH_BSHD", "FLASH_BSHD_BACKWARD", "LAYOUT_FLAGS"]

FLASH = "_scaled_dot_product_flash_attention_for_cpu"
FLASH_BSHD = "_ortmodule_flash_attention_bshd"
FLASH_BSHD_BACKWARD = "_ortmodule_flash_attention_bshd_backward"
#: one letter per tensor given in (batch, tokens, heads, dim): query, key, value, output
LAYOUT_FLAGS = "qkvo"


def _t(tensor: torch.Tensor, flag: str, flags: str) -> torch.Tensor:
    return tensor.transpose(1, 2) if flag in flags else tensor


def _settings(
    dropout: torch.Tensor | None, causal: torch.Tensor | None, scale: torch.Tensor | None
) -> tuple[float, bool, float | None]:
    assert dropout is not None and causal is not None
    return (
        float(dropout.item()),
        bool(causal.item()),
        None if scale is None else float(scale.item()),
    )


def _work(q: torch.Tensor, k: torch.Tensor, flags: str) -> int:
    keys = k.shape[1] if "k" in flags else k.shape[2]
    return q.numel() * keys


def _forward(flags: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    q, k, v, dropout, causal, mask, scale = inputs
    assert q is not None and k is not None and v is not None
    dropout_p, is_causal, scale_value = _settings(dropout, causal, scale)

    # transposed back inside each piece, so the pieces' outputs concatenate token-major
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: Any, **named: Any) -> Any:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _t(q, "q", flags), _t(k, "k", flags), _t(v, "v", flags), *rest, **named
        )
        return _t(out, "o", flags), lse

    out, lse = parallel.in_rows(
        run,
        [q, k, v, dropout_p, is_causal],
        {"attn_mask": mask, "scale": scale_value},
        rows=(0, 1, 2),
        work=_work(q, k, flags),
        mask="attn_mask",
        unless=3,
    )
    return [out, lse]


def _backward(flags: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    grad, q, k, v, out, lse, dropout, causal, mask, scale = inputs
    assert grad is not None and q is not None and k is not None and v is not None
    assert out is not None and lse is not None
    dropout_p, is_causal, scale_value = _settings(dropout, causal, scale)

    def run(
        grad: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        *rest: Any,
        **named: Any,
    ) -> Any:
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _t(grad, "o", flags),
            _t(q, "q", flags),
            _t(k, "k", flags),
            _t(v, "v", flags),
            _t(out, "o", flags),
            *rest,
            **named,
        )
        return tuple(_t(g, flag, flags) for g, flag in zip(grads, "qkv", strict=True))

    grads = parallel.in_rows(
        run,
        [grad, q, k, v, out, lse, dropout_p, is_causal],
        {"attn_mask": mask, "scale": scale_value},
        rows=(0, 1, 2, 3, 4, 5),
        work=_work(q, k, flags),
        mask="attn_mask",
        unless=6,
    )
    return list(grads)


def _all_tensors(_overload: str, _index: int, _is_input: bool) -> bool:
    return True


def _register() -> None:
    register_aten_function(FLASH_BSHD, AtenFunction(_forward, _all_tensors))
    register_aten_function(FLASH_BSHD_BACKWARD, AtenFunction(_backward, _all_tensors))
    # every non-empty subset of the flags, in LAYOUT_FLAGS order
    for bits in range(1, 1 << len(LAYOUT_FLAGS)):
        flags = "".join(c for i, c in enumerate(LAYOUT_FLAGS) if bits >> i & 1)
        register_aten_gradient(
            FLASH_BSHD,
            flags,
            [
                GradientNode.aten(
                    FLASH_BSHD_BACKWARD,
                    [
                        "GO(0)",
                        "I(0)",
                        "I(1)",
                        "I(2)",
                        "O(0)",
                        "O(1)",
                        "I(3)",
                        "I(4)",
                        "I(5)",
                        "I(6)",
                    ],
                    ["GI(0)", "GI(1)", "GI(2)"],
                    overload=flags,
                )
            ],
        )
        register_stop_gradient_edges(FLASH_BSHD, flags, [3, 4, 5, 6])
    register_output_shapes(FLASH_BSHD, _forward_shapes)
    # PyTorch's own kernel: every tensor in (batch, heads, tokens, dim)
    register_output_shapes(FLASH, lambda shapes, _overload: _forward_shapes(shapes, ""))


def _forward_shapes(shapes: Sequence[Shape | None], flags: str) -> list[Shape | None]:
    """The output: the query's (batch, tokens, heads) in its layout (``o``: token-major) with
    the value's dim; the log-sum-exp: (batch, heads, tokens)."""
    query, value = shapes[0], shapes[2]
    if query is None or len(query) != 4:
        return [None, None]
    batch, heads, tokens = (query[0], query[2], query[1]) if "q" in flags else query[:3]
    if value is None or len(value) != 4:
        return [None, [batch, heads, tokens]]
    out = [batch, tokens, heads, value[3]] if "o" in flags else [batch, heads, tokens, value[3]]
    return [out, [batch, heads, tokens]]


_register()
