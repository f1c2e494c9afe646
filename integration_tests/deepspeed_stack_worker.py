"""One rank of the DeepSpeed stack test: ORTModule + FusedAdam + DeepSpeed ZeRO + FP16_Optimizer.

Run by ``test_deepspeed_stack.py`` as ``python deepspeed_stack_worker.py RANK WORLD PORT OUT CASES``
(CASES like ``1-fp32,3-fp16``: ZeRO stage, 0 for none, and dtype). For each case it trains the same tiny model twice from the same
weights on the same batches, once as the plain stack and once with the model wrapped in
ORTModule, and writes the largest differences (and what it checked) to ``OUT`` as JSON.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import sys
from typing import Any

os.environ["DS_ACCELERATOR"] = "cpu"  # chosen when deepspeed is first imported
os.environ["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"  # a parity test must not fall back
os.environ["ORTMODULE_ENABLE_ZERO_STAGE3"] = "1"

import warnings  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ddp_parity import gloo_group  # noqa: E402  (beside this file: the script's directory)

STEPS = 10


def tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 2)
    )


DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def config(stage: int, dtype: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        # tiny parameters would otherwise stay whole ("persistent") and never be gathered
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 4}
    if dtype == "bf16":  # no loss scale: bf16 has fp32's exponent range
        cfg["bf16"] = {"enabled": True}
    return cfg


def train(deepspeed: Any, base: torch.nn.Module, stage: int, dtype: str, wrap: bool) -> dict:
    from ortmodule import FP16_Optimizer, FusedAdam, ORTModule

    model = copy.deepcopy(base)
    # whether each export traced a copy (stage 3 must trace the gathered module in place)
    copied: list[bool] = []
    exporter = importlib.import_module("ortmodule_exporter.export.exporter")
    copy_for_export = exporter.copy_for_export

    def recording_copy(module: torch.nn.Module, enabled: bool = True) -> torch.nn.Module:
        target = copy_for_export(module, enabled)
        copied.append(target is not module)
        return target

    # whether each engine session was built with the CPU arena (ZeRO steps build theirs without)
    arenas: list[bool] = []
    engine_module = importlib.import_module("ortmodule_exporter.engine")
    make_session = engine_module._session

    def recording_session(model_bytes: bytes, cfg: Any) -> Any:
        arenas.append(cfg.cpu_arena)
        return make_session(model_bytes, cfg)

    if wrap:
        model = ORTModule(model)
    optimizer = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config(stage, dtype)
    )
    # FP16_Optimizer knows DeepSpeed's stage 1/2 optimizer and, without ZeRO, its fp16/bf16 one
    # (FP16_UnfusedOptimizer, as FusedAdam is not DeepSpeed's); not stage 3's, and without ZeRO
    # in fp32 DeepSpeed steps FusedAdam itself
    if stage in (1, 2) or (stage == 0 and dtype != "fp32"):
        optimizer = FP16_Optimizer(optimizer)
        assert type(optimizer.wrapped).__name__ == (
            "FP16_UnfusedOptimizer" if stage == 0 else "DeepSpeedZeroOptimizer"
        )
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    released = []
    losses = []
    for _ in range(STEPS):
        x = torch.randn(4, 8, generator=gen)
        exporter.copy_for_export = recording_copy
        engine_module._session = recording_session
        try:
            out = engine(x.to(DTYPES[dtype]))
        finally:
            exporter.copy_for_export = copy_for_export
            engine_module._session = make_session
        loss = out.float().pow(2).mean()
        engine.backward(loss)
        if stage == 3:
            released.append(
                all(p.ds_status.name == "NOT_AVAILABLE" for p in engine.module.parameters())
            )
        engine.step()
        losses.append(float(loss.detach()))
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        values = [p.detach().float().clone() for p in params]
        values_dtype = params[0].dtype
    exports = engine.module._runner.exports if wrap else 0
    return {
        "values": values,
        "losses": losses,
        "released": released,
        "exports": exports,
        "copied": copied,
        "arenas": arenas,
        "dtype": str(values_dtype),
    }


def stage3_without_the_switch(deepspeed: Any) -> str:
    """The error a stage-3 model gets from ORTModule when ORTMODULE_ENABLE_ZERO_STAGE3 is off."""
    from ortmodule import FusedAdam, ORTModule

    os.environ["ORTMODULE_ENABLE_ZERO_STAGE3"] = "0"
    try:
        model = ORTModule(tiny())
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=FusedAdam(model.parameters(), lr=1e-2),
            config=config(3, "fp32"),
        )
        engine(torch.randn(4, 8))
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    finally:
        os.environ["ORTMODULE_ENABLE_ZERO_STAGE3"] = "1"
    return "no error"


def main() -> None:
    rank, world, port, out, cases = sys.argv[1:6]
    os.environ.update(
        RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port
    )
    torch.set_num_threads(1)
    # DeepSpeed's collectives warn at every call on this torch; the log's tail is for the failure
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # the shared-memory all-reduce op is JIT-compiled with the system compiler (slow, optional)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    # torch computes fp16 on any CPU; DeepSpeed asks oneDNN whether this one is fast at it
    get_accelerator().is_fp16_supported = lambda: True
    # a barrier before the group's teardown, and the Python stack of every thread should a rank
    # abort (CI saw rank 0 of this group end in "terminate called without an active exception")
    with gloo_group(int(rank), int(world), int(port)):
        deepspeed.comm.init_distributed(
            dist_backend="gloo", auto_mpi_discovery=False, verbose=False
        )
        results = run_cases(deepspeed, cases.split(","))
    with open(out, "w") as f:
        json.dump(results, f)


def run_cases(deepspeed: Any, cases: list[str]) -> dict[str, Any]:
    """Each case's result (or, for ``3-off``, the error text), by case."""
    results: dict[str, Any] = {}
    for case in cases:
        if case == "3-off":
            results[case] = stage3_without_the_switch(deepspeed)
            continue
        stage, dtype = int(case.split("-")[0]), case.split("-")[1]
        base = tiny()
        plain = train(deepspeed, base, stage, dtype, wrap=False)
        ours = train(deepspeed, base, stage, dtype, wrap=True)
        # fp32: rtol 1e-5 (atol 1e-7 for values at zero): the engine's float32 kernels order
        # sums differently from torch's. fp16 and bf16: equal. DeepSpeed casts the module to the
        # low-precision dtype, and the engine runs every operator on such a tensor with PyTorch's
        # kernel and its backward with autograd's (docs/mixed_precision.md); this model uses no
        # tensor twice, so the engine sums no gradient of its own, and each rank hands DeepSpeed
        # the gradients eager computes, bit for bit (measured 2026-11-26: max abs diff 0 after 10
        # steps, ZeRO 1/2/3, one and two ranks). Before fp16 ran on PyTorch's kernels, the
        # engine's fp16 kernels rounded some sums differently and this bound was rtol 2**-9,
        # atol 5e-4.
        rtol, atol = (1e-5, 1e-7) if dtype == "fp32" else (0.0, 0.0)
        worst = max(
            float(((a - b).abs() - rtol * a.abs() - atol).max())
            for a, b in zip(plain["values"], ours["values"], strict=True)
        )
        diffs = zip(plain["values"], ours["values"], strict=True)
        max_abs = max(float((a - b).abs().max()) for a, b in diffs)
        results[case] = {
            "dtype": ours["dtype"],
            "excess": worst,
            "max_abs": max_abs,
            "rtol": rtol,
            "losses": [plain["losses"], ours["losses"]],
            "released": ours["released"],
            "exports": ours["exports"],
            "copied": ours["copied"],
            "arenas": ours["arenas"],
            "learned": ours["losses"][-1] < ours["losses"][0],
        }
    return results


if __name__ == "__main__":
    main()
