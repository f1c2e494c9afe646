"""The demo's settings: :class:`DemoConfig`, the ``ortmodule demo`` options, the runs it makes."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

MODES = ("eager", "ortmodule", "recompute")
TITLES = {
    "eager": "PyTorch eager",
    "ortmodule": "ORTModule",
    # ortmodule-memory's layer-wise recompute: less activation memory for some extra compute
    "recompute": "ORTModule + recompute",
}
#: the largest per-step loss difference the demo accepts as "the same training run"
LOSS_TOLERANCE = 1e-3
PROMPT = "The lamp"


@dataclass(frozen=True)
class DemoConfig:
    """Everything one run needs; the parent hands it to each child process as JSON."""

    steps: int = 150
    batch_size: int = 16
    seq_len: int = 64
    layers: int = 2
    d_model: int = 128
    heads: int = 4
    lr: float = 5e-3
    seed: int = 0
    device: str = "cpu"
    save_onnx: bool = False
    out: str = "ortmodule-demo-out"
    generate: int = 200
    #: intra-op threads for PyTorch and the engine; 0 keeps PyTorch's default (one per core)
    threads: int = 0

    def check(self) -> None:
        """Raise ``ValueError`` naming the option and what to pass instead."""
        for name in ("steps", "batch_size", "seq_len", "layers", "d_model", "heads"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}"
                )
        if self.threads < 0:
            raise ValueError(f"--threads must be 0 (PyTorch's default) or more, got {self.threads}")
        if self.generate < 0:
            raise ValueError(f"--generate must be 0 or more, got {self.generate}")
        if self.d_model % self.heads:
            raise ValueError(
                f"--d-model ({self.d_model}) must be divisible by --heads ({self.heads}); "
                f"try --d-model {self.heads * max(1, round(self.d_model / self.heads))}"
            )
        if self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda[:N], got {self.device!r}")


#: the numeric ``ortmodule demo`` options: DemoConfig field, type, help (the default is appended)
_NUMERIC_OPTIONS: tuple[tuple[str, type, str], ...] = (
    ("steps", int, "training steps per run"),
    ("batch_size", int, "sequences per step"),
    ("seq_len", int, "characters per sequence"),
    ("layers", int, "transformer blocks"),
    ("d_model", int, "model width"),
    ("heads", int, "attention heads"),
    ("lr", float, "AdamW learning rate"),
    ("generate", int, "characters to generate at the end"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``ortmodule demo`` options (``ortmodule demo --help``)."""
    d = DemoConfig()
    for name, kind, text in _NUMERIC_OPTIONS:
        default = getattr(d, name)
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=default,
            help=f"{text} (default {default})",
        )
    parser.add_argument(
        "--seed", type=int, default=d.seed, help="seed of the initial weights and the batches"
    )
    parser.add_argument(
        "--device", default=d.device, help="cpu (default) or cuda[:N] (needs ortmodule[cuda])"
    )
    parser.add_argument(
        "--save-onnx",
        action="store_true",
        help="keep the exported and built ONNX models of the ORTModule run in --out",
    )
    parser.add_argument(
        "--out",
        default=d.out,
        help=f"folder for the loss plot, results and ONNX files (default ./{d.out})",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=d.threads,
        help="intra-op threads for both runs (default: one per core)",
    )


def config_from(args: argparse.Namespace) -> DemoConfig:
    """The :class:`DemoConfig` of parsed ``ortmodule demo`` options."""
    names = {f for f in DemoConfig.__dataclass_fields__}
    return DemoConfig(**{k: v for k, v in vars(args).items() if k in names})
