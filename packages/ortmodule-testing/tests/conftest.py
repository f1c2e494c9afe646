"""Shared settings for the zoo's own tests."""

from __future__ import annotations

import torch

# The models are tiny and CI machines are small and shared: one intra-op thread is faster than
# several threads spinning against each other, and it costs less CPU.
torch.set_num_threads(1)
