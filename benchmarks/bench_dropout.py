"""The cost of eager's dropout masks: the engine's Dropout vs ORTMODULE_ATEN_DROPOUT=1.

The benchmark GPT (vocab 1024, d 256, 4 layers, seq 128, batch 8) with dropout 0.1 (embedding,
residual and MLP dropouts; attention's dropout_p goes through scaled_dot_product_attention and
is not routed by the option). Both variants train in one process, steps alternating A/B after
warm-up; the median step time (forward + backward + AdamW) of each is printed, and the first
steps of the ATen variant are compared with eager's losses.

    python -m benchmarks.bench_dropout --steps 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")

import torch  # noqa: E402

from ortmodule import DebugOptions, ORTModule  # noqa: E402
from ortmodule_exporter.engine_random import seed_engine  # noqa: E402
from ortmodule_testing.zoo.gpt import GPTConfig, GPTDecoder  # noqa: E402


def _model() -> GPTDecoder:
    torch.manual_seed(0)
    return GPTDecoder(GPTConfig(dropout=0.1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 1024, (8, 128), generator=gen)
    return ids, ids.clone()


def _losses(model: torch.nn.Module, steps: int) -> list[float]:
    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for step in range(steps):
        ids, labels = _batch(step)
        opt.zero_grad()
        loss = model(ids, labels=labels)[0]
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    eager = _losses(_model(), 3)
    aten = _losses(ORTModule(_model(), DebugOptions(aten_dropout=True)), 3)
    engine = _losses(ORTModule(_model()), 3)
    print("losses eager ", eager)
    print("losses aten  ", aten)
    print("losses engine", engine)

    variants = {
        "engine Dropout": ORTModule(_model()),
        "ATen native_dropout": ORTModule(_model(), DebugOptions(aten_dropout=True)),
    }
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in variants.items()}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for step in range(args.warmup + args.steps):
        ids, labels = _batch(step)
        for name, model in variants.items():
            start = time.perf_counter()
            optims[name].zero_grad()
            model(ids, labels=labels)[0].backward()
            optims[name].step()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
    for name, t in times.items():
        print(f"{name:22s} median step {statistics.median(t) * 1e3:8.1f} ms over {len(t)} steps")
    base = statistics.median(times["engine Dropout"])
    print(f"ratio ATen / engine: {statistics.median(times['ATen native_dropout']) / base:.3f}")

    n = 2000
    start = time.perf_counter()
    for _ in range(n):
        seed_engine(torch.device("cpu"))
    print(f"seed_engine (cpu): {(time.perf_counter() - start) / n * 1e6:.1f} us a call")


if __name__ == "__main__":
    main()
