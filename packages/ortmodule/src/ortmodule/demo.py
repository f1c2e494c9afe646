"""``ortmodule demo``: train a small GPT under PyTorch eager and under ORTModule, side by side.

The model (:class:`DemoGPT`) is defined here and trained on the text shipped in
``ortmodule/demo_data/`` with a character tokenizer, so the demo downloads nothing. Both runs
start from the same initial weights and see the same batches; each runs in a fresh Python
process, so its peak memory is its own. At the end the demo prints a side-by-side table, writes
the loss curves to a PNG and lets the ORTModule model write a few lines of text.

    ortmodule demo                                  # the defaults: about a minute or two on 2 cores
    ortmodule demo --steps 20 --out /tmp/demo       # a quick look
    python -m ortmodule demo --save-onnx            # also keep the exported and built ONNX models

``run_demo(args)`` is what ``ortmodule demo`` calls; ``python -m ortmodule.demo --worker`` is the
per-run child process it starts, not a command for users.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "CharTokenizer",
    "DemoConfig",
    "DemoGPT",
    "ProgressBar",
    "RunResult",
    "add_arguments",
    "load_corpus",
    "run_demo",
]

CORPUS = "corpus.txt"
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


# -- configuration -------------------------------------------------------------------------------


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


def _config_from(args: argparse.Namespace) -> DemoConfig:
    names = {f for f in DemoConfig.__dataclass_fields__}
    return DemoConfig(**{k: v for k, v in vars(args).items() if k in names})


# -- data ------------------------------------------------------------------------------------------


def load_corpus() -> str:
    """The text shipped with the package (self-written prose, about 22 KB)."""
    return resources.files("ortmodule").joinpath("demo_data", CORPUS).read_text(encoding="utf-8")


class CharTokenizer:
    """One token per distinct character of the corpus.

    >>> tok = CharTokenizer("hello")
    >>> tok.decode(tok.encode("hole"))
    'hole'
    """

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self._index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        missing = sorted({c for c in text if c not in self._index})
        if missing:
            raise ValueError(f"characters not in the demo vocabulary: {''.join(missing)!r}")
        return [self._index[c] for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in ids)


def make_batches(ids: torch.Tensor, config: DemoConfig) -> torch.Tensor:
    """``(steps, batch, seq_len + 1)`` windows at random offsets: inputs are ``[..., :-1]``,
    targets ``[..., 1:]``. Drawn once, so both runs see exactly the same batches."""
    window = config.seq_len + 1
    if ids.numel() < window + 1:
        raise ValueError(
            f"--seq-len {config.seq_len} is longer than the corpus ({ids.numel()} characters)"
        )
    gen = torch.Generator().manual_seed(config.seed + 1)
    starts = torch.randint(
        0, ids.numel() - window, (config.steps, config.batch_size), generator=gen
    )
    return ids[starts[..., None] + torch.arange(window)]


# -- the model ------------------------------------------------------------------------------------


class _Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d_model)
        # no bias: softmax ignores a key bias, so its gradient is rounding noise that Adam would
        # scale into full-size updates, different in any two engines
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d_model, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, seq, d_model))
        return x + self.mlp(self.ln_2(x))  # type: ignore[no-any-return]


class DemoGPT(nn.Module):
    """A character-level GPT: token and position embeddings, pre-LN blocks, LM head.

    >>> model = DemoGPT(vocab_size=50, seq_len=16, layers=1, d_model=32, heads=4)
    >>> ids = torch.randint(0, 50, (2, 16))
    >>> model(ids).shape                      # logits
    torch.Size([2, 16, 50])
    >>> model(ids, targets=ids).shape         # the mean cross-entropy
    torch.Size([])
    """

    def __init__(
        self, vocab_size: int, seq_len: int, layers: int, d_model: int, heads: int
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok_emb(ids) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(config: DemoConfig, vocab_size: int) -> DemoGPT:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return DemoGPT(vocab_size, config.seq_len, config.layers, config.d_model, config.heads)


@torch.no_grad()
def generate(
    model: nn.Module, tokenizer: CharTokenizer, prompt: str, count: int, seq_len: int, seed: int
) -> str:
    """Sample ``count`` characters after ``prompt`` (temperature 0.8, seeded).

    The context is always a full window of ``seq_len`` characters (the prompt is left-padded
    with spaces), so every call has the same shapes and reuses one inference graph.
    """
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    ids = tokenizer.encode(" " * seq_len + prompt)
    for _ in range(count):
        window = torch.tensor([ids[-seq_len:]], device=device)
        logits = model(window)[0, -1].float().cpu()
        probs = torch.softmax(logits / 0.8, dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    return prompt + tokenizer.decode(ids[seq_len + len(prompt) :])


# -- progress ---------------------------------------------------------------------------------------


class ProgressBar:
    """A one-line progress bar on stderr: steps, loss, steps/s.

    On a terminal the line is redrawn in place; otherwise (a pipe, CI logs) a plain line is
    printed every tenth of the run, so logs stay readable.

    >>> import io
    >>> bar = ProgressBar("eager", total=4, stream=io.StringIO())
    >>> for step in range(4):
    ...     bar.update(step + 1, loss=1.0)
    >>> bar.close()
    """

    def __init__(
        self, label: str, total: int, stream: TextIO | None = None, width: int = 24
    ) -> None:
        self.label = label
        self.total = max(1, total)
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.width = width
        self.every = max(1, self.total // 10)
        self._first_done: float | None = None
        self._last_draw = 0.0

    def start(self, note: str = "") -> None:
        """Show the bar before the first step (which may take a while: export and build)."""
        if self.tty:
            self._draw(0, None, note)
        elif note:
            self._line(f"{self.label}: {note}")

    def update(self, done: int, loss: float) -> None:
        now = time.perf_counter()
        if self._first_done is None:
            self._first_done = now
        if self.tty:
            if now - self._last_draw >= 0.1 or done >= self.total:
                self._draw(done, loss)
                self._last_draw = now
        elif done == 1 or done % self.every == 0 or done >= self.total:
            self._line(
                f"{self.label}: step {done}/{self.total}  loss {loss:.4f}  {self._rate(done, now)}"
            )

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _rate(self, done: int, now: float) -> str:
        # the first step (export and graph build for ORTModule) is left out of the rate
        if self._first_done is None or done < 2 or now <= self._first_done:
            return "- steps/s"
        return f"{(done - 1) / (now - self._first_done):.1f} steps/s"

    def _draw(self, done: int, loss: float | None, note: str = "") -> None:
        filled = int(self.width * done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        text = f"{self.label:<10} [{bar}] {done:>{len(str(self.total))}}/{self.total}"
        if loss is not None:
            text += f"  loss {loss:.4f}  {self._rate(done, time.perf_counter())}"
        if note:
            text += f"  {note}"
        self.stream.write("\r\x1b[2K" + text)
        self.stream.flush()

    def _line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()


# -- one run (in its own process) -------------------------------------------------------------------


@dataclass
class RunResult:
    """What one child process reports back."""

    mode: str
    losses: list[float]
    step_seconds: list[float]
    #: RSS right before the first step and the process's high-water mark, in MiB
    rss_before_mib: float
    peak_rss_mib: float
    #: ORTModule's first-step phases (export, graph build, session creation), in seconds
    phases: dict[str, float] = field(default_factory=dict)
    cuda_peak_mib: float | None = None
    text: str = ""
    onnx_files: list[str] = field(default_factory=list)
    #: ORTModule only: every step ran in the engine (fallback disabled, none happened)
    engine_ran: bool = False

    @property
    def first_step(self) -> float:
        return self.step_seconds[0]

    @property
    def median_step(self) -> float:
        rest = self.step_seconds[1:] or self.step_seconds
        return statistics.median(rest)


def _current_rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return _peak_rss_mib()


def _peak_rss_mib() -> float:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # kilobytes on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def _train(mode: str, config: DemoConfig, work: Path) -> RunResult:
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this PyTorch build sees no CUDA device")
    text = load_corpus()
    tokenizer = CharTokenizer(text)
    batches = torch.load(work / "batches.pt").to(device)
    model: nn.Module = build_model(config, tokenizer.vocab_size)
    model.load_state_dict(torch.load(work / "init.pt"))
    model.to(device)
    if mode in ("ortmodule", "recompute"):
        from ortmodule import DebugOptions, ORTModule

        # a fallback would make this eager against eager: every failure must stop the run
        os.environ["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"
        debug = None
        if config.save_onnx and mode == "ortmodule":
            # the user's ORTMODULE_SAVE_ONNX_PATH wins over --out, as everywhere else
            os.environ.setdefault("ORTMODULE_SAVE_ONNX_PATH", str(Path(config.out).resolve()))
            debug = DebugOptions(save_onnx=True, onnx_prefix="demo_gpt")
        if mode == "recompute":
            debug = DebugOptions(memory_opt_level=1)
        model = ORTModule(model, debug)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)

    bar = ProgressBar(TITLES[mode], config.steps)
    bar.start("first step: export + graph build" if mode != "eager" else "")
    rss_before = _current_rss_mib()
    losses: list[float] = []
    seconds: list[float] = []
    for step in range(config.steps):
        start = time.perf_counter()
        batch = batches[step]
        loss = model(batch[:, :-1], targets=batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()  # waits for the device, so the time is the whole step
        seconds.append(time.perf_counter() - start)
        losses.append(value)
        bar.update(step + 1, value)
    bar.close()

    result = RunResult(mode, losses, seconds, rss_before, 0.0)
    runner = getattr(model, "_runner", None)
    times = getattr(runner, "last_times", None)
    if times is not None:
        result.phases = dict(times.seconds)
    fallback = getattr(model, "_fallback", None)
    result.engine_ran = times is not None and fallback is not None and fallback.cause is None
    if config.generate:
        model.eval()
        result.text = generate(
            model, tokenizer, PROMPT, config.generate, config.seq_len, config.seed
        )
    result.peak_rss_mib = _peak_rss_mib()
    if device.type == "cuda":
        result.cuda_peak_mib = torch.cuda.max_memory_allocated(device) / 2**20
    if config.save_onnx and mode == "ortmodule":
        folder = Path(os.environ["ORTMODULE_SAVE_ONNX_PATH"]).resolve()
        result.onnx_files = sorted(str(p) for p in folder.glob("demo_gpt*.onnx"))
    return result


def _worker(argv: Sequence[str]) -> int:
    """``python -m ortmodule.demo --worker MODE WORKDIR``: one run, results to WORKDIR/MODE.json."""
    mode, work = argv[0], Path(argv[1])
    config = DemoConfig(**json.loads((work / "config.json").read_text()))
    if config.threads:
        torch.set_num_threads(config.threads)  # the engine takes as many (ORTModule reads it)
    torch.manual_seed(config.seed)
    result = _train(mode, config, work)
    data = asdict(result)
    (work / f"{mode}.json").write_text(json.dumps(data))
    return 0


def _run_child(mode: str, work: Path) -> RunResult:
    cmd = [sys.executable, "-m", "ortmodule.demo", "--worker", mode, str(work)]
    done = subprocess.run(cmd, check=False)
    out = work / f"{mode}.json"
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"the {TITLES[mode]} run failed (exit code {done.returncode}); its output is above"
        )
    data = json.loads(out.read_text())
    return RunResult(**data)


# -- the report --------------------------------------------------------------------------------------


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def loss_differences(a: RunResult, b: RunResult) -> list[float]:
    return [abs(x - y) for x, y in zip(a.losses, b.losses, strict=True)]


def format_table(eager: RunResult, ort: RunResult, recompute: RunResult | None = None) -> str:
    """The side-by-side table ``ortmodule demo`` prints (with the recompute run's rows if given)."""
    diffs = loss_differences(eager, ort)
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    phases = ", ".join(f"{name} {sec:.2f} s" for name, sec in ort.phases.items())
    rows: list[tuple[str, str, str, str]] = [
        ("final loss", f"{eager.losses[-1]:.4f}", f"{ort.losses[-1]:.4f}", ""),
        ("largest per-step loss difference", "", f"{diffs[worst]:.2e}", f"at step {worst + 1}"),
        (
            "median step time (fwd+bwd+AdamW)",
            _fmt_s(eager.median_step),
            _fmt_s(ort.median_step),
            f"{ort.median_step / eager.median_step:.2f}x eager",
        ),
        ("steps/s (median)", f"{1 / eager.median_step:.1f}", f"{1 / ort.median_step:.1f}", ""),
        (
            "time to first step",
            _fmt_s(eager.first_step),
            _fmt_s(ort.first_step),
            f"includes {phases}" if phases else "",
        ),
        ("total training time", _fmt_s(sum(eager.step_seconds)), _fmt_s(sum(ort.step_seconds)), ""),
        (
            "peak RSS of the run's process",
            f"{eager.peak_rss_mib:.0f} MiB",
            f"{ort.peak_rss_mib:.0f} MiB",
            "high-water mark, fresh process per run",
        ),
        (
            "RSS growth during training",
            f"{eager.peak_rss_mib - eager.rss_before_mib:.0f} MiB",
            f"{ort.peak_rss_mib - ort.rss_before_mib:.0f} MiB",
            "peak minus RSS before step 1",
        ),
    ]
    if recompute is not None:
        label = TITLES["recompute"]
        rows += [
            (
                f"{label}: median step time",
                "",
                _fmt_s(recompute.median_step),
                f"{recompute.median_step / ort.median_step:.2f}x ORTModule",
            ),
            (
                f"{label}: RSS growth during training",
                "",
                f"{recompute.peak_rss_mib - recompute.rss_before_mib:.0f} MiB",
                "memory-vs-time trade-off (ORTMODULE_MEMORY_OPT_LEVEL=1)",
            ),
            (
                f"{label}: largest loss difference",
                "",
                f"{max(loss_differences(eager, recompute)):.2e}",
                "vs eager",
            ),
        ]
        if recompute.cuda_peak_mib is not None:
            rows.append(
                (f"{label}: peak CUDA memory", "", f"{recompute.cuda_peak_mib:.0f} MiB", "")
            )
    if eager.cuda_peak_mib is not None and ort.cuda_peak_mib is not None:
        rows.append(
            (
                "peak CUDA memory (torch allocator)",
                f"{eager.cuda_peak_mib:.0f} MiB",
                f"{ort.cuda_peak_mib:.0f} MiB",
                "",
            )
        )
    header = ("", TITLES["eager"], TITLES["ortmodule"], "")
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(4)]
    lines = []
    for r in (header, *rows):
        cells = [r[0].ljust(widths[0]), r[1].rjust(widths[1]), r[2].rjust(widths[2]), r[3]]
        lines.append("  ".join(cells).rstrip())
        if r is header:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


