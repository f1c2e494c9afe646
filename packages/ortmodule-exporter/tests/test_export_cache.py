"""ORTMODULE_CACHE_DIR: hits skip export, damage is detected and replaced, writes are atomic."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import stat
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ortmodule_exporter import ExportCache, ExportConfig, export
from ortmodule_pytree import flatten


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def _count_exports(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = torch.onnx.export

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", counting)
    return calls


def test_hit_skips_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_exports(monkeypatch)
    cache = ExportCache(str(tmp_path))
    x = torch.randn(2, 4)
    first = export(Net(), (x,), training=True, cache=cache)
    second = export(Net(), (torch.randn(5, 4),), training=True, cache=cache)
    assert calls[0] == 1
    assert not first.from_cache and second.from_cache
    assert second.model.SerializeToString() == first.model.SerializeToString()
    assert second.param_names == first.param_names
    assert second.output_schema == first.output_schema


def test_key_changes_with_mode_opset_and_shapes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_exports(monkeypatch)
    cache = ExportCache(str(tmp_path))
    x = torch.randn(2, 4)
    export(Net(), (x,), training=True, cache=cache)
    export(Net(), (x,), training=False, cache=cache)
    export(Net(), (x,), training=True, opset=16, cache=cache)
    export(Net(), (x.unsqueeze(0),), training=True, cache=cache)
    assert calls[0] == 4


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_damaged_entry_is_replaced_not_loaded(tmp_path: Path, damage: str) -> None:
    cache = ExportCache(str(tmp_path))
    x = torch.randn(2, 4)
    export(Net(), (x,), training=True, cache=cache)
    (entry,) = tmp_path.glob("*.ortexport")
    data = entry.read_bytes()
    if damage == "truncate":
        entry.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        i = len(data) - 10
        entry.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :])
    elif damage == "garbage":
        entry.write_bytes(b"not a cache file at all")
    else:
        entry.write_bytes(b"")
    with pytest.warns(UserWarning, match="unusable"):
        again = export(Net(), (x,), training=True, cache=cache)
    assert not again.from_cache
    # the damaged entry was rewritten with a good one
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        third = export(Net(), (x,), training=True, cache=cache)
    assert third.from_cache


def test_entry_of_another_model_is_refused(tmp_path: Path) -> None:
    cache = ExportCache(str(tmp_path))
    x = torch.randn(2, 4)
    export(Net(), (x,), training=True, cache=cache)
    (entry,) = tmp_path.glob("*.ortexport")
    key_eval = cache.key_for(
        Net(),
        flatten({"x": x}, prefix="input")[1],
        training=False,
        opset=17,
        extra=f"{ExportConfig.from_switches().fingerprint()}|",
    )
    entry.rename(tmp_path / f"{key_eval}.ortexport")
    with pytest.warns(UserWarning, match="different model"):
        result = export(Net(), (x,), training=False, cache=cache)
    assert not result.from_cache


def test_unwritable_directory_warns_once_and_training_continues(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        # root ignores permission bits; a path under a regular file cannot be created by anyone
        blocker = tmp_path / "file"
        blocker.write_text("x")
        path = str(blocker / "cache")
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
        path = str(ro)
    cache = ExportCache(path)
    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = export(Net(), (x,), training=True, cache=cache)
        b = export(Net(), (torch.randn(3, 4),), training=False, cache=cache)
    relevant = [w for w in caught if "not writable" in str(w.message)]
    assert len(relevant) == 1
    assert a.model.graph.node and b.model.graph.node


def _writer(path: str, barrier: mp.synchronize.Barrier, out: mp.Queue) -> None:  # type: ignore[type-arg]
    torch.manual_seed(0)
    cache = ExportCache(path)
    barrier.wait()
    for _ in range(3):
        export(Net(), (torch.randn(2, 4),), training=True, cache=cache)
    out.put((cache.hits, cache.misses))


def test_concurrent_writers_never_read_half_a_file(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    out = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), barrier, out)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    results = [out.get(timeout=5) for _ in procs]
    assert sum(h for h, _ in results) >= 4  # every call after the first in a process hits
    assert not list(tmp_path.glob(".tmp-*"))
    # a fresh process (this one's registries differ after other tests: another key) reads the
    # entry they left: every export hits
    alone = ctx.Barrier(1)  # kept referenced until the child has unpickled it
    reader = ctx.Process(target=_writer, args=(str(tmp_path), alone, out))
    reader.start()
    reader.join(timeout=120)
    assert reader.exitcode == 0
    assert out.get(timeout=5) == (3, 0)


# -- the key misses whenever the export could differ -------------------------------------------


def _scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0


def _scale_differently(x: torch.Tensor) -> torch.Tensor:
    return x * 3.0


class UsesHelper(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _scale(self.fc(x))


def test_changed_module_level_helper_misses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_exports(monkeypatch)
    cache = ExportCache(str(tmp_path))
    x = torch.randn(2, 4)
    export(UsesHelper(), (x,), training=True, cache=cache)
    monkeypatch.setitem(globals(), "_scale", _scale_differently)
    again = export(UsesHelper(), (x,), training=True, cache=cache)
    assert calls[0] == 2 and not again.from_cache
    assert "Mul" in {n.op_type for n in again.model.graph.node}


class UsesFunction(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Double.apply(self.fc(x))


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x * 2

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g * 2


@pytest.mark.parametrize(
    "changed",
    [
        ExportConfig(custom_autograd=True),
        ExportConfig(opset=16),
        ExportConfig(aten_sdpa_fallback=True),
        ExportConfig(efficient_attention=True),
        ExportConfig(aten_embedding=True),
    ],
    ids=lambda c: next(k for k, v in vars(c).items() if v != getattr(ExportConfig(), k)),
)
def test_changed_export_option_misses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, changed: ExportConfig
) -> None:
    calls = _count_exports(monkeypatch)
    cache = ExportCache(str(tmp_path))
    x = torch.randn(2, 4)
    plain = export(UsesFunction(), (x,), training=True, cache=cache, config=ExportConfig())
    other = export(UsesFunction(), (x,), training=True, cache=cache, config=changed)
    assert calls[0] == 2 and not other.from_cache
    assert other.config == changed and plain.config == ExportConfig()
    # each config hits its own entry afterwards
    assert export(UsesFunction(), (x,), training=True, cache=cache, config=changed).from_cache


def test_export_applies_its_config_only_while_it_runs() -> None:
    from ortmodule_exporter import python_op

    before = python_op.custom_autograd_enabled()
    exported = export(
        UsesFunction(),
        (torch.randn(2, 4),),
        training=True,
        config=ExportConfig(custom_autograd=True),
    )
    assert "PythonOp" in {n.op_type for n in exported.model.graph.node}
    assert python_op.custom_autograd_enabled() == before


def test_registered_symbolic_misses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ortmodule_exporter import register_symbolic, unregister_symbolic

    calls = _count_exports(monkeypatch)
    cache = ExportCache(str(tmp_path))
    x = torch.randn(2, 4)
    export(Net(), (x,), training=True, cache=cache)

    def relu_as_max(g, value):  # type: ignore[no-untyped-def]
        zero = g.op("Constant", value_t=torch.tensor(0.0))
        return g.op("Max", value, zero)

    register_symbolic("aten::relu", relu_as_max)
    try:
        again = export(Net(), (x,), training=True, cache=cache)
    finally:
        unregister_symbolic("aten::relu")
    assert calls[0] == 2 and not again.from_cache
    assert "Max" in {n.op_type for n in again.model.graph.node}


@pytest.mark.parametrize("package", ["torch", "onnx", "onnxruntime-training"])
def test_changed_versions_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, package: str
) -> None:
    from ortmodule_exporter.export import cache as export_cache

    calls = _count_exports(monkeypatch)
    cache = ExportCache(str(tmp_path))
    x = torch.randn(2, 4)
    export(Net(), (x,), training=True, cache=cache)
    real = export_cache._versions
    monkeypatch.setattr(export_cache, "_versions", lambda: real().replace(f"{package}", "other"))
    assert not export(Net(), (x,), training=True, cache=cache).from_cache
    assert calls[0] == 2


def test_the_key_changes_with_the_exporters_own_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an editable install keeps its version across fixes: a graph an older exporter wrote
    # (one with a bug since fixed) must not be served
    from ortmodule_exporter.export import cache

    fake = tmp_path / "ortmodule_exporter" / "export"
    fake.mkdir(parents=True)
    (fake / "cache.py").write_text("x = 1\n")
    monkeypatch.setattr(cache, "__file__", str(fake / "cache.py"))
    cache._exporter_source.cache_clear()
    before = cache._versions()
    (fake / "cache.py").write_text("x = 2\n")
    cache._exporter_source.cache_clear()
    after = cache._versions()
    cache._exporter_source.cache_clear()
    assert before != after and "exporter-source=" in before


# -- issue #41: a warm start skips the export and the kernel choice's calibrations -------------


class LoopOverSequence(torch.nn.Module):
    """``range(x.shape[1])`` bakes the length into the trace: a guard on the input's size."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = torch.zeros_like(x[:, 0])
        for i in range(x.shape[1]):
            state = torch.tanh(self.lin(x[:, i]) + state)
        return state


