"""PyTorch operators run inside the engine as ``org.pytorch.aten::ATen`` nodes.

====================  ===========================================================================
``executor``          runs an ATen node with ``torch.ops.aten`` (a ``ctypes`` callback)
``gradients``         gradients of ATen nodes (``register_aten_gradient``, or a generic
                      vector-Jacobian product)
``engine_gradients``  which ONNX operators the engine can differentiate (asked once per type)
``routes``            the switches and symbolic layer that send operators to ATen (embedding,
                      dropout, einsum, attention, the default routes, ``register_aten_route``)
``untrainable``       operators whose ONNX form the engine cannot train, routed to ATen while
                      the export runs (``register_untrainable_check``)
``symbolic_helpers``  reading traced values and writing ATen nodes, for the symbolics
``aten_op``           :class:`~ortmodule_exporter.aten.aten_op.AtenOp`: an operator without a
                      gradient definition, run as a PythonOp
``kernel_choice``     per operator and size, the engine's kernel or PyTorch's, by timing both
                      (a package: the mechanism, then one module per operator family)
``parallel``          PyTorch-run attention and GELU nodes in pieces across the engine's threads
``output_pool``       reused buffers for PyTorch-run nodes' large outputs (no page faults per step)
``attention_layout``  CPU flash attention on token-major tensors (no Transposes around it)
``token_rows``        moved to :mod:`ortmodule_exporter.sparsity` (the name stays for imports)
``overloads``         which overload a routed operator calls, from its traced inputs
``empty_tensors``     operators on zero-element tensors run in PyTorch (an untrainable check)
``gradient_gaps``     ONNX nodes whose engine gradient fails for some inputs (an untrainable check)
``uneven_split``      ``split`` with an uneven last chunk (an untrainable check)
``low_precision``     bfloat16/float16 operators the CPU engine has no kernel for (an untrainable
                      check)
====================  ===========================================================================

The post-export passes over ATen nodes are in :mod:`ortmodule_exporter.passes.aten_nodes` and
:mod:`ortmodule_exporter.passes.attention_fusion`. This package's ``__init__`` imports nothing,
so the symbolics can use the executor without loading the routes.

>>> from ortmodule_exporter.aten.routes import register_aten_route
>>> register_aten_route("aten::special_i0e")
"""
