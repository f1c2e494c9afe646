"""Peak memory of ZeRO stage 3 against stage 2 under ORTModule, on the zoo's GPT decoder.

    python -m benchmarks.zero_memory [--world 2] [--steps 3]

For each stage, ``--world`` gloo processes on this CPU train the GPT (vocab 1024, d 256,
4 layers by default; ``--d-model``, ``--layers``, ``--vocab``; seq 128, batch 4) wrapped in
ORTModule with FusedAdam under DeepSpeed. Each rank reports its peak resident memory
(``ru_maxrss``), the part of it above the peak before the model was built (imports, process
group), and the bytes of parameters it holds between steps (shards under stage 3). Prints a
Markdown table (the largest rank); nothing is asserted.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rank(
    rank: int,
    world: int,
    port: int,
    stage: int,
    steps: int,
    out: str,
    sizes: dict[str, int],
    wrap: bool = True,
) -> None:
    os.environ.update(
        DS_ACCELERATOR="cpu",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        ORTMODULE_ENABLE_ZERO_STAGE3="1",
        ORTMODULE_FALLBACK_POLICY="FALLBACK_DISABLE",
    )
    import deepspeed
    import torch
    import torch.distributed as dist

    from ortmodule import FusedAdam, ORTModule
    from ortmodule_testing.zoo import GPTConfig, GPTDecoder

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    config = GPTConfig(**sizes)
    # imports, the process group and the engine library: the part that does not depend on ZeRO
    baseline = _peak()
    torch.manual_seed(0)
    model = ORTModule(GPTDecoder(config)) if wrap else GPTDecoder(config)
    optimizer = FusedAdam(model.parameters(), lr=1e-3)
    ds_config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (4, config.seq_len), generator=gen)
        loss, _ = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
    # a released stage-3 parameter is empty; its shard is ds_tensor
    held = sum(
        getattr(p, "ds_tensor", p).numel() * p.element_size() for p in engine.module.parameters()
    )
    result = {"peak": _peak(), "baseline": baseline, "held": held, "loss": float(loss.detach())}
    Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(stage: int, world: int, steps: int, sizes: list[str]) -> list[dict[str, float]]:
    port = _port()
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"{r}.json") for r in range(world)]
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.zero_memory",
                    "--rank",
                    str(r),
                    "--world",
                    str(world),
                    "--port",
                    str(port),
                    "--stage",
                    str(stage),
                    "--steps",
                    str(steps),
                    "--out",
                    outs[r],
                    *sizes,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(world)
        ]
        for p in procs:
            _, err = p.communicate()
            if p.returncode:
                raise RuntimeError(f"stage {stage} rank failed:\n{err[-4000:]}")
        return [json.loads(Path(o).read_text()) for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--stage", type=int)
    parser.add_argument("--out")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--eager", action="store_true", help="the same stack without ORTModule")
    args = parser.parse_args()
    sizes = {"d_model": args.d_model, "n_layers": args.layers, "vocab_size": args.vocab}
    if args.rank is not None:
        _rank(
            args.rank,
            args.world,
            args.port,
            args.stage,
            args.steps,
            args.out,
            sizes,
            not args.eager,
        )
        return
    size_args = ["--d-model", str(args.d_model), "--layers", str(args.layers)]
    size_args += ["--vocab", str(args.vocab), *(["--eager"] if args.eager else [])]
    stack = "eager (no ORTModule)" if args.eager else "ORTModule"
    print(f"GPT {sizes}, seq 128, batch 4, {stack}, FusedAdam, fp32, {args.steps} steps")
    print("| stage | world | peak RSS (MiB) | of which training (MiB) | parameters held (MiB) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for stage in (2, 3):
        ranks = measure(stage, args.world, args.steps, size_args)
        peak = max(r["peak"] for r in ranks) / 2**20
        training = max(r["peak"] - r["baseline"] for r in ranks) / 2**20
        held = max(r["held"] for r in ranks) / 2**20
        print(f"| {stage} | {args.world} | {peak:.0f} | {training:.0f} | {held:.2f} |")


if __name__ == "__main__":
    main()