def test_guards_on_sizes_are_kept_in_the_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Hugging Face models check sizes (GPT-2: ``batch_size != position_ids.shape[0]``); such
    # exports were never stored, so every start exported again
    calls = _count_exports(monkeypatch)
    x = torch.randn(2, 3, 4)
    first = export(LoopOverSequence(), (x,), training=True, cache=ExportCache(str(tmp_path)))
    second = export(LoopOverSequence(), (x,), training=True, cache=ExportCache(str(tmp_path)))
    assert first.shape_guards and calls[0] == 1 and second.from_cache
    assert [g.output for g in second.shape_guards] == [g.output for g in first.shape_guards]
    names = {"input.x": [2, 3, 4]}
    assert all(g.holds(names.__getitem__) for g in second.shape_guards)
    assert not any(g.holds(lambda _: [2, 5, 4]) for g in second.shape_guards)


@pytest.mark.parametrize(
    "damage",
    [
        lambda g: g["steps"][0].update(op="Loop"),  # not a shape operation
        lambda g: g["value"].update(dtype="object"),
        lambda g: g.update(kind="exec"),
        lambda g: g["shapes"][0].append("extra"),
    ],
)
def test_a_damaged_shape_guard_is_refused(damage: Any) -> None:
    from ortmodule_exporter.export.shape_guards import (
        shape_guard_from_json,
        shape_guard_to_json,
    )

    exported = export(LoopOverSequence(), (torch.randn(2, 3, 4),), training=True)
    data = json.loads(json.dumps(shape_guard_to_json(exported.shape_guards[0])))
    assert shape_guard_to_json(shape_guard_from_json(data)) == data  # the round trip
    damage(data)
    with pytest.raises(ValueError):
        shape_guard_from_json(data)


