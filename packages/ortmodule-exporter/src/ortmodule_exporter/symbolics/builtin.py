"""The symbolics ORTModule needs so the engine can differentiate common operators: registration.

One module per operator family beside this one holds them; :func:`register_builtin_symbolics`
registers them all.

Each one exists because PyTorch's default export is either not differentiable by the engine
(it drops outputs the gradient needs, or emits an operator the engine has no gradient or no
CPU gradient kernel for) or computes something other than eager PyTorch. Operators whose
default export already trains correctly (gelu below opset 20, unsqueeze, argmax, numpy_T,
float32 convolution, dropout) keep PyTorch's symbolic; ``tests/test_symbolics.py`` guards them.

Every symbolic here emits only ONNX / com.microsoft operators the engine differentiates, and
keeps all input dims dynamic: sizes are read with ``Shape`` at run time, never baked in from
the traced example.
"""

from __future__ import annotations

from typing import Any

from .attention import feature_dropout, scaled_dot_product_attention
from .clamp import clamp, clamp_max, clamp_min
from .convolution import convolution, convolution_mode
from .creation import linspace, logspace, tril_indices, triu_indices
from .einsum import einsum, outer
from .embedding import embedding
from .expand import expand
from .gelu import gelu
from .losses import cross_entropy_loss, nll_loss
from .matmul import matmul
from .max_min import _amax_amin, _elementwise, _max_min
from .normalization import group_norm, layer_norm
from .pooling import _adaptive_avg_pool, _adaptive_max_pool, _avg_pool, _max_pool
from .registry import register_symbolic
from .repeat_interleave import repeat_interleave
from .shapes import squeeze
from .softmax import log_softmax, softmax
from .upsampling import _upsample

# -- registration ----------------------------------------------------------------------------


def register_builtin_symbolics() -> None:
    """Register every symbolic above (called on import of ``ortmodule_exporter``)."""
    # LayerNormalization is an ONNX operator from opset 17 (the engine also accepts it earlier,
    # but below 17 the default decomposition is differentiable as it is)
    register_symbolic("aten::layer_norm", layer_norm, 17)
    register_symbolic("aten::group_norm", group_norm, 14)
    register_symbolic("aten::gelu", gelu, 20)
    builtins: dict[str, Any] = {
        "aten::cross_entropy_loss": cross_entropy_loss,
        "aten::nll_loss": nll_loss,
        "aten::nll_loss2d": nll_loss,
        "aten::nll_loss_nd": nll_loss,
        "aten::embedding": embedding,
        "aten::softmax": softmax,
        "aten::log_softmax": log_softmax,
        "aten::max": _max_min(largest=True),
        "aten::min": _max_min(largest=False),
        "aten::clamp": clamp,
        "aten::clamp_min": clamp_min,
        "aten::clamp_max": clamp_max,
        "aten::maximum": _elementwise(largest=True),
        "aten::minimum": _elementwise(largest=False),
        "aten::amax": _amax_amin(largest=True),
        "aten::amin": _amax_amin(largest=False),
        "aten::squeeze": squeeze,
        "aten::einsum": einsum,
        "aten::matmul": matmul,
        "aten::expand": expand,
        "aten::repeat_interleave": repeat_interleave,
        "aten::outer": outer,
        "aten::scaled_dot_product_attention": scaled_dot_product_attention,
        "aten::feature_dropout": feature_dropout,
        "aten::_convolution": convolution,
        "aten::_convolution_mode": convolution_mode,
        "aten::linspace": linspace,
        "aten::logspace": logspace,
        "aten::tril_indices": tril_indices,
        "aten::triu_indices": triu_indices,
    }
    for n in (1, 2, 3):
        builtins[f"aten::max_pool{n}d"] = _max_pool(n, with_indices=False)
        builtins[f"aten::max_pool{n}d_with_indices"] = _max_pool(n, with_indices=True)
        builtins[f"aten::avg_pool{n}d"] = _avg_pool(n)
        builtins[f"aten::adaptive_avg_pool{n}d"] = _adaptive_avg_pool(n)
        builtins[f"aten::adaptive_max_pool{n}d"] = _adaptive_max_pool(n)
        builtins[f"aten::upsample_nearest{n}d"] = _upsample(n, "nearest")
        builtins[f"aten::_upsample_nearest_exact{n}d"] = _upsample(n, "nearest-exact")
    builtins["aten::upsample_linear1d"] = _upsample(1, "linear")
    builtins["aten::upsample_bilinear2d"] = _upsample(2, "linear")
    builtins["aten::upsample_trilinear3d"] = _upsample(3, "linear")
    builtins["aten::upsample_bicubic2d"] = _upsample(2, "cubic")
    for op, fn in builtins.items():
        register_symbolic(op, fn, 14)
