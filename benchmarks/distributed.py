"""Beyond one process: DDP and DeepSpeed ZeRO stages 2 and 3, eager against ORTModule.

    python -m benchmarks.distributed --stacks ddp --model gpt2_124m --steps 1 3
    python -m benchmarks.distributed --stacks zero2 zero3 --model gpt --d-model 1024 \\
        --layers 24 --vocab 32000 --steps 1 2

For each stack (``ddp``: ``torch.nn.parallel.DistributedDataParallel`` with ``torch.optim.AdamW``;
``zero2`` / ``zero3``: DeepSpeed with ``FusedAdam``, ``DS_ACCELERATOR=cpu``) and each mode
(``eager``; ``ortmodule``: the model wrapped in ``ORTModule`` before the stack wraps it,
fallback disabled), ``--world`` gloo processes on this CPU train the model (one intra-op thread
each): ``gpt2_124m`` (Hugging Face GPT-2 small, batch 4 x 256, from ``benchmarks.models``) or
``gpt`` (the testing zoo's decoder, seq 128, batch 4, sizes from ``--d-model``, ``--layers``,
``--vocab``). Each rank takes its own batches. Each rank reports its first step, its later
steps, its peak resident memory (``ru_maxrss``) and the part of it above the peak before the
model was built (imports, process group), the peak of the first step (export, graph build,
session) and that of the later steps alone (``VmHWM`` after a reset), and the bytes of
parameters it holds between steps (shards under stage 3). Prints a Markdown table (the slowest / largest rank); nothing is
asserted. Needs DeepSpeed for the ZeRO stacks.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .bench_memory import reset_peak, status_kib

STACKS = ("ddp", "zero2", "zero3")
MODES = ("eager", "ortmodule")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _model_and_batches(name: str, sizes: dict[str, int], rank: int, world: int) -> Any:
    """(model, batch(step) -> (args, kwargs), loss(out, batch) -> tensor)."""
    import torch

    if name == "gpt":
        from ortmodule_testing.zoo import GPTConfig, GPTDecoder

        config = GPTConfig(**sizes)
        torch.manual_seed(0)
        model = GPTDecoder(config)

        def batch(step: int) -> Any:
            gen = torch.Generator().manual_seed(1000 * (step * world + rank))
            ids = torch.randint(0, config.vocab_size, (4, config.seq_len), generator=gen)
            return (ids,), {"labels": ids}

        return model, batch, lambda out, _b: out[0]
    from benchmarks.models import WORKLOADS

    workload = WORKLOADS[name]
    return (
        workload.build(False),
        lambda step: workload.batch(step * world + rank, False),
        workload.loss,
    )


def _rank(args: argparse.Namespace, sizes: dict[str, int]) -> None:
    os.environ.update(
        DS_ACCELERATOR="cpu",
        RANK=str(args.rank),
        LOCAL_RANK=str(args.rank),
        WORLD_SIZE=str(args.world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(args.port),
        ORTMODULE_FALLBACK_POLICY="FALLBACK_DISABLE",
    )
    if args.stack == "zero3":
        os.environ["ORTMODULE_ENABLE_ZERO_STAGE3"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    if args.stack != "ddp":
        import deepspeed

        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        deepspeed.comm.init_distributed(
            dist_backend="gloo", auto_mpi_discovery=False, verbose=False
        )
    # imports, the process group and the engine library: the part that does not depend on
    # the stack
    baseline = _peak()
    model, batch, loss_of = _model_and_batches(args.model, sizes, args.rank, args.world)
    if args.mode == "ortmodule":
        from ortmodule import ORTModule

        model = ORTModule(model)
    if args.stack == "ddp":
        engine = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4)

        def step(b: Any) -> torch.Tensor:
            loss = loss_of(engine(*b[0], **b[1]), b)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            return loss

        held_params = engine.module.parameters
    else:
        import deepspeed

        from ortmodule import FusedAdam

        ds_config = {
            "train_micro_batch_size_per_gpu": 4,
            "steps_per_print": 10**9,
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": int(args.stack[-1])},
        }
        optimizer = FusedAdam(model.parameters(), lr=1e-4)
        ds, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

        def step(b: Any) -> torch.Tensor:
            loss = loss_of(ds(*b[0], **b[1]), b)
            ds.backward(loss)
            ds.step()
            return loss

        held_params = ds.module.parameters
    times = []
    first_peak = 0
    for i in range(args.warmup + args.measured):
        start = time.perf_counter()
        loss = step(batch(i))
        times.append(time.perf_counter() - start)
        if i == 0:
            # the first step holds the export, the graph build and the session; the peak of
            # the later steps alone is read after resetting the high-water mark
            first_peak = _peak()
            reset_peak()
    # a released stage-3 parameter is empty; its shard is ds_tensor
    held = sum(getattr(p, "ds_tensor", p).numel() * p.element_size() for p in held_params())
    result = {
        "first": times[0],
        "steps": times[args.warmup :],
        "peak": _peak(),
        "first_peak": first_peak,
        "steps_peak": status_kib("VmHWM") * 1024,
        "baseline": baseline,
        "held": held,
        "loss": float(loss.detach()),
    }
    Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _died(returncode: int) -> str:
    """How a rank ended, for the table: a Python exception's own line is in its stderr; a
    signal (no traceback) is named here, as an ``Error`` line the table picks up."""
    if returncode >= 0:
        return f"a rank exited with code {returncode}"
    name = signal.Signals(-returncode).name
    why = " (the kernel's OOM killer sends it: out of memory?)" if name == "SIGKILL" else ""
    return f"a rank was killed by {name}{why}\nError: a rank was killed by {name}{why}"


def measure(stack: str, mode: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One run of ``stack`` in ``mode``: each rank's result."""
    port = _port()
    passed = ["--model", args.model, "--d-model", str(args.d_model), "--layers", str(args.layers)]
    passed += ["--vocab", str(args.vocab), "--steps", str(args.warmup), str(args.measured)]
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"{r}.json") for r in range(args.world)]
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.distributed",
                    *("--rank", str(r), "--world", str(args.world), "--port", str(port)),
                    *("--stack", stack, "--mode", mode, "--out", outs[r], *passed),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(args.world)
        ]
        for p in procs:
            _, err = p.communicate()
            if p.returncode:
                raise RuntimeError(f"{stack} {mode}: {_died(p.returncode)}:\n{err[-4000:]}")
        return [json.loads(Path(o).read_text()) for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stacks", nargs="+", choices=STACKS, default=["zero2", "zero3"])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--model", default="gpt", help="gpt (the zoo's decoder) or gpt2_124m")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, nargs=2, default=(1, 2), metavar=("WARMUP", "N"))
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    # one rank (internal)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--stack", choices=STACKS, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.warmup, args.measured = args.steps
    sizes = {"d_model": args.d_model, "n_layers": args.layers, "vocab_size": args.vocab}
    if args.rank is not None:
        _rank(args, sizes)
        return
    what = f"GPT {sizes}, seq 128, batch 4" if args.model == "gpt" else args.model
    print(
        f"{what}; {args.world} gloo ranks, 1 thread each; {args.warmup} warmup + "
        f"{args.measured} measured steps; load average {os.getloadavg()}"
    )
    print(
        "| stack | mode | first step | median step | peak RSS (MiB) | of which training "
        "(MiB) | peak, first step / later steps (MiB) | parameters held (MiB) "
        "| final loss (rank 0) |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for stack in args.stacks:
        for mode in args.modes:
            try:
                ranks = measure(stack, mode, args)
            except RuntimeError as err:
                lines = str(err).splitlines()
                # the exception's own line, not the last frame of its traceback
                why = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1])
                print(f"| {stack} | {mode} | failed: {why.strip()[:300]} |", flush=True)
                print(str(err), file=sys.stderr)
                continue
            first = max(r["first"] for r in ranks)
            median = max(statistics.median(r["steps"]) for r in ranks) if args.measured else 0
            peak = max(r["peak"] for r in ranks) / 2**20
            training = max(r["peak"] - r["baseline"] for r in ranks) / 2**20
            held = max(r["held"] for r in ranks) / 2**20
            first_peak = max(r["first_peak"] for r in ranks) / 2**20
            steps_peak = max(r["steps_peak"] for r in ranks) / 2**20 if args.measured else 0
            print(
                f"| {stack} | {mode} | {first:.1f} s | {median:.2f} s | {peak:.0f} | "
                f"{training:.0f} | {first_peak:.0f} / {steps_peak:.0f} | {held:.1f} | "
                f"{ranks[0]['loss']:.4f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
