"""Complexity-balanced distributed samplers: every rank gets the same total work per epoch.

>>> from ortmodule_sampler import LoadBalancingDistributedSampler
>>> sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=len)

Importing this package imports neither onnxruntime nor triton.
"""

from ortmodule_sampler.batch_sampler import BatchFn, LoadBalancingDistributedBatchSampler
from ortmodule_sampler.batching import fixed_size_batches, max_complexity_batches
from ortmodule_sampler.load_balancing_sampler import LoadBalancingDistributedSampler

__all__ = [
    "BatchFn",
    "LoadBalancingDistributedBatchSampler",
    "LoadBalancingDistributedSampler",
    "fixed_size_batches",
    "max_complexity_batches",
]
__version__ = "0.1.0"
