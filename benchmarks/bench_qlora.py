"""QLoRA step time and peak memory: eager bitsandbytes, ORTModule with MatMulBnb4, and ORTModule
with the generic PythonOp route for bitsandbytes' MatMul4Bit.

The model is ``ortmodule_qlora.tiny_llama.qlora_llama`` at benchmark size: a Llama whose every
linear layer is an NF4 ``Linear4bit`` (double-quantized scales) with LoRA adapters on the
attention projections, trained with AdamW. Each mode runs in its own fresh process, so peak
memory belongs to that mode alone. Ratios are over eager's numbers from the same run.

    python benchmarks/bench_qlora.py            # quick
    python benchmarks/bench_qlora.py --full
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

MODES = ("eager", "ortmodule_matmulbnb4", "ortmodule_pythonop")
QUICK = {"hidden": 256, "layers": 2, "vocab": 1024, "batch": 4, "seq": 64, "warmup": 2, "steps": 8}
FULL = {"hidden": 512, "layers": 4, "vocab": 2048, "batch": 8, "seq": 128, "warmup": 3, "steps": 20}


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _worker(mode: str, size: dict[str, int]) -> dict[str, Any]:
    import torch

    os.environ["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"
    from ortmodule_qlora import use_matmul_bnb4
    from ortmodule_qlora.tiny_llama import causal_mask, qlora_llama

    peft_model = qlora_llama(
        "nf4", hidden=size["hidden"], layers=size["layers"], vocab=size["vocab"]
    )
    inner = peft_model.base_model.model
    model: Any = inner
    if mode != "eager":
        from ortmodule import ORTModule

        use_matmul_bnb4(mode == "ortmodule_matmulbnb4")
        model = ORTModule(inner)
    opt = torch.optim.AdamW([p for p in inner.parameters() if p.requires_grad], lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    mask = causal_mask(size["batch"], size["seq"])
    before = _rss_mib()
    times, losses = [], []
    first = 0.0
    for step in range(size["warmup"] + size["steps"]):
        ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=gen)
        start = time.perf_counter()
        loss = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        elapsed = time.perf_counter() - start
        if step == 0:
            first = elapsed
        if step >= size["warmup"]:
            times.append(elapsed)
    return {
        "mode": mode,
        "median_step_s": statistics.median(times),
        "first_step_s": first,
        "peak_rss_mib": _rss_mib(),
        "training_rss_growth_mib": _rss_mib() - before,
        "losses": losses,
    }


def run(quick: bool = True) -> dict[str, Any]:
    size = QUICK if quick else FULL
    results = {}
    for mode in MODES:
        out = subprocess.run(
            [sys.executable, __file__, "--worker", mode, json.dumps(size)],
            capture_output=True,
            text=True,
            check=False,
        )
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode != 0 or not lines:
            results[mode] = {"error": out.stderr.strip().splitlines()[-1:] or ["no output"]}
            continue
        results[mode] = json.loads(lines[-1])
    eager = results.get("eager", {})
    for r in results.values():
        if "median_step_s" in r and "median_step_s" in eager:
            r["step_ratio_vs_eager"] = r["median_step_s"] / eager["median_step_s"]
            r["peak_rss_ratio_vs_eager"] = r["peak_rss_mib"] / eager["peak_rss_mib"]
            r["max_loss_diff_vs_eager"] = max(
                abs(a - b) for a, b in zip(r["losses"], eager["losses"], strict=True)
            )
    return {"size": size, "results": results}


def _table(report: dict[str, Any]) -> str:
    rows = [
        "| mode | median step | vs eager | first step | peak RSS | vs eager | RSS growth in training | max loss diff |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode, r in report["results"].items():
        if "error" in r:
            rows.append(f"| {mode} | failed: {r['error']} | | | | | | |")
            continue
        rows.append(
            f"| {mode} | {r['median_step_s'] * 1e3:.0f} ms | {r.get('step_ratio_vs_eager', 1):.2f}x "
            f"| {r['first_step_s']:.1f} s | {r['peak_rss_mib']:.0f} MiB "
            f"| {r.get('peak_rss_ratio_vs_eager', 1):.2f}x | {r['training_rss_growth_mib']:.0f} MiB "
            f"| {r.get('max_loss_diff_vs_eager', 0):.2g} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        print(json.dumps(_worker(sys.argv[2], json.loads(sys.argv[3]))))
    else:
        report = run(quick="--full" not in sys.argv)
        print(f"size: {report['size']}")
        print(_table(report))
