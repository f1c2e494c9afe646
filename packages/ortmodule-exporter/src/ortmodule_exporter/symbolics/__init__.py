"""Symbolics: how ATen operators become ONNX nodes during ORTModule's export.

``registry`` holds them (:func:`~ortmodule_exporter.symbolics.registry.register_symbolic`,
installed into ``torch.onnx`` only while ORTModule exports); ``builtin`` registers ours, one
module per operator family (``normalization``, ``losses``, ``embedding``, ``softmax``, ``gelu``,
``max_min``, ``clamp``, ``shapes``, ``einsum``, ``attention``, ``convolution``, ``pooling``,
``upsampling``, ``repeat_interleave``; ``helpers`` holds what they share) and ``mask`` the
attention-mask symbolics. This package's ``__init__`` imports nothing, so importing the registry registers nothing.

>>> from ortmodule_exporter.symbolics.registry import registered_symbolics
>>> "aten::layer_norm" in registered_symbolics()
True
"""
