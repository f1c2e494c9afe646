"""ORTMODULE_CACHE_DIR: hits skip export, damage is detected and replaced, writes are atomic."""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
import warnings
from pathlib import Path

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
