"""Overflow check, norm and scaling of a list of tensors, as a few multi-tensor operations.

Each function groups its tensors by (device, dtype) and issues one ``torch._foreach_*`` call per
group instead of one kernel (and often one host sync) per tensor. Results stay on the device;
nothing here synchronizes with the host.

>>> grads = [torch.ones(3), torch.full((2,), 2.0)]
>>> bool(has_inf_or_nan(grads)), float(global_norm(grads))
(False, 3.0)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

__all__ = ["clip_by_global_norm_", "global_norm", "has_inf_or_nan", "scale_", "tensor_norms"]


def _groups(tensors: Iterable[torch.Tensor]) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Dense, non-empty tensors grouped by (device, dtype), each with its input positions.

    A sparse tensor stands for its stored values.
    """
    by_key: dict[tuple[torch.device, torch.dtype], tuple[list[int], list[torch.Tensor]]] = {}
    for i, t in enumerate(tensors):
        if t.is_sparse:
            t = t._values()
        if t.numel() == 0:
            continue
        positions, members = by_key.setdefault((t.device, t.dtype), ([], []))
        positions.append(i)
        members.append(t)
    return list(by_key.values())


def has_inf_or_nan(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """A bool scalar tensor: does any element of any tensor hold inf or NaN?

    One max-abs reduction per (device, dtype) group; max propagates NaN and exposes infinities,
    so finite inputs never produce a false positive (unlike a sum, which can overflow).
    """
    groups = _groups(tensors)
    if not groups:
        return torch.tensor(False)
    device = groups[0][1][0].device
    found = [
        torch.stack(torch._foreach_norm(g, math.inf)).isfinite().all().logical_not().to(device)
        for _, g in groups
    ]
    return found[0] if len(found) == 1 else torch.stack(found).any()


def tensor_norms(
    tensors: Sequence[torch.Tensor], norm_type: float = 2.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The ``norm_type`` norm of each tensor, stacked in input order, as a ``dtype`` vector.

    Computed in ``dtype`` or the tensor's dtype, whichever is wider, then cast to ``dtype``
    (max-abs norms in the tensor's own dtype, which is exact).
    Empty tensors count as norm 0. The result lives on the first tensor's device.
    """
    norm_type = float(norm_type)
    if len(tensors) == 0:
        return torch.zeros(0, dtype=dtype)
    device = tensors[0].device
    out = torch.zeros(len(tensors), dtype=dtype, device=device)
    for positions, g in _groups(tensors):
        if norm_type == math.inf:
            norms = torch.stack(torch._foreach_norm(g, math.inf)).to(dtype)
        else:
            wide = torch.promote_types(g[0].dtype, dtype)  # never narrow before reducing
            norms = torch.stack(torch._foreach_norm(g, norm_type, dtype=wide)).to(dtype)
        index = torch.tensor(positions, device=device)
        out.index_copy_(0, index, norms.to(device))
    return out


def global_norm(
    tensors: Sequence[torch.Tensor], norm_type: float = 2.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The ``norm_type`` norm of all tensors viewed as one vector, as a ``dtype`` scalar tensor.

    Per-tensor norms come from one ``torch._foreach_norm`` per group, computed in ``dtype`` and
    combined as ``(sum ||t||^p)^(1/p)``, as ``torch.nn.utils.clip_grad_norm_`` does.
    """
    norm_type = float(norm_type)
    norms = tensor_norms(tensors, norm_type, dtype)
    if norm_type == math.inf:
        return norms.max() if norms.numel() else norms.sum()
    return norms.pow(norm_type).sum().pow(1.0 / norm_type)


def scale_(tensors: Sequence[torch.Tensor], factor: float | torch.Tensor) -> None:
    """Multiply every tensor by ``factor`` in place (one foreach call per group)."""
    for _, g in _groups(tensors):
        if isinstance(factor, torch.Tensor):
            torch._foreach_mul_(g, factor.to(g[0].device))
        else:
            torch._foreach_mul_(g, factor)


def clip_by_global_norm_(
    tensors: Sequence[torch.Tensor], max_norm: float, norm_type: float = 2.0, eps: float = 1e-6
) -> torch.Tensor:
    """Scale ``tensors`` so their global norm is at most ``max_norm``; returns the norm before.

    Same rule as ``torch.nn.utils.clip_grad_norm_``: multiply by
    ``min(1, max_norm / (norm + eps))``, computed on the device without a host sync.
    """
    total = global_norm(tensors, norm_type)
    coef = torch.clamp(max_norm / (total + eps), max=1.0)
    scale_(tensors, coef)
    return total
