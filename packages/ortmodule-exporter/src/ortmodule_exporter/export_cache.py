"""On-disk cache of exported models (``ORTMODULE_CACHE_DIR``).

An entry's key hashes everything that can change the exported graph: the module classes and
their source, parameter and buffer names, shapes, dtypes and requires_grad, the input schema,
the mode, the opset, torch's version and ours. A hit skips the export entirely.

Entries are written atomically (temporary file in the same folder, then ``os.replace``), so
processes sharing the folder never read half a file. Every entry carries a SHA-256 of its
payload; a corrupted, truncated or mismatched entry is reported once as a warning, removed and
rebuilt: it is never loaded. Loading never imports anything: classes named by an entry must
already be imported in this process.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import os
import pickle
import sys
import tempfile
import warnings
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ortmodule_pytree import Schema

    from .export import ExportedModel

_MAGIC = b"ORTMODULE-EXPORT-CACHE-1\n"
_VERSION = "0.1.0"


class _NoImportUnpickler(pickle.Unpickler):
    """Resolves classes only from modules already imported: a cache file imports nothing."""

    def find_class(self, module: str, name: str) -> Any:
        mod = sys.modules.get(module)
        if mod is None:
            raise pickle.UnpicklingError(
                f"cache entry names {module}.{name}, which is not imported"
            )
        obj: Any = mod
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj


def _class_source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return f"{cls.__module__}.{cls.__qualname__}"


class ExportCache:
    """A folder of exported models. ``ExportCache(path)``; unwritable folders warn once."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))
        self._warned_unwritable = False
        self.hits = 0
        self.misses = 0

    # -- keys ---------------------------------------------------------------------------
    def key_for(
        self,
        module: torch.nn.Module,
        input_schema: Schema,
        *,
        training: bool,
        opset: int,
        extra: str = "",
    ) -> str:
        h = hashlib.sha256()
        classes = sorted(
            {type(m) for m in module.modules()}, key=lambda c: (c.__module__, c.__qualname__)
        )
        for cls in classes:
            h.update(f"{cls.__module__}.{cls.__qualname__}\n".encode())
            h.update(_class_source(cls).encode())
        for name, t in (*module.named_parameters(), *module.named_buffers()):
            h.update(
                f"{name}|{tuple(t.shape)}|{t.dtype}|{t.requires_grad}|{t.device.type}\n".encode()
            )
        h.update(repr(input_schema).encode())
        h.update(
            f"|training={training}|opset={opset}|torch={torch.__version__}|ours={_VERSION}|{extra}".encode()
        )
        return h.hexdigest()

    def _file(self, key: str) -> str:
        return os.path.join(self.path, f"{key}.ortexport")

    # -- load ---------------------------------------------------------------------------
    def load(self, key: str) -> ExportedModel | None:
        file = self._file(key)
        try:
            with open(file, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self.misses += 1
            return None
        except OSError as err:
            self._warn(f"cannot read export cache entry {file}: {err}; exporting instead")
            self.misses += 1
            return None
        try:
            exported = self._decode(data, key)
        except Exception as err:  # noqa: BLE001 - any damage means: do not use it
            self._warn(f"export cache entry {file} is unusable ({err}); it is removed and rebuilt")
            try:
                os.remove(file)
            except OSError:
                pass
            self.misses += 1
            return None
        self.hits += 1
        return exported

    def _decode(self, data: bytes, key: str) -> ExportedModel:
        import onnx

        if not data.startswith(_MAGIC):
            raise ValueError("not an export cache file")
        rest = data[len(_MAGIC) :]
        digest, sep, payload = rest.partition(b"\n")
        if not sep or hashlib.sha256(payload).hexdigest().encode() != digest:
            raise ValueError("checksum mismatch (truncated or corrupted)")
        with warnings.catch_warnings():
            # torch's pytree rebuilds leaf specs through a class it marks deprecated
            warnings.simplefilter("ignore", FutureWarning)
            record = _NoImportUnpickler(io.BytesIO(payload)).load()
        if record.get("key") != key:
            raise ValueError("entry belongs to a different model")
        exported: ExportedModel = record["exported"]
        exported.model = onnx.load_from_string(record["onnx"])
        return exported

    # -- store --------------------------------------------------------------------------
    def store(self, key: str, exported: ExportedModel) -> None:
        import copy

        shallow = copy.copy(exported)
        shallow.model = None  # type: ignore[assignment]
        try:
            payload = pickle.dumps(
                {"key": key, "exported": shallow, "onnx": exported.model.SerializeToString()},
                protocol=pickle.HIGHEST_PROTOCOL,
            )
        except Exception as err:  # noqa: BLE001
            self._warn(f"cannot cache this export ({err}); training continues without the cache")
            return
        blob = _MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
        try:
            os.makedirs(self.path, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".ortexport", dir=self.path)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self._file(key))
            except BaseException:
                try:
                    os.remove(tmp)
                except OSError:
                    pass
                raise
        except OSError as err:
            self._warn(
                f"ORTMODULE_CACHE_DIR={self.path} is not writable ({err}); "
                "training continues without the export cache"
            )

    def _warn(self, message: str) -> None:
        if "not writable" in message:
            if self._warned_unwritable:
                return
            self._warned_unwritable = True
        warnings.warn(f"ORTModule: {message}", stacklevel=4)
