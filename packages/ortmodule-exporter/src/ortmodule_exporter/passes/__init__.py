"""Graph passes: edits of the exported ONNX model before the engine builds its gradient graph
(post-export passes, then batch passes, which read the exporting batch), and of the graph the
engine built (built-graph passes).

======================  =========================================================================
``registry``            :func:`register_post_export_pass`, :func:`run_post_export_passes`
``batchnorm``           BatchNorm running statistics as graph outputs (order 10); an eval-mode
                        BatchNormalization in a training graph as elementwise ops (11)
``python_op``           refuse Functions this process did not export (0); PythonOp dims (20)
``attention_fusion``    ``ORTMODULE_USE_EFFICIENT_ATTENTION``: attention into one ATen node (30)
``attention_layout``    fused CPU attention reads its inputs without the heads' Transposes (35)
``saturating_tails``    every Sigmoid but silu's, every Tanh but the tanh GELU's on PyTorch's
                        kernels: the engine's lose their tails (38)
``aten_nodes``          make ATen nodes runnable and trainable (40)
``output_ranks``        scalar outputs keep rank 0 (45)
``engine_graph_fixes``  no-op Casts removed; an input read twice goes through an Identity; a
                        concatenated SequenceConstruct becomes Concat (45)
``density``             moved to :mod:`ortmodule_exporter.sparsity` (the name stays for imports)
``batch``               :func:`~ortmodule_exporter.passes.batch.register_batch_pass`: passes that
                        read the batch that caused the export (the sparsity decisions,
                        :mod:`ortmodule_exporter.sparsity.batch_passes`)
``built_graph``         :func:`~ortmodule_exporter.passes.built_graph.register_built_graph_pass`
``scalar_gradients``    built-graph pass: gradients of 0-d tensors keep rank 0 (10)
``nan_gradients``       built-graph pass: masking multiplications and ``ReluGrad`` select like
                        eager's backward, so NaN and Inf reach the same gradient elements (20)
``engine_forwards``     built-graph pass: a forward exported as an ATen node only for its
                        PyTorch backward (ReLU) goes back on the engine's kernel (55)
``grouped_conv_grad``   built-graph pass: a grouped 1-D ConvGrad runs as the 2-D one, a 3-D
                        one on PyTorch (the engine's CPU kernel clears memory past ``dX``) (58)
``row_sums``            built-graph pass: bias gradients on PyTorch's ``sum`` where the kernel
                        choice measured it faster (60)
``gelu_grads``          built-graph pass: the engine's ``FastGeluGrad``/``GeluGrad`` on PyTorch's
                        ``gelu_backward`` where the kernel choice measured it faster (61)
``matmul_routes``       built-graph pass: matrix products by a 2-d operand on PyTorch's ``mm``
                        where the kernel choice measured it faster (62)
``embedding_grad_sums`` built-graph pass: a lookup table's gradient and its other gradients (a
                        tied head's) summed in one pass over the table (64)
``output_grad_sums``    built-graph pass: the logits' outside gradient added inside PyTorch's
                        loss gradient instead of by a logits-sized ``Add`` (66)
``low_precision_sums``  built-graph pass: the engine's own bfloat16/float16 gradient sums on CPU
                        computed in float32 and rounded once, as PyTorch's kernels do (70)
======================  =========================================================================

Importing this package registers the built-in post-export and built-graph passes.

>>> from ortmodule_exporter.passes import run_post_export_passes
"""

from . import (  # noqa: F401 - register
    aten_nodes,
    attention_fusion,
    attention_layout,
    batchnorm,
    embedding_grad_sums,
    engine_forwards,
    engine_graph_fixes,
    gelu_grads,
    grouped_conv_grad,
    loss_head_grads,
    low_precision_sums,
    matmul_routes,
    nan_gradients,
    output_grad_sums,
    output_ranks,
    product_outputs,
    python_op,
    row_sums,
    saturating_tails,
    scalar_gradients,
)
from .registry import register_post_export_pass, run_post_export_passes, unregister_post_export_pass

__all__ = ["register_post_export_pass", "run_post_export_passes", "unregister_post_export_pass"]
