"""The CUDA engine's TritonOp executor callbacks, called as the engine calls them (DLPack in,
DLPack out). The CPU engine has no register_triton_op_executor, so registration is checked on a
recording stand-in; the callbacks themselves run for real (interpreted on CPU)."""

from __future__ import annotations

import json

import torch
from helpers import model
from onnx import TensorProto as T
from onnx import helper as h
from torch.utils.dlpack import from_dlpack, to_dlpack

from ortmodule_triton import executor
from ortmodule_triton.fusion_config import FusionConfig, parse_config


def test_by_onnx_compiles_once_per_key_and_returns_dlpack_outputs():
    m = model(
        [h.make_node("Sub", ["a", "b"], ["d"]), h.make_node("Softmax", ["d"], ["y"], axis=-1)],
        [("a", T.FLOAT, ["n", 7]), ("b", T.FLOAT, ["n", 7])],
        [("y", T.FLOAT, ["n", 7])],
    )
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 7, generator=gen), torch.randn(3, 7, generator=gen)
    key = 424242
    result = executor.run_by_onnx(key, m.SerializeToString(), to_dlpack(a), to_dlpack(b))
    (y,) = [from_dlpack(c) for c in result]
    torch.testing.assert_close(y, torch.softmax(a - b, -1), rtol=1e-4, atol=1e-5)
    compiled = executor._KERNELS[key]
    executor.run_by_onnx(key, m.SerializeToString(), to_dlpack(b), to_dlpack(a))
    assert executor._KERNELS[key] is compiled


def test_by_name_calls_the_registered_function_with_attributes():
    executor.register_kernel_function("scaled", lambda x, scale: x * scale)
    (out,) = [from_dlpack(executor.run_by_name("scaled", to_dlpack(torch.ones(3)), scale=2.5))]
    assert torch.equal(out, torch.full((3,), 2.5))


class RecordingEngine:
    """Stands in for the CUDA build's native module, which the CPU build does not have."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def register_triton_op_executor(self, *callbacks: object) -> None:
        self.calls.append(callbacks)


def test_registration_happens_once_and_serves_the_latest_config():
    engine = RecordingEngine()
    saved = executor._REGISTERED[0]
    executor._REGISTERED[0] = False
    try:
        assert executor.register_triton_executor(engine, FusionConfig.default().to_json())
        narrow = '{"ops": {"Add": {"versions": [14]}}, "min_nodes": 3}'
        assert not executor.register_triton_executor(engine, narrow)
        (callbacks,) = engine.calls
        config_getter, by_name, by_onnx = callbacks
        assert by_name is executor.run_by_name and by_onnx is executor.run_by_onnx
        assert json.loads(config_getter()) == json.loads(narrow)  # what the engine reads now
        assert parse_config(config_getter()).min_nodes == 3
    finally:
        executor._REGISTERED[0] = saved
