"""Where asked, the CPU engine keeps no memory between steps.

onnxruntime-training 1.19.2's partial runs allocate from a BFC arena that keeps its regions
for the session's life, even with ``enable_cpu_mem_arena`` off (issue #41: 224 MiB at a 45M
GPT). Recompute and ZeRO stage 3 are the user asking for memory over time, so their sessions
allocate from a plain allocator registered in the engine's environment; other sessions keep the
faster arena. ``ORTMODULE_CPU_MEM_ARENA=1``/``0`` decides it for every session.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
        )
    ]


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallinfo2") or not hasattr(libc, "malloc_trim"):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    return libc


def _relu_model() -> bytes:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return model.SerializeToString()


def test_cpu_sessions_keep_their_arena_unless_asked() -> None:
    from ortmodule_exporter.engine import SessionConfig, _session

    default = _session(_relu_model(), SessionConfig()).get_session_options()
    assert default.enable_cpu_mem_arena
    with pytest.raises(RuntimeError, match="use_env_allocators"):  # the entry is not set
        default.get_session_config_entry("session.use_env_allocators")
    plain = _session(_relu_model(), SessionConfig(cpu_arena=False)).get_session_options()
    assert not plain.enable_cpu_mem_arena
    assert plain.get_session_config_entry("session.use_env_allocators") == "1"


#: one case in a fresh process: glibc's mmap threshold is pinned at 1 MiB first, so every block
#: the engine allocates (the arena's regions are powers of two of 1 MiB and more) is an mmapped
#: block whatever ran before (glibc raises its own threshold after large frees, and the arena's
#: regions then hide in the heap); prints the mmapped bytes three steps left behind
_STEPS_IN_A_FRESH_PROCESS = """
import gc, sys
import torch
sys.path.insert(0, {tests!r})
from test_engine_memory import _glibc
from ortmodule import DebugOptions, ORTModule
from ortmodule_exporter.aten import output_pool
from ortmodule_testing.zoo.gpt import GPTConfig, GPTDecoder

libc = _glibc()
M_MMAP_THRESHOLD = -3
assert libc.mallopt(M_MMAP_THRESHOLD, 1 << 20) == 1

def mmapped():
    gc.collect()
    output_pool.clear()  # our ATen nodes' idle output buffers: not the engine's
    libc.malloc_trim(0)
    return int(libc.mallinfo2().hblkhd)

{setup}
torch.manual_seed(0)
config = GPTConfig(vocab_size=256, d_model=256, n_layers=2, n_heads=4, seq_len=256)
model = ORTModule(GPTDecoder(config), DebugOptions(memory_opt_level={level}))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
ids = torch.randint(0, config.vocab_size, (8, config.seq_len))
before = mmapped()
for _ in range(3):  # the first builds the graph and the session
    loss, _ = model(ids, labels=ids)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
print("kept", mmapped() - before)
"""


def _kept_after_steps(
    arena: str | None, recompute: bool, kernel_choice: str = "ENGINE", setup: str = ""
) -> int:
    """Bytes of mmapped blocks three steps leave behind, in a fresh process. ``kernel_choice``:
    ``ENGINE`` keeps the matrix products on the engine (a large graph whose products run on
    PyTorch gives the arena up under ``AUTO``), ``TORCH`` gives them to PyTorch; ``setup``: a
    line run before the model is made."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallopt"):
        pytest.skip("needs glibc's mallinfo2, malloc_trim and mallopt")
    env = dict(os.environ)
    env.pop("ORTMODULE_CPU_MEM_ARENA", None)
    # PyTorch's MKL keeps its GEMM buffers in its own memory manager; on an AVX-512 Xeon they
    # are 24 MiB of mmapped blocks (none on an AMD EPYC), which this reading would count as the
    # engine's. Without that manager MKL frees them: what is left is the engine's and ours
    env["MKL_DISABLE_FAST_MM"] = "1"
    env["ORTMODULE_KERNEL_CHOICE"] = kernel_choice
    if arena is not None:
        env["ORTMODULE_CPU_MEM_ARENA"] = arena
    code = _STEPS_IN_A_FRESH_PROCESS.format(
        tests=str(Path(__file__).parent), level=int(recompute), setup=setup
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split("kept")[-1])


MIB = 1 << 20


def test_the_arena_keeps_a_steps_engine_buffers_unless_switched_off() -> None:
    # The arena's regions (64 MiB here) stay; without it, what is left is not the engine's
    # (2 MiB here; the ATen nodes' output pool, 32 MiB, is cleared before each reading).
    kept_auto, kept_off = _kept_after_steps(None, False), _kept_after_steps("0", False)
    assert kept_off < 16 * MIB, f"{kept_off / MIB:.0f} MiB of large blocks kept after the steps"
    assert kept_auto - kept_off > 32 * MIB, (kept_auto / MIB, kept_off / MIB)


def test_products_on_pytorch_give_the_arena_up_unless_it_is_switched_on() -> None:
    """With the graph's matrix products on PyTorch (``passes/matmul_routes.py``), most of a
    step's large tensors are PyTorch's: ``AUTO`` builds the session without the arena once the
    module's parameters reach ``PRODUCTS_ARENA_OFF_BYTES`` (lowered here: the model is small),
    and keeps it below that."""
    lowered = "import ortmodule.execution as e; e.PRODUCTS_ARENA_OFF_BYTES = 0"
    kept_auto = _kept_after_steps(None, False, kernel_choice="TORCH", setup=lowered)
    kept_on = _kept_after_steps("1", False, kernel_choice="TORCH", setup=lowered)
    kept_small = _kept_after_steps(None, False, kernel_choice="TORCH")
    assert kept_auto < 16 * MIB, f"{kept_auto / MIB:.0f} MiB of large blocks kept after the steps"
    assert kept_on - kept_auto > 16 * MIB, (kept_on / MIB, kept_auto / MIB)
    assert kept_small - kept_auto > 16 * MIB, (kept_small / MIB, kept_auto / MIB)


def test_recompute_gives_the_engine_buffers_back_unless_the_arena_is_switched_on() -> None:
    pytest.importorskip("ortmodule_memory")
    kept_auto, kept_on = _kept_after_steps(None, True), _kept_after_steps("1", True)
    assert kept_auto < 16 * MIB, f"{kept_auto / MIB:.0f} MiB of large blocks kept after the steps"
    assert kept_on - kept_auto > 32 * MIB, (kept_on / MIB, kept_auto / MIB)
