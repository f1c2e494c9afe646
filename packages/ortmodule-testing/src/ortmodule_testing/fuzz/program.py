"""A fuzz program as a value: inputs, parameters and a list of ops over named tensors.

A :class:`Program` renders to a standalone Python file (:meth:`Program.to_source`) holding an
``nn.Module``, the inputs of each step and a ``__main__`` that compares eager with ORTModule;
the fuzzer runs exactly that source, so a repro file is the program that failed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .ir import Op, Shape, Tensor
from .ops import render_op


@dataclass(frozen=True)
class Program:
    """A random PyTorch program; ``choices`` regenerate it (see :mod:`.generate`)."""

    inputs: tuple[Tensor, ...]
    params: tuple[Tensor, ...]
    buffers: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]  # name, shape, long values
    ops: tuple[Op, ...]
    outputs: tuple[str, ...]
    #: the value of each symbolic dim at each step
    sizes: tuple[tuple[tuple[str, int], ...], ...]
    seed: int = 0
    choices: tuple[int, ...] = field(default=(), compare=False)

    @property
    def steps(self) -> int:
        return len(self.sizes)

    def live_ops(self) -> tuple[Op, ...]:
        """The ops the outputs depend on, in order (dead ops are dropped from the source)."""
        needed = set(self.outputs)
        keep = []
        for op in reversed(self.ops):
            if op.out in needed:
                keep.append(op)
                needed.update(op.args)
        return tuple(reversed(keep))

    def concrete_shape(self, shape: Shape, step: int) -> tuple[int, ...]:
        sizes = dict(self.sizes[step])
        return tuple(d if isinstance(d, int) else sizes[d] for d in shape)

    def to_source(self, render: Callable[[Op], list[str]] | None = None) -> str:
        """A standalone Python file: ``Program`` (the module), ``make_inputs(step)``,
        ``loss_fn(outputs)``, ``STEPS`` and a ``__main__`` comparing eager with ORTModule.

        ``render`` replaces the renderer of ops (the tests use it to plant a wrong op).
        """
        render = render or render_op
        ops = self.live_ops()
        used = {a for op in ops for a in op.args} | set(self.outputs)
        lines = [
            f"# ortmodule fuzz program (seed {self.seed}); regenerate (same generator switches) with",
            f"# python -m ortmodule_testing.fuzz --seed {self.seed} --replay "
            + ",".join(map(str, self.choices)),
            "import torch",
            "import torch.nn.functional as F",
            "from torch import nn",
            "",
            "",
            "class Program(nn.Module):",
            "    def __init__(self):",
            "        super().__init__()",
            f"        g = torch.Generator().manual_seed({self.seed})",
        ]
        for p in self.params:
            if p.name not in used:
                continue
            dims = ", ".join(str(d) for d in p.shape)
            init = (
                f"1.0 + 0.1 * torch.randn(({dims}), generator=g)"
                if p.kind == "one"
                else f"0.5 * torch.randn(({dims}), generator=g)"
            )
            if not p.shape:
                init = "torch.tensor(0.7)" if p.kind == "one" else "torch.tensor(0.3)"
            lines.append(f"        self.{p.name} = nn.Parameter({init})")
        for name, shape, values in self.buffers:
            if name not in used:
                continue
            lines.append(
                f"        self.register_buffer({name!r}, "
                f"torch.tensor({list(values)}, dtype=torch.long).reshape({shape}))"
            )
        args = ", ".join(t.name for t in self.inputs)
        lines += ["", f"    def forward(self, {args}):"]
        for p in self.params:
            if p.name in used:
                lines.append(f"        {p.name} = self.{p.name}")
        for name, _, _ in self.buffers:
            if name in used:
                lines.append(f"        {name} = self.{name}")
        for op in ops:
            lines += ["        " + line for line in render(op)]
        lines.append(f"        return ({', '.join(self.outputs)},)")
        lines += ["", "", f"STEPS = {self.steps}", f"SIZES = {[dict(s) for s in self.sizes]}", ""]
        lines += [
            "",
            "def make_inputs(step):",
            f"    g = torch.Generator().manual_seed({self.seed} + 1000 * step)",
        ]
        lines.append("    s = SIZES[step]")
        for t in self.inputs:
            dims = ", ".join(str(d) if isinstance(d, int) else f"s[{d!r}]" for d in t.shape)
            grad = ".requires_grad_()" if t.kind == "grad" else ""
            lines.append(f"    {t.name} = torch.randn(({dims}), generator=g){grad}")
        lines.append(f"    return ({args},)")
        lines += _TAIL
        return "\n".join(lines) + "\n"


_TAIL = '''

def loss_fn(outputs):
    """A weighted sum, so that every element's gradient differs."""
    loss = 0.0
    for out in outputs:
        weights = torch.linspace(-1.0, 1.0, out.numel()).reshape(out.shape) + 0.5
        loss = loss + (out * weights).sum()
    return loss


def train(model, steps=STEPS):
    """Loss, outputs, parameter and input gradients of each step (SGD between steps)."""
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1) if params else None
    records = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        inputs = make_inputs(step)
        outputs = model(*inputs)
        loss = loss_fn(outputs)
        loss.backward()
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        for i, x in enumerate(inputs):
            if x.requires_grad:
                grads[f"inputs[{i}]"] = None if x.grad is None else x.grad.clone()
        records.append((loss.detach().clone(), [o.detach().clone() for o in outputs], grads))
        if optimizer is not None:
            optimizer.step()
    return records


if __name__ == "__main__":
    import os

    os.environ.setdefault("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    from ortmodule import ORTModule

    torch.manual_seed(0)
    eager = train(Program())
    ort = train(ORTModule(Program()))
    for step, ((le, oe, ge), (lo, oo, go)) in enumerate(zip(eager, ort)):
        pairs = [("loss", lo, le)] + [(f"output[{i}]", o, e) for i, (o, e) in enumerate(zip(oo, oe))]
        pairs += [(f"grad of {n}", go[n], g) for n, g in ge.items()]
        for what, got, want in pairs:
            if got is None or want is None:
                ok = got is None and want is None
                err = "None vs tensor"
            else:
                scale = max(1.0, float(want.abs().max()))
                if got.shape != want.shape:
                    ok, err = False, f"shape {tuple(got.shape)} vs {tuple(want.shape)} in eager"
                else:
                    ok = torch.allclose(got, want, rtol=1e-4, atol=1e-5 * scale, equal_nan=True)
                    err = f"max abs err {float((got - want).abs().max()):.3g}"
            print(f"step {step} {what}: {'ok' if ok else 'DIFFERS, ' + err}")
'''.splitlines()