def test_the_code_fingerprint_is_the_same_in_every_process() -> None:
    # a frozenset constant (``x in {"a", "b"}``) is ordered by string hashing, which each
    # process seeds anew: the key must not follow it, nor the order of a set of names
    import subprocess
    import sys

    code = (
        "from ortmodule_exporter.export.cache import code_fingerprint\n"
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, x, mode='a'):\n"
        "        return x * 2 if mode in {'alpha', 'beta', 'gamma', 'delta'} else helper(x)\n"
        "def helper(x):\n"
        "    return other(x) + first(x)\n"
        "def other(x):\n    return x\n"
        "def first(x):\n    return x\n"
        "print(code_fingerprint([M]))\n"
    )
    prints = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in (1, 2, 3)
    }
    assert len(prints) == 1


class Gelu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.fc(x))


@pytest.fixture
def counted_calibrations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A fresh kernel-choice state (as in a new process) whose GELU measurement is counted."""
    from ortmodule_exporter.aten.kernel_choice import choice, gelu

    # patched where they are read: the decisions' module and the GELU family's
    monkeypatch.setattr(choice, "_DECISIONS", {})
    monkeypatch.setattr(choice, "_SECONDS", {})
    calls = [0]

    def measure(numel: int, approximate: str = "none") -> tuple[float, float]:
        calls[0] += 1
        return 1.0, 2.0  # the engine's kernel is faster

    monkeypatch.setattr(gelu, "measure_gelu", measure)
    return calls


def test_a_warm_start_does_not_calibrate_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, counted_calibrations: list[int]
) -> None:
    from ortmodule_exporter.aten import kernel_choice
    from ortmodule_exporter.aten.kernel_choice import choice

    config = ExportConfig(kernel_choice="auto")
    x = torch.randn(2, 4)
    export(Gelu(), (x,), training=True, cache=ExportCache(str(tmp_path)), config=config)
    assert counted_calibrations[0] == 1
    measured = kernel_choice.decisions()
    monkeypatch.setattr(choice, "_DECISIONS", {})  # the next process
    warm = export(Gelu(), (x,), training=True, cache=ExportCache(str(tmp_path)), config=config)
    assert warm.from_cache and counted_calibrations[0] == 1
    # the measurements came back with the graph, for the passes that consult them later
    assert kernel_choice.decisions() == measured


def test_another_machine_calibrates_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, counted_calibrations: list[int]
) -> None:
    from ortmodule_exporter.aten import kernel_choice
    from ortmodule_exporter.aten.kernel_choice import choice, stored_decisions

    config = ExportConfig(kernel_choice="auto")
    x = torch.randn(2, 4)
    export(Gelu(), (x,), training=True, cache=ExportCache(str(tmp_path)), config=config)
    monkeypatch.setattr(choice, "_DECISIONS", {})
    key = kernel_choice.machine_key()
    # machine_fingerprint reads it from its own module
    monkeypatch.setattr(stored_decisions, "machine_key", lambda: {**key, "cpu": "another CPU"})
    other = export(Gelu(), (x,), training=True, cache=ExportCache(str(tmp_path)), config=config)
    assert not other.from_cache and counted_calibrations[0] == 2


@pytest.mark.parametrize(
    "data",
    [
        {"not": "a list"},
        [["gelu(none)", "Float", 8, "__import__('os')", 1.0, 2.0]],
        [["gelu(none)", "Float", {"set": [1]}, "torch", 1.0, 2.0]],
        [["gelu(none)", "Float", 8, "torch", "fast", 2.0]],
    ],
)
def test_cached_decisions_are_validated(data: Any, counted_calibrations: list[int]) -> None:
    from ortmodule_exporter.aten import kernel_choice

    with pytest.raises(ValueError):
        kernel_choice.decisions_from_json(data)
    assert kernel_choice.decisions() == {}
    good = [["gelu(none)", "Float", {"tuple": [8, "x"]}, "torch", 1.0, None]]
    assert kernel_choice.decisions_from_json(good) == 1
    assert kernel_choice.decisions()[("gelu(none)", "Float", (8, "x"))][0] == "torch"


class BranchOnData(torch.nn.Module):
    """``if x.sum() > 0``: a guard on data, checked on a graph output at every run."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y * 2 if bool(x.sum() > 0) else y


