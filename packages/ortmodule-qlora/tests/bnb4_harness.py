"""Engine-level harness for the QLoRA export: a 4-bit layer behind a trainable one, run through
the engine's TrainingAgent (no ORTModule runtime) and compared with PyTorch eager."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import bitsandbytes as bnb
import onnx
import torch

from ortmodule_exporter import export, run_post_export_passes
from ortmodule_exporter.engine import GraphConfig, SessionConfig, TrainingSession, build_graph


class FourBitBlock(torch.nn.Module):
    """A trainable Linear feeding a frozen 4-bit one, so the 4-bit input needs a gradient."""

    def __init__(
        self,
        k: int,
        n: int,
        quant_type: str,
        *,
        bias: bool = True,
        nested: bool = False,
        block: int = 64,
    ) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(k, k)
        dense = torch.nn.Linear(k, n, bias=bias)
        self.q = bnb.nn.Linear4bit(
            k, n, bias=bias, quant_type=quant_type, compress_statistics=nested
        )
        self.q.weight = bnb.nn.Params4bit(
            dense.weight.data.clone(),
            requires_grad=False,
            quant_type=quant_type,
            compress_statistics=nested,
            blocksize=block,
        )
        if bias:
            self.q.bias = torch.nn.Parameter(dense.bias.data.clone(), requires_grad=False)
        self.q = self.q.to("cpu")  # quantizes the weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(self.pre(x))


@dataclass
class Run:
    model: onnx.ModelProto
    built: onnx.ModelProto
    out: torch.Tensor
    grads: dict[str, torch.Tensor]


def run_engine(
    module: torch.nn.Module, x: torch.Tensor, grad_out: torch.Tensor, *, input_grad: bool = True
) -> Run:
    """Forward and backward through the engine; ``input_grad=False`` feeds ``x`` as a plain
    tensor, so a first 4-bit layer makes bitsandbytes call ``gemm_4bit``, not ``MatMul4Bit``."""
    x = x.detach().requires_grad_(input_grad)
    exported = export(module, (x,), training=True)
    run_post_export_passes(exported)
    params = dict(module.named_parameters())
    train = tuple(n for n in exported.param_names if params[n].requires_grad)
    (x_name,) = exported.user_input_names
    built = build_graph(
        exported,
        GraphConfig(
            build_gradient=True,
            params_to_train=train,
            inputs_require_grad=(x_name,) if input_grad else (),
        ),
    )
    session = TrainingSession(built, SessionConfig())
    feeds = [x if n == x_name else params[n] for n in built.feed_names]
    outputs, state = session.forward(feeds)
    grads = session.backward([grad_out], state)
    by_name = {
        built.grad_of[f]: grads[j] for j, f in enumerate(built.fetch_names) if f in built.grad_of
    }
    return Run(exported.model, built.model, outputs[0], by_name)


def eager(
    module: torch.nn.Module, x: torch.Tensor, grad_out: torch.Tensor, *, input_grad: bool = True
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    module = copy.deepcopy(module)
    x = x.detach().clone().requires_grad_(input_grad)
    out = module(x)
    out.backward(grad_out)
    grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    if input_grad:
        assert x.grad is not None
        grads["input.x"] = x.grad
    return out.detach(), grads
