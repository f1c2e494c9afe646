"""The export cache never runs code from its folder and refuses folders others can write."""

from __future__ import annotations

import hashlib
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch

from ortmodule_exporter import ExportCache, ExportConfig, export


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class _RunsACommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def _malicious_entries(marker: Path) -> list[bytes]:
    payload = pickle.dumps({"key": "k", "exported": _RunsACommand(marker), "onnx": b""})
    digest = hashlib.sha256(payload).hexdigest().encode()
    # the previous format (a pickle behind a checksum), and the same payload with the current
    # magic line: neither may run the command
    return [
        b"ORTMODULE-EXPORT-CACHE-1\n" + digest + b"\n" + payload,
        b"ORTMODULE-EXPORT-CACHE-2\n" + digest + b"\n" + payload,
    ]


@pytest.mark.parametrize("variant", [0, 1])
def test_malicious_entry_runs_nothing(tmp_path: Path, variant: int) -> None:
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    marker = tmp_path / "pwned"
    cache = ExportCache(str(folder))
    key = "0" * 64
    entry = folder / f"{key}.ortexport"
    entry.write_bytes(_malicious_entries(marker)[variant])
    entry.chmod(0o600)
    with pytest.warns(UserWarning, match="unusable"):
        assert cache.load(key) is None
    assert not marker.exists()
    assert not entry.exists()  # removed, rebuilt on the next store


def test_entry_is_onnx_and_json_only(tmp_path: Path) -> None:
    export(Net(), (torch.randn(2, 4),), training=True, cache=ExportCache(str(tmp_path)))
    (entry,) = tmp_path.glob("*.ortexport")
    data = entry.read_bytes()
    assert b"\x80\x04" not in data[:200]  # no pickle protocol header
    assert (entry.stat().st_mode & 0o077) == 0


def test_folder_writable_by_others_is_not_used(tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o777)
    cache = ExportCache(str(folder))
    with pytest.warns(UserWarning, match="writable by other users"):
        first = export(Net(), (torch.randn(2, 4),), training=True, cache=cache)
    assert not first.from_cache and not list(folder.iterdir())


def test_entry_writable_by_others_is_not_loaded(tmp_path: Path) -> None:
    cache = ExportCache(str(tmp_path / "c"))
    x = torch.randn(2, 4)
    export(Net(), (x,), training=True, cache=cache)
    (entry,) = (tmp_path / "c").glob("*.ortexport")
    entry.chmod(0o666)
    with pytest.warns(UserWarning, match="writable by other users"):
        again = export(Net(), (x,), training=True, cache=cache)
    assert not again.from_cache


def test_new_folder_is_private(tmp_path: Path) -> None:
    folder = tmp_path / "new" / "cache"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export(Net(), (torch.randn(2, 4),), training=True, cache=ExportCache(str(folder)))
    assert (folder.stat().st_mode & 0o077) == 0


def test_hit_recomputes_the_output_structure(tmp_path: Path) -> None:
    class DictOut(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"y": self.fc(x), "z": x.sum(-1)}

    cache = ExportCache(str(tmp_path))
    x = torch.randn(2, 4)
    first = export(DictOut(), (x,), training=True, cache=cache, config=ExportConfig())
    second = export(DictOut(), (x,), training=True, cache=cache, config=ExportConfig())
    assert second.from_cache
    assert second.output_schema == first.output_schema
