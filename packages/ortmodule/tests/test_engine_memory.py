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
import gc

import pytest
import torch

from ortmodule import DebugOptions, ORTModule


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


@pytest.mark.parametrize(
    ("arena", "recompute", "gives_back"),
    [
        pytest.param(None, True, True, id="auto-recompute"),  # the memory component asks
        pytest.param(None, False, False, id="auto"),  # the arena keeps a step's buffers
        pytest.param("0", False, True, id="off"),
        pytest.param("1", True, False, id="on-overrides-recompute"),
    ],
)
def test_large_engine_buffers_go_back_after_a_step_where_asked(
    monkeypatch: pytest.MonkeyPatch, arena: str | None, recompute: bool, gives_back: bool
) -> None:
    if recompute:
        pytest.importorskip("ortmodule_memory")
    from ortmodule_testing.zoo.gpt import GPTConfig, GPTDecoder

    libc = _glibc()
    if libc is None:
        pytest.skip("needs glibc's mallinfo2 and malloc_trim")
    if arena is not None:
        monkeypatch.setenv("ORTMODULE_CPU_MEM_ARENA", arena)

    def mmapped() -> int:
        """Bytes in glibc's mmapped blocks (every allocation above its mmap threshold)."""
        gc.collect()
        libc.malloc_trim(0)
        return int(libc.mallinfo2().hblkhd)

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, d_model=256, n_layers=2, n_heads=4, seq_len=256)
    model = ORTModule(GPTDecoder(config), DebugOptions(memory_opt_level=int(recompute)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ids = torch.randint(0, config.vocab_size, (8, config.seq_len))

    def step() -> None:
        loss, _ = model(ids, labels=ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    before = mmapped()
    for _ in range(3):  # the first builds the graph and the session
        step()
    kept = mmapped() - before
    if gives_back:
        assert kept < 16 << 20, f"{kept / 2**20:.0f} MiB of large blocks kept after the steps"
    else:
        assert kept > 32 << 20, f"only {kept / 2**20:.0f} MiB kept: the arena did not keep a step's"
