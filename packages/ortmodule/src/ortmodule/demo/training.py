"""One training run (eager, ORTModule or ORTModule + recompute), each in its own process.

The parent starts ``python -m ortmodule.demo --worker MODE WORKDIR`` (:func:`run_child`); the
child (:func:`worker`) trains and writes a :class:`RunResult` to ``WORKDIR/MODE.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from .config import PROMPT, TITLES, DemoConfig
from .data import CharTokenizer, load_corpus
from .model import build_model, generate
from .progress import ProgressBar


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


def train(mode: str, config: DemoConfig, work: Path) -> RunResult:
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


def worker(argv: Sequence[str]) -> int:
    """``python -m ortmodule.demo --worker MODE WORKDIR``: one run, results to WORKDIR/MODE.json."""
    mode, work = argv[0], Path(argv[1])
    config = DemoConfig(**json.loads((work / "config.json").read_text()))
    if config.threads:
        torch.set_num_threads(config.threads)  # the engine takes as many (ORTModule reads it)
    torch.manual_seed(config.seed)
    result = train(mode, config, work)
    data = asdict(result)
    (work / f"{mode}.json").write_text(json.dumps(data))
    return 0


def run_child(mode: str, work: Path) -> RunResult:
    cmd = [sys.executable, "-m", "ortmodule.demo", "--worker", mode, str(work)]
    done = subprocess.run(cmd, check=False)
    out = work / f"{mode}.json"
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"the {TITLES[mode]} run failed (exit code {done.returncode}); its output is above"
        )
    data = json.loads(out.read_text())
    return RunResult(**data)
