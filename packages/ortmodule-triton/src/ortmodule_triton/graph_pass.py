"""The post-export pass behind ``ORTMODULE_USE_TRITON=1``.

What it does depends on the engine (``is_triton_enabled()`` of its native module):

* **CUDA engine with Triton** (GPU-only, never run here): registers the ``TritonOp`` executor
  (:mod:`ortmodule_triton.executor`) with the fusion config; the engine's ``TritonFusion``
  transformer then fuses forward and gradient subgraphs of the training graph into ``TritonOp``
  nodes that call our generated kernels.
* **CPU engine**, inside :func:`ortmodule_triton.verification_mode`: fuses the exported forward
  graph's subgraphs into PythonOps running the kernels under Triton's interpreter (for tests).
* **CPU engine**, otherwise: logs once that Triton needs the CUDA engine and changes nothing.

>>> from ortmodule_triton.graph_pass import register_triton_pass
>>> register_triton_pass()  # what the component's register() does
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ortmodule_exporter import register_post_export_pass, unregister_post_export_pass
from ortmodule_exporter.engine_binding import _C
from ortmodule_exporter.export import ExportedModel

from .attention_fusion import fuse_attention
from .debug import set_debug
from .executor import register_triton_executor
from .fusion_config import load_config
from .options import TritonOptions
from .tuning import configure_tuning
from .verification import SubgraphRunner, apply_verification_route, verification_enabled

__all__ = [
    "PASS_NAME",
    "PASS_ORDER",
    "PassReport",
    "last_report",
    "register_triton_pass",
    "triton_pass",
]

logger = logging.getLogger("ortmodule.triton")

PASS_NAME = "triton_fusion"
#: after the exporter's own passes (PythonOp checks 0-20, ATen 30-40)
PASS_ORDER = 80


@dataclass
class PassReport:
    """What the last run of the pass did (for tests and ``ortmodule doctor``)."""

    route: str = "off"
    runners: list[SubgraphRunner] = field(default_factory=list)
    #: attention patterns rewritten to flash attention
    attention: int = 0


_LAST = [PassReport()]
_WARNED: set[str] = set()


def last_report() -> PassReport:
    return _LAST[0]


def _once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message)


def _engine() -> Any:
    return _C()


def triton_pass(exported: ExportedModel, options: Mapping[str, Any]) -> None:
    opts = TritonOptions.resolve(options)
    set_debug(opts.debug)
    if not opts.use_triton:
        _LAST[0] = PassReport("off")
        return
    config = load_config(opts.config_file)
    configure_tuning(opts.enable_tuning, opts.max_tuning_duration_ms, opts.tuning_results_path)
    engine = _engine()
    cuda_engine = bool(engine.is_triton_enabled())
    attention = 0
    if opts.use_flash_attention:
        attention = _flash_attention(exported, cuda_engine)
    if cuda_engine:
        register_triton_executor(engine, config.to_json())
        _LAST[0] = PassReport("cuda-engine", attention=attention)
        return
    if verification_enabled():
        runners = apply_verification_route(exported.model, config, exported.training)
        _LAST[0] = PassReport("verification", runners, attention)
        logger.info("Triton verification route: %d fused subgraph(s) as PythonOps", len(runners))
        return
    _once(
        "cpu",
        "ORTMODULE_USE_TRITON=1: Triton kernels need the CUDA engine (onnxruntime-training, CUDA "
        "build); this engine reports is_triton_enabled() == False, so the graph is left as it is",
    )
    _LAST[0] = PassReport("cpu-engine-unchanged")


def _flash_attention(exported: ExportedModel, cuda_engine: bool) -> int:
    """Attention -> flash-attention PythonOps where they can run; returns how many."""
    if cuda_engine:
        # the kernel's tiles need Ampere's tensor cores and shared memory
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
            _once(
                "flash-cc",
                "ORTMODULE_USE_FLASH_ATTENTION=1 needs a CUDA device of compute capability 8.0 "
                "or above; attention runs unfused",
            )
            return 0
    elif not verification_enabled():
        return 0  # the CPU engine without the verification route: nothing runs Triton
    count = fuse_attention(exported.model, exported.training)
    logger.info("flash attention: %d attention pattern(s) fused", count)
    return count


def register_triton_pass() -> None:
    register_post_export_pass(PASS_NAME, triton_pass, order=PASS_ORDER)


def unregister_triton_pass() -> None:
    unregister_post_export_pass(PASS_NAME)