#: the options that decide ORTModule's speed, reported with every speed figure
SPEED_OPTIONS = ("ORTMODULE_FUSED_ATTENTION", "ORTMODULE_KERNEL_CHOICE")


def speed_summary(
    eager: RunResult, ort: RunResult, threads: int, loads: tuple[float, float]
) -> str:
    """One honest sentence on speed: the ratio, and the settings and load that produced it."""
    from .options import VARIABLES

    ratio = ort.median_step / eager.median_step
    verdict = (
        f"{1 / ratio:.2f}x as fast as eager" if ratio < 1 else f"{ratio:.2f}x eager's step time"
    )
    defaults = {var.name: var.default for var in VARIABLES}
    settings = ", ".join(
        f"{name}={os.environ.get(name) or defaults.get(name)}" for name in SPEED_OPTIONS
    )
    return (
        f"Speed: ORTModule ran {verdict} (median step {_fmt_s(ort.median_step)} vs "
        f"{_fmt_s(eager.median_step)}), with {threads or torch.get_num_threads()} intra-op "
        f"threads each, {settings}; load average {loads[0]:.1f} before and {loads[1]:.1f} after "
        f"on {os.cpu_count()} CPUs. The two runs were sequential processes, so a busy machine "
        "skews the ratio; `python -m benchmarks.worker ratio --model gpt` interleaves them."
    )


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_losses(eager: RunResult, ort: RunResult, path: Path) -> Path | None:
    """Write the two loss curves (and their difference) to ``path``; None without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    steps = range(1, len(eager.losses) + 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(3, 1))
    top.plot(steps, eager.losses, label=TITLES["eager"], linewidth=2.5, alpha=0.6)
    top.plot(steps, ort.losses, label=TITLES["ortmodule"], linewidth=1.0, linestyle="--")
    top.set_ylabel("training loss (cross-entropy)")
    top.set_title("DemoGPT on the shipped corpus: PyTorch eager vs ORTModule")
    top.legend()
    top.grid(alpha=0.3)
    bottom.plot(steps, loss_differences(eager, ort), color="tab:red", linewidth=1.0)
    bottom.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    bottom.set_ylabel("|loss difference|")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    return _save(plt, fig, path)


def plot_tradeoff(results: dict[str, RunResult], path: Path) -> Path | None:
    """Memory (RSS growth) against median step time, one point per run; None without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, r in results.items():
        x, y = r.median_step * 1e3, r.peak_rss_mib - r.rss_before_mib
        ax.scatter([x], [y], s=60)
        ax.annotate(TITLES.get(mode, mode), (x, y), textcoords="offset points", xytext=(6, 4))
    ax.set_xlabel("median step time (ms)")
    ax.set_ylabel("RSS growth during training (MiB)")
    ax.set_title("Memory vs time")
    ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def _versions() -> str:
    from importlib import metadata

    parts = [f"torch {torch.__version__}"]
    for dist in ("onnxruntime-training-cpu", "onnxruntime-training"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(parts)


def run_demo(args: argparse.Namespace, stdout: TextIO | None = None) -> int:
    """Train twice (eager, then ORTModule), print the table, write the plot; 0 when losses match."""
    out_stream = stdout if stdout is not None else sys.stdout
    config = _config_from(args)

    def say(text: str = "") -> None:
        out_stream.write(text + "\n")
        out_stream.flush()

    try:
        config.check()
    except ValueError as err:
        say(f"ortmodule demo: {err}")
        return 2
    out = Path(config.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = DemoConfig(**{**asdict(config), "out": str(out)})

    text = load_corpus()
    tokenizer = CharTokenizer(text)
    ids = torch.tensor(tokenizer.encode(text))
    try:
        batches = make_batches(ids, config)
    except ValueError as err:
        say(f"ortmodule demo: {err}")
        return 2
    model = build_model(config, tokenizer.vocab_size)
    params = sum(p.numel() for p in model.parameters())
    say(
        f"DemoGPT: {config.layers} layers, d_model {config.d_model}, {config.heads} heads, "
        f"{params / 1e6:.2f} M parameters, {tokenizer.vocab_size} characters"
    )
    say(
        f"Training {config.steps} steps of {config.batch_size} x {config.seq_len} characters on "
        f"{len(text) / 1024:.0f} KB of text, AdamW lr {config.lr}, device {config.device}"
    )
    say(
        f"{_versions()}; {os.cpu_count()} CPUs; each run in a fresh process, same weights and batches"
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > (os.cpu_count() or 1):
        say(
            f"Note: the machine is busy (load average {load:.1f} on {os.cpu_count()} CPUs), so times are noisy."
        )
    say()

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ortmodule-demo-") as tmp:
        work = Path(tmp)
        (work / "config.json").write_text(json.dumps(asdict(config)))
        torch.save(model.state_dict(), work / "init.pt")
        torch.save(batches, work / "batches.pt")
        try:
            results = {mode: _run_child(mode, work) for mode in MODES}
        except RuntimeError as err:
            say(f"ortmodule demo: {err}")
            return 1
    eager, ort = results["eager"], results["ortmodule"]
    diffs = loss_differences(eager, ort)
    if "recompute" in results:  # recompute must not change the losses either
        diffs += loss_differences(eager, results["recompute"])
    worst = max(diffs)
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0

    say()
    say(format_table(eager, ort, results.get("recompute")))
    say()
    if ort.engine_ran:
        say(
            "ORTModule ran every step in ONNX Runtime (ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE: "
            "a fallback to PyTorch would have stopped the run)."
        )
    else:
        say("ORTModule did NOT run in ONNX Runtime: the comparison below is not meaningful.")
    say(speed_summary(eager, ort, config.threads, (load, load_after)))
    say()
    matched = (
        all(r.engine_ran for mode, r in results.items() if mode != "eager")
        and worst <= LOSS_TOLERANCE
        and all(math.isfinite(loss) for r in results.values() for loss in r.losses)
    )
    if matched:
        say(
            f"The losses match: the largest per-step difference is {worst:.2e} (tolerance {LOSS_TOLERANCE:g})."
        )
    else:
        say(
            f"The losses DIFFER: the largest per-step difference is {worst:.2e}, above the tolerance "
            f"{LOSS_TOLERANCE:g}. Please report it with the output of `ortmodule doctor`."
        )
    plot = plot_losses(eager, ort, out / "loss_curve.png")
    if plot is not None:
        say(f"Loss curves: {plot}")
    else:
        say("Loss curves: not drawn, matplotlib is not installed (pip install 'ortmodule[demo]').")
    tradeoff = plot_tradeoff(results, out / "memory_vs_time.png")
    if tradeoff is not None:
        say(f"Memory vs time: {tradeoff}")
    summary = {
        "config": asdict(config),
        "runs": {mode: asdict(r) for mode, r in results.items()},
        "max_loss_difference": worst,
        "losses_match": matched,
    }
    results_path = out / "demo_results.json"
    results_path.write_text(json.dumps(summary, indent=1))
    say(f"Results: {results_path}")
    for path in ort.onnx_files:
        say(f"ONNX model: {path}")
    if ort.text:
        say()
        say(f"Text from the ORTModule model (inference graph, sampled with seed {config.seed}):")
        say()
        for line in ort.text.splitlines():
            say(f"    {line}")
        if eager.text:
            same = "the same" if eager.text == ort.text else "different"
            say()
            say(f"(The eager model's sample with the same seed is {same}.)")
    say()
    say(f"Done in {time.perf_counter() - started:.0f} s.")
    return 0 if matched else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(_worker(sys.argv[2:]))
    sys.exit("this module is run by `ortmodule demo`; see `ortmodule demo --help`")
