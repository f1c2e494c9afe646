"""What one export produces: :class:`ExportedModel` (the ONNX graph and how to feed it and read it
back), the graph inputs passes add (:class:`ExtraInput`) and where the graphs of one export are
saved for debugging (:class:`SaveOptions`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import onnx
import torch

from ortmodule_pytree import Schema

from .config import ExportConfig
from .guards import Guard
from .shape_guards import ShapeGuard

#: the graphs saved for one export, in the order they are made: the file name says which is which
SAVED_STAGES = {
    "exported": "1_exported",  # what torch.onnx wrote, before the engine saw it
    # after the engine's graph optimisations, before gradients (training graphs only)
    "pre_gradient": "2_pre_gradient",
    "gradient": "3_gradient",  # the forward and backward graph the engine built (training)
    "built": "3_built",  # the inference graph the engine built (eval, no_grad)
    "execution": "4_execution",  # after the session's own optimisations: what the engine runs
}


@dataclass(frozen=True)
class SaveOptions:
    """Where to write the models of one export for debugging (see ``file_name``).

    Every graph ORTModule builds gets its own ``version`` (1, 2, ... per prefix and mode, the
    next number free in the folder), so a re-export never overwrites the files of an earlier one.

    >>> SaveOptions("/tmp", "mlp").file_name("exported", training=True)
    'mlp_training_v1_1_exported.onnx'
    """

    path: str
    prefix: str = ""
    version: int = 1

    def file_name(self, stage: str, training: bool) -> str:
        if stage not in SAVED_STAGES:
            raise ValueError(f"unknown saved-graph stage {stage!r}; one of {sorted(SAVED_STAGES)}")
        mode = "training" if training else "inference"
        prefix = f"{self.prefix}_" if self.prefix else ""
        return f"{prefix}{mode}_v{self.version}_{SAVED_STAGES[stage]}.onnx"

    def file_path(self, stage: str, training: bool) -> str:
        return os.path.join(self.path, self.file_name(stage, training))

    def next_version(self, training: bool) -> SaveOptions:
        """These options for a new graph: the first version with no file in the folder yet."""
        mode = "training" if training else "inference"
        prefix = f"{self.prefix}_" if self.prefix else ""
        pattern = re.compile(rf"{re.escape(prefix)}{mode}_v(\d+)_")
        try:
            names = os.listdir(self.path)
        except OSError:
            names = []
        taken = [int(m.group(1)) for n in names if (m := pattern.match(n))]
        return dataclasses.replace(self, version=max(taken, default=0) + 1)


#: output names of the new values of inputs and buffers the forward writes in place
INPUT_WRITE_PREFIX = "input_write."
BUFFER_WRITE_PREFIX = "buffer_write."


@dataclass(frozen=True)
class ExtraInput:
    """A graph input a post-export pass added that is neither a user tensor nor a parameter.

    The runtime feeds ``zeros(shape, dtype)`` on the module's device at every step and, with
    ``requires_grad``, asks the engine for its gradient (memory-efficient gradient management
    uses one as the trigger whose backward hands each parameter its gradient).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    requires_grad: bool = False

    def make(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=device).requires_grad_(
            self.requires_grad
        )


@dataclass
class ExportedModel:
    """One exported graph and what is needed to feed it and read it back."""

    model: onnx.ModelProto
    input_schema: Schema
    output_schema: Schema
    #: graph inputs that are user tensors, in graph order (unused inputs are dropped by export)
    user_input_names: tuple[str, ...]
    #: graph inputs that are parameters or buffers of the module, in graph order
    param_names: tuple[str, ...]
    training: bool
    opset: int
    #: extra graph outputs holding a buffer's new value: output name -> buffer name
    buffer_updates: dict[str, str] = field(default_factory=dict)
    #: running-variance outputs to rescale to PyTorch's unbiased update:
    #: output name -> (element-count output name, weight of the old value)
    variance_updates: dict[str, tuple[str, float]] = field(default_factory=dict)
    export_seconds: float = 0.0
    from_cache: bool = False
    #: the export-cache entry that holds this graph ("" where none does): the runtime puts
    #: the kernel-choice decisions its gradient build made into it (``store_decisions``)
    cache_key: str = ""
    #: outputs computed from no input at all (index into ``output_schema``) -> traced value;
    #: they are not graph outputs (the engine folds them into initializers, and its gradient
    #: builder refuses an output no node produces), the runtime hands back the traced value
    constant_outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    #: the settings it was exported with (post-export passes read theirs from here)
    config: ExportConfig = field(default_factory=ExportConfig)
    #: graph inputs added by post-export passes: name -> what the runtime feeds
    extra_inputs: dict[str, ExtraInput] = field(default_factory=dict)
    #: extra graph outputs holding the new value of an input the forward wrote in place:
    #: output name -> input name (the runtime copies it into the user's tensor)
    input_writes: dict[str, str] = field(default_factory=dict)
    #: tensor -> Python conversions the trace baked in: (output name, guard), checked each run
    guards: tuple[tuple[str, Guard], ...] = ()
    #: conversions of sizes: checked from the fed inputs' shapes before the graph runs
    shape_guards: tuple[ShapeGuard, ...] = ()

    @property
    def user_output_names(self) -> tuple[str, ...]:
        """The graph's user outputs, in order: the output schema's names minus constants."""
        names = self.output_schema.names
        if not self.constant_outputs:
            return tuple(names)
        return tuple(n for i, n in enumerate(names) if i not in self.constant_outputs)

    @property
    def outputs_without_grad(self) -> frozenset[int]:
        """Graph outputs (index into :attr:`user_output_names`) that did not require grad in the
        traced forward: eager PyTorch hands them back without a gradient (``linalg.lu``'s
        permutation, ``native_layer_norm``'s mean and rstd, a ``detach()``-ed tensor), though
        the engine may still see a path to a trainable input through the node computing them."""
        specs = self.output_schema.tensor_specs
        kept = [i for i in range(len(specs)) if i not in self.constant_outputs]
        return frozenset(j for j, i in enumerate(kept) if not specs[i].requires_grad)

    def restore_outputs(self, graph_outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The user outputs in schema order: ``graph_outputs`` with the constants put back."""
        if not self.constant_outputs:
            return list(graph_outputs)
        produced = iter(graph_outputs)
        return [
            self.constant_outputs[i] if i in self.constant_outputs else next(produced)
            for i in range(len(self.output_schema.names))
        ]
