"""The trace's real forward keeps no activations for a backward that never runs.

The TorchScript trace runs the module's forward once on real tensors with autograd on: the
export reads each traced value's ``requires_grad`` (where the gradient is cut, which outputs
are differentiable). Autograd then keeps every tensor a backward would read, though nothing
runs the trace's backward. At GPT-2 small's size (batch 4 x 256) that is about 1 GiB held to
the end of the forward, and the forward's first run faults in every page of it: 2.1-2.3 s
against 2.3-3.1 s for the same first forward keeping them.

:class:`ActivationsDropped` packs each saved tensor into nothing. A forward that reads a
saved tensor itself (``torch.autograd.grad`` inside the forward) fails on the first read;
the record says so, and the export traces again keeping them, as before. It does so too when
the forward caught that failure and went on: the path it then traced is not eager's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class SavedTensorDropped(RuntimeError):
    """A forward read a tensor autograd saved while the trace was dropping them."""


class ActivationsDropped:
    """Saved tensors hooks that keep nothing; :attr:`read` turns True when one was read."""

    def __init__(self) -> None:
        self.read = False

    @contextmanager
    def applied(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    @staticmethod
    def _pack(tensor: torch.Tensor) -> None:
        return None

    def _unpack(self, packed: Any) -> torch.Tensor:
        self.read = True
        raise SavedTensorDropped(
            "the forward read a tensor autograd saved for a backward (torch.autograd.grad "
            "inside the forward); the export traces it again keeping them"
        )
