"""Per-operator kernel choice: the engine's kernel or PyTorch's, whichever measured faster here.

Some engine CPU kernels are several times slower than PyTorch's (GELU's backward, ``GeluGrad``,
was 3.4x in the GPT profile; ``ReluGrad`` is 20x PyTorch's ``threshold_backward`` on a CNN's
activations). For such an operator the exporter can instead write an ATen node that PyTorch
runs inside the engine, forward and backward; that node pays a fixed cost for crossing the
engine boundary (about 45 us per node, ``benchmarks/bench_python_op.py``). Which route wins
depends on the machine and the tensor size, so it is decided by measurement: the first export
that meets the operator times both routes on this machine (a few milliseconds) and keeps the
answer for the process, per (operator, dtype, size class).

The covered operators are a small table (:func:`register_kernel_choice`): GELU, ReLU,
convolution (``aten::_convolution``, not transposed), 2-d max pooling, LayerNorm (input,
weight and bias all trained) and cross-entropy on class indices (mean or sum, no class weights
or smoothing, and labels dense enough that label sparsity leaves the loss whole, judged on the
traced batch as that pass judges it); embedding lookups (``padding_idx`` and
``scale_grad_by_freq`` included) are covered from the exporter's own ``embedding`` symbolic
(:func:`embedding_route`). Each entry is a
symbolic that replaces the exporter's own while the mode is ``auto`` or ``torch``, and falls
back to it whenever the engine's kernel is chosen.

ReLU is decided in two halves (its backward first): the engine's ``Relu`` is as fast as
PyTorch's, its ``ReluGrad`` is not, so the forward can stay on the engine while the backward
runs on PyTorch (:data:`ENGINE_FORWARD`, ``passes/engine_forwards.py``).

Size classes: ReLU and pooling and convolution use the sizes the operator had when the export
traced the module (:func:`recording_traced_sizes`; the exported graph's own dims are dynamic);
convolution and pooling also key on their weight shape and settings. GELU keeps the class it
always had, the one measured at :data:`CALIBRATION_NUMEL` elements unless the export knows the
size. An operator whose traced sizes are unknown is measured at :data:`CALIBRATION_NUMEL`
(ReLU) or keeps the engine's kernel (convolution, pooling: their cost depends on the spatial
shape).

The PyTorch side is timed at the thread count PyTorch has while the engine runs a graph with
PyTorch-run nodes (``ORTMODULE_TORCH_THREADS_IN_ENGINE``, passed in by
:func:`configure_kernel_choice`), the engine side at PyTorch's current count (the count the
engine's sessions get).

``mode`` (``ORTMODULE_KERNEL_CHOICE``): ``auto`` measures, ``engine`` keeps every operator on
the engine's kernels, ``torch`` routes every covered operator to PyTorch. The measurements
time CPU kernels, so ``auto`` keeps the engine's kernels in an export that traced tensors on
another device (CUDA).

The mechanism, then one module per operator family (each registers its ATen functions, their
gradients and its covered symbolic, and holds its measurement); this ``__init__`` imports them
all, the families in the order they register, and keeps every name importable from here.

=====================  ==========================================================================
``modes``              the mode and the in-engine PyTorch thread count (:func:`current_mode`)
``choice``             the decisions per (operator, dtype, size class): :func:`choose`,
                       :func:`decisions`, :func:`calibration_seconds`
``stored_decisions``   :func:`machine_key`, and the decisions as JSON for the export cache
``registry``           :class:`CoveredOperator`, :func:`register_kernel_choice`,
                       :func:`configure_kernel_choice` (installs the covered symbolics)
``traced``             :func:`recording_traced_sizes`: the sizes each operator was traced with
``fx_nodes``           the torch_export frontend's side: :func:`register_fx_kernel_choice`,
                       :func:`fx_kernel_choice` (a family's decision for one FX node)
``measuring``          timing a few engine nodes against PyTorch's kernels (``_engine_us``,
                       ``_torch_us``)
``helpers``            what the families' ATen functions and symbolics share
``row_sum``            bias gradients (a built-graph pass's ``ReduceSum``): :func:`row_sum_route`
``matmul``             matrix products by a 2-d operand (a built-graph pass's ``Gemm``,
                       ``MatMul``, ``FusedMatMul``): :func:`matmul_route`
``gelu``, ``relu``,    the operator families
``layer_norm``,
``cross_entropy``,
``loss_head``,
``convolution``,
``embedding``,
``max_pool``
=====================  ==========================================================================

Patch a name in the module that reads it (``kernel_choice.gelu.measure_gelu``,
``kernel_choice.choice._DECISIONS``): the names here are the same objects, but rebinding one
here changes nothing inside the submodules.

>>> from ortmodule_exporter.aten.kernel_choice import configure_kernel_choice, decisions
>>> configure_kernel_choice("auto", torch_threads=1)
"""

from __future__ import annotations

