"""Sparsity: the training graph computes on the tokens that matter, decided on the batch that
caused the export.

``ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER`` (with the compute optimizer and
``ORTMODULE_ENABLE_SPARSE_OPTIMIZER`` on) lets the engine compute a cross-entropy loss, and the
layers feeding it, on the labelled rows only. The decision is made once per exported graph from
the batch that caused the export: below :data:`~.label_density.DENSITY_THRESHOLD` of labels
counted, the flag is inserted; later batches run the shrunken graph whatever their density,
which is exact (only the ``ignore_index`` rows are dropped, and those contribute nothing to the
loss).

``ORTMODULE_PRINT_INPUT_DENSITY=1`` logs the label density of every step, with or without the
optimization, and the density of every embedding lookup with a ``padding_idx`` (the share of
tokens that are not padding).

``ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER=1`` (with the compute optimizer and
``ORTMODULE_ENABLE_SPARSE_OPTIMIZER`` on) runs the token-wise layers of a training graph on the
tokens the attention mask keeps (padding elimination, which proves on the exporting batch that
the left-out rows are never read). Like label sparsity it is decided once per exported graph.

=======================  ========================================================================
``config``               :class:`~.config.SparsityConfig`: what the options ask for
``label_density``        the share of labels that count, and the threshold (a leaf: the kernel
                         choice reads it too)
``token_rows``           the row moves (batch, seq, ...) <-> kept tokens' rows, as ATen nodes
``density``              the loss sites, their labels on a batch, the label-density flag PythonOp
``padding``              the rewrite: token-wise nodes on the kept tokens (padding elimination)
                         or on the labelled tokens (labelled rows)
``padding_elimination``  :func:`~.padding_elimination.apply_padding_elimination`
``labelled_rows``        :func:`~.labelled_rows.apply_label_rows`
``label_sparsity``       :func:`~.label_sparsity.apply_label_sparsity`
``batch_passes``         the three as batch passes (:mod:`ortmodule_exporter.passes.batch`),
                         registered when ``ortmodule_exporter`` is imported
=======================  ========================================================================

This package's ``__init__`` imports nothing, so the kernel choice can read ``label_density``
without loading the rewrite.
"""