def test_guards_on_data_are_kept_in_the_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GPT-2 at full size: ``q_length > 1`` stays such a guard (an ATen node hides the sizes
    # from shape inference), which kept every real-size GPT-2 export out of the cache
    calls = _count_exports(monkeypatch)
    x = torch.ones(2, 4)
    first = export(BranchOnData(), (x,), training=True, cache=ExportCache(str(tmp_path)))
    second = export(BranchOnData(), (x,), training=True, cache=ExportCache(str(tmp_path)))
    assert first.guards and calls[0] == 1 and second.from_cache
    assert [(n, g.kind, g.source, g.value.tolist()) for n, g in second.guards] == [
        (n, g.kind, g.source, g.value.tolist()) for n, g in first.guards
    ]
    assert {n for n, _ in second.guards} <= {o.name for o in second.model.graph.output}


def test_a_damaged_guard_is_refused() -> None:
    from ortmodule_exporter.export.shape_guards import guard_from_json

    with pytest.raises(ValueError):
        guard_from_json(
            {"kind": "bool", "value": {"array": [1], "dtype": "object", "shape": [1]}, "source": ""}
        )
    with pytest.raises(ValueError):
        guard_from_json(
            {
                "kind": "bool",
                "value": {"array": [1, 2], "dtype": "int64", "shape": [3]},
                "source": "",
            }
        )


class _SeesItsInputs(torch.nn.Module):
    """Records the type of each input it is called with; returns a dict, as HF models do."""

    def __init__(self, read_value: bool = False) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.read_value = read_value
        self.seen: list[type] = []

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        self.seen.append(type(x))
        y = self.fc(x)
        out: dict[str, Any] = {"y": y}
        if self.read_value:
            out["big"] = bool(x.sum() > 1e9)  # a Python value read from the data
        return out


def test_a_hit_takes_the_output_structure_from_a_fake_forward(tmp_path: Path) -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    cache = ExportCache(str(tmp_path))
    export(_SeesItsInputs(), (torch.randn(2, 4),), training=True, cache=cache)
    module = _SeesItsInputs()
    hit = export(module, (torch.randn(5, 4),), training=True, cache=cache)
    assert hit.from_cache
    # the warm start computed nothing: a GPT-2 124M forward is seconds
    assert module.seen == [FakeTensor]
    real = _SeesItsInputs()
    assert hit.output_schema == export(real, (torch.randn(5, 4),), training=True).output_schema


def test_a_value_read_from_data_takes_the_real_forward_on_a_hit(tmp_path: Path) -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    cache = ExportCache(str(tmp_path))
    first = export(_SeesItsInputs(True), (torch.randn(2, 4),), training=True, cache=cache)
    module = _SeesItsInputs(True)
    hit = export(module, (torch.randn(2, 4),), training=True, cache=cache)
    assert hit.from_cache
    assert module.seen[0] is FakeTensor and module.seen[1:] == [torch.Tensor]
    assert hit.output_schema == first.output_schema


def test_decisions_made_after_the_export_go_into_its_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, counted_calibrations: list[int]
) -> None:
    """``store_decisions`` rewrites the entry's decisions (not its graph) when the process
    made more after the export (the gradient build's), and leaves an entry that holds them."""
    from ortmodule_exporter.aten import kernel_choice
    from ortmodule_exporter.aten.kernel_choice import choice

    config = ExportConfig(kernel_choice="auto")
    x = torch.randn(2, 4)
    cache = ExportCache(str(tmp_path))
    cold = export(Gelu(), (x,), training=True, cache=cache, config=config)
    assert cold.cache_key and not cold.from_cache
    entry_file = Path(cache._file(cold.cache_key))
    graph_before = cache._split(entry_file.read_bytes(), cold.cache_key)[1]
    reads: list[str] = []
    real_read = cache._read
    monkeypatch.setattr(cache, "_read", lambda key: reads.append(key) or real_read(key))
    assert not cache.store_decisions(cold.cache_key, cold)  # nothing new
    assert reads == []  # the cache knows what it stored: the entry is not read again
    # a measurement the gradient build makes after the entry was stored
    late = ("gelu_backward(tanh)", "Float", 64)
    choice._DECISIONS[late] = ("torch", 5.0, 1.0)
    assert cache.store_decisions(cold.cache_key, cold)
    header, graph_after = cache._split(entry_file.read_bytes(), cold.cache_key)
    assert graph_after == graph_before
    assert ["gelu_backward(tanh)", "Float", 64, "torch", 5.0, 1.0] in header["kernel_choice"]

    monkeypatch.setattr(choice, "_DECISIONS", {})  # the next process
    warm = export(Gelu(), (x,), training=True, cache=ExportCache(str(tmp_path)), config=config)
    assert warm.from_cache and warm.cache_key == cold.cache_key
    assert kernel_choice.decisions()[late] == ("torch", 5.0, 1.0)
    assert counted_calibrations[0] == 1
    # under a mode that does not measure, the entry is left as it is
    engine_only = ExportConfig(kernel_choice="engine")
    cold.config = engine_only
    choice._DECISIONS[("gelu(none)", "Float", 128)] = ("engine", 1.0, 2.0)
    assert not cache.store_decisions(cold.cache_key, cold)