from .choice import CALIBRATION_NUMEL, calibration_seconds, choose, decisions
from .fx_nodes import (
    AtenChoice,
    fx_covered_operators,
    fx_example_inputs,
    fx_kernel_choice,
    register_fx_kernel_choice,
)
from .measuring import ATEN_NODE_US
from .modes import LOSSES, MODES, current_mode, current_torch_threads, measures
from .registry import (
    CoveredOperator,
    configure_kernel_choice,
    covered_operators,
    register_kernel_choice,
)
from .stored_decisions import (
    decisions_from_json,
    decisions_to_json,
    machine_fingerprint,
    machine_key,
)
from .traced import recording_traced_sizes

# isort: off
# The families register their ATen functions, gradients and covered symbolics as they are
# imported: this order is the order of covered_operators() and of the symbolics that
# configure_kernel_choice installs.
from .row_sum import ROW_SUM, measure_row_sum, row_sum_route
from .row_sum import _row_sum as _row_sum
from .matmul import (
    CALIBRATION_ROWS,
    MATMUL,
    matmul_overload,
    matmul_route,
    measure_matmul,
    parse_matmul_overload,
)
from .matmul import _matmul as _matmul
from .gelu import (
    ENGINE_GELU_GRADS,
    GELU,
    GELU_BACKWARD,
    gelu_backward_route,
    measure_gelu,
    measure_gelu_backward,
)
from .gelu import _gelu as _gelu, _gelu_backward as _gelu_backward
from .relu import (
    ENGINE_FORWARD,
    ENGINE_FORWARDS,
    RELU,
    RELU_BACKWARD,
    measure_relu,
    measure_relu_backward,
)
from .layer_norm import LAYER_NORM, LAYER_NORM_BACKWARD, measure_layer_norm
from .cross_entropy import (
    ADDS_OUTPUT_GRAD,
    CROSS_ENTROPY,
    CROSS_ENTROPY_BACKWARD,
    aten_cross_entropy,
    cross_entropy_backward_overload,
    cross_entropy_route,
    measure_cross_entropy,
)
from .loss_head import (
    LOSS_HEAD_BACKWARD,
    adds_output_grad,
    loss_head_overload,
    parse_loss_head_overload,
)
from .convolution import CONV, CONV_BACKWARD, measure_conv
from .embedding import (
    EMBEDDING_GRAD_ADD,
    embedding_grad_add_overload,
    embedding_route,
    measure_embedding,
)
from .max_pool import (
    CHANNELS_LAST,
    MAX_POOL2D,
    MAX_POOL2D_BACKWARD,
    measure_max_pool2d,
    pool_layout,
)
from .max_pool import _max_pool2d as _max_pool2d
# isort: on

__all__ = [
    "ADDS_OUTPUT_GRAD",
    "ATEN_NODE_US",
    "CALIBRATION_NUMEL",
    "CALIBRATION_ROWS",
    "CHANNELS_LAST",
    "CONV",
    "CONV_BACKWARD",
    "CROSS_ENTROPY",
    "CROSS_ENTROPY_BACKWARD",
    "EMBEDDING_GRAD_ADD",
    "ENGINE_FORWARD",
    "ENGINE_FORWARDS",
    "GELU",
    "GELU_BACKWARD",
    "LAYER_NORM",
    "LOSS_HEAD_BACKWARD",
    "MATMUL",
    "LAYER_NORM_BACKWARD",
    "MAX_POOL2D",
    "MAX_POOL2D_BACKWARD",
    "MODES",
    "RELU",
    "RELU_BACKWARD",
    "ROW_SUM",
    "AtenChoice",
    "CoveredOperator",
    "adds_output_grad",
    "aten_cross_entropy",
    "calibration_seconds",
    "choose",
    "configure_kernel_choice",
    "covered_operators",
    "cross_entropy_backward_overload",
    "cross_entropy_route",
    "current_mode",
    "measures",
    "LOSSES",
    "current_torch_threads",
    "decisions",
    "decisions_from_json",
    "decisions_to_json",
    "embedding_grad_add_overload",
    "embedding_route",
    "fx_covered_operators",
    "fx_example_inputs",
    "fx_kernel_choice",
    "loss_head_overload",
    "machine_fingerprint",
    "machine_key",
    "measure_conv",
    "measure_cross_entropy",
    "parse_loss_head_overload",
    "measure_embedding",
    "measure_gelu",
    "measure_gelu_backward",
    "gelu_backward_route",
    "ENGINE_GELU_GRADS",
    "measure_layer_norm",
    "matmul_overload",
    "parse_matmul_overload",
    "matmul_route",
    "measure_matmul",
    "measure_max_pool2d",
    "measure_relu",
    "measure_relu_backward",
    "measure_row_sum",
    "pool_layout",
    "recording_traced_sizes",
    "register_fx_kernel_choice",
    "register_kernel_choice",
    "row_sum_route",
]
