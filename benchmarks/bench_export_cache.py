"""What the export cache costs and saves per graph (issue #13 item 3), on zoo models.

For each model: a full export, the key computation (module code walk, ExportConfig fingerprint,
versions), and a cache hit (key + reading the entry + the one no_grad forward that gives the
output structure), in milliseconds.

    python benchmarks/bench_export_cache.py
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch

MODELS = ("mlp", "gpt", "bert")


def _ms(fn: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _measure(name: str, repeat: int) -> dict[str, float]:
    from ortmodule_exporter import ExportCache, ExportConfig, export
    from ortmodule_pytree import flatten
    from ortmodule_testing.zoo import ZOO

    config = ExportConfig(custom_autograd=True)
    case = ZOO[name]
    model = case.build(seed=0)
    args, kwargs = case.make_batch(0)
    with tempfile.TemporaryDirectory() as folder:
        cache = ExportCache(folder)
        full = _ms(lambda: export(model, args, kwargs, training=True, config=config), repeat)
        export(model, args, kwargs, training=True, config=config, cache=cache)
        _, schema = flatten({"args": args, **kwargs}, prefix="input")

        def key() -> None:
            cache.key_for(model, schema, training=True, opset=17, extra=config.fingerprint())

        def hit() -> None:
            export(model, args, kwargs, training=True, config=config, cache=cache)

        return {"export ms": full, "key ms": _ms(key, repeat), "hit ms": _ms(hit, repeat)}


def run(quick: bool = True) -> dict[str, dict[str, float]]:
    """``{model: {"export ms", "key ms", "hit ms"}}``."""
    os.environ.setdefault("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    repeat = 3 if quick else 10
    return {name: _measure(name, repeat) for name in MODELS}


def main() -> None:
    torch.set_num_threads(1)
    results = run(quick="--full" not in sys.argv)
    print("| model | export ms | key ms | cache hit ms |")
    print("|---|---:|---:|---:|")
    for name, row in results.items():
        print(f"| {name} | {row['export ms']:.0f} | {row['key ms']:.1f} | {row['hit ms']:.0f} |")


if __name__ == "__main__":
    main()
