"""On-disk cache of exported models (``ORTMODULE_CACHE_DIR``).

An entry's key hashes everything that can change the exported graph: the module classes'
code and the code of every function their methods call (module-level helpers, followed
through their own calls), parameter and buffer names, shapes, dtypes and requires_grad, the
input schema, the mode, the :class:`~ortmodule_exporter.export.config.ExportConfig` fingerprint
(opset, custom autograd, ATen routes, registered symbolics and Function exporters) and the
versions of torch, onnx, the engine and this package, and a hash of this package's source. A hit
skips the export.

Security model (see docs/export_cache.md): an entry is data only, ONNX bytes plus a JSON
header; loading one never unpickles, imports or calls anything named in it. The output
structure is not read from the entry: the exporter recomputes it by running the module once
under ``no_grad`` and checks it against the entry. The folder and every entry must belong to
the current user and not be writable by group or others; otherwise the cache is not used and
one warning says why. A folder that does not exist is created with mode 0700.

Entries are written atomically (temporary file in the same folder, then ``os.replace``), so
processes sharing the folder never read half a file. Every entry carries a SHA-256 of its
contents (a check against damage, not a signature); a corrupted, truncated or mismatched entry
is reported once as a warning, removed and rebuilt.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import stat
import sys
import tempfile
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..aten import kernel_choice
from .guards import Guard
from .model import ExportedModel
from .shape_guards import (
    ShapeGuard,
    guard_from_json,
    guard_to_json,
    shape_guard_from_json,
    shape_guard_to_json,
)

if TYPE_CHECKING:
    import onnx

    from ortmodule_pytree import Schema


__all__ = ["CacheEntry", "ExportCache", "UnsafeCacheError", "code_fingerprint"]

_MAGIC = b"ORTMODULE-EXPORT-CACHE-2\n"
_SUFFIX = ".ortexport"


class UnsafeCacheError(RuntimeError):
    """The cache folder or an entry could be written by someone else."""


def _version(*distributions: str) -> str:
    for name in distributions:
        try:
            return f"{name}={metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return "none"


def _versions() -> str:
    import onnx

    return "|".join(
        (
            f"python={sys.version}",
            f"torch={torch.__version__}",
            f"onnx={onnx.__version__}",
            _version("onnxruntime-training", "onnxruntime-training-cpu", "onnxruntime"),
            _version("ortmodule-exporter"),
            f"exporter-source={_exporter_source()}",
        )
    )


@functools.lru_cache(maxsize=1)
def _exporter_source() -> str:
    """A hash of this package's own source files. Its version alone would serve graphs an
    older exporter wrote (a checkout or an editable install keeps one version across fixes)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


# -- what the module's code depends on ------------------------------------------------------------

# Code in these packages changes only with their version, which the key holds already.
_SKIP_PREFIXES = ("torch", "onnx", "onnxruntime", "numpy", "builtins", "typing", "abc")


def _own_code(obj: Any) -> types.FunctionType | None:
    fn = inspect.unwrap(obj) if callable(obj) else obj
    if isinstance(fn, (staticmethod, classmethod)):
        fn = fn.__func__
    if isinstance(fn, types.MethodType):
        fn = fn.__func__
    if not isinstance(fn, types.FunctionType):
        return None
    module = fn.__module__ or ""
    if module.split(".")[0] in _SKIP_PREFIXES:
        return None
    return fn


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _stable(const: Any) -> bytes:
    """A constant of a code object as bytes that do not depend on the process: a frozenset's
    order follows string hashing, which Python randomises per process (``PYTHONHASHSEED``), and
    ``marshal`` writes sets in that order, so it gave every process its own key."""
    if isinstance(const, types.CodeType):
        return _code_bytes(const)
    if isinstance(const, frozenset | set):
        return b"{" + b",".join(sorted(_stable(c) for c in const)) + b"}"
    if isinstance(const, tuple):
        return b"(" + b",".join(_stable(c) for c in const) + b")"
    return f"{type(const).__name__}:{const!r}".encode()


def _code_bytes(code: types.CodeType) -> bytes:
    """What a code object does, as process-independent bytes (its line number included)."""
    names = (
        code.co_name,
        getattr(code, "co_qualname", code.co_name),  # Python 3.11+
        code.co_names,
        code.co_varnames,
        code.co_freevars,
        code.co_cellvars,
        code.co_argcount,
        code.co_posonlyargcount,
        code.co_kwonlyargcount,
        code.co_flags,
        code.co_firstlineno,
    )
    return repr(names).encode() + code.co_code + b"|" + _stable(code.co_consts)


def _referenced(fn: types.FunctionType) -> Iterator[Any]:
    """Objects the function's code reads by global name (``helper``, ``mod.helper``), in name
    order (a set's order changes from process to process, and with it the walk's)."""
    found: set[str] = set()
    for code in _code_objects(fn.__code__):
        found.update(code.co_names)
    names = sorted(found)
    scope = fn.__globals__
    for name in names:
        value = scope.get(name)
        if isinstance(value, types.ModuleType):
            # ``helpers.gelu(x)``: attribute names of the module that the code also reads
            namespace = vars(value)
            yield from (namespace[n] for n in names if n in namespace)
        elif value is not None:
            yield value
    for cell in fn.__closure__ or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue


def code_fingerprint(classes: list[type], limit: int = 5000) -> str:
    """SHA-256 of the code of the classes' methods and of every function they reach by name.

    Changing a module-level helper that ``forward`` calls (or a helper of that helper, or a
    class it uses) changes the fingerprint. Code objects are hashed (:func:`_code_bytes`: the
    bytecode, names and constants, the same in every process), not source text, so this stays
    fast on large models; moving a function within its file also changes
    it, which only costs one export. Code of torch, onnx and the engine is left out: their
    versions are in the key. ``limit`` bounds the walk on very large programs.
    """
    h = hashlib.sha256()
    seen: set[int] = set()
    pending: list[Any] = []
    for cls in classes:
        h.update(f"class {cls.__module__}.{cls.__qualname__}\n".encode())
        pending.append(cls)
    while pending and len(seen) < limit:
        obj = pending.pop()
        if id(obj) in seen:
            continue
        if isinstance(obj, type):
            seen.add(id(obj))
            for klass in obj.__mro__:
                if klass.__module__.split(".")[0] not in _SKIP_PREFIXES:
                    pending.extend(vars(klass).values())
            continue
        if isinstance(obj, property):
            pending.extend(f for f in (obj.fget, obj.fset, obj.fdel) if f is not None)
            continue
        fn = _own_code(obj)
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        h.update(f"def {fn.__module__}.{fn.__qualname__}\n".encode())
        h.update(_code_bytes(fn.__code__))
        pending.extend(_referenced(fn))
    return h.hexdigest()


# -- entries --------------------------------------------------------------------------------------


@dataclass
class CacheEntry:
    """One loaded entry: the ONNX model and the JSON header describing its inputs and outputs."""

    model: onnx.ModelProto
    header: dict[str, Any]
    #: the guards on input sizes checked before each run (validated plain data, see
    #: :func:`~ortmodule_exporter.export.shape_guards.shape_guard_from_json`)
    shape_guards: tuple[ShapeGuard, ...] = ()
    #: the guards that stay graph outputs: (output name, guard), validated plain data too
    guards: tuple[tuple[str, Guard], ...] = ()

    def exported(self, input_schema: Schema, output_schema: Schema) -> ExportedModel | None:
        """The entry as an ``ExportedModel`` when ``output_schema`` (computed by running the
        module) is the one the entry was exported with; None otherwise."""
        h = self.header
        schema = _with_requires_grad(output_schema, h.get("output_requires_grad"))
        if schema is None:
            return None
        output_schema = schema
        if h.get("output_schema") != repr(output_schema) or tuple(h["output_names"]) != tuple(
            output_schema.names
        ):
            return None
        return ExportedModel(
            model=self.model,
            input_schema=input_schema,
            output_schema=output_schema,
            user_input_names=tuple(h["user_input_names"]),
            param_names=tuple(h["param_names"]),
            training=bool(h["training"]),
            opset=int(h["opset"]),
            buffer_updates=dict(h["buffer_updates"]),
            variance_updates={
                k: (str(v[0]), float(v[1])) for k, v in h["variance_updates"].items()
            },
            shape_guards=self.shape_guards,
            guards=self.guards,
            from_cache=True,
        )


def _with_requires_grad(schema: Schema, flags: Any) -> Schema | None:
    """``schema`` (computed under no_grad) with each output's requires_grad as exported."""
    if not isinstance(flags, list) or len(flags) != schema.num_tensors:
        return None
    restore, (spec, fields) = schema.__reduce__()
    fields = dict(fields)
    fields["tensor_meta"] = tuple(
        (dtype, ndim, device, bool(flag), shape)
        for (dtype, ndim, device, _, shape), flag in zip(fields["tensor_meta"], flags, strict=True)
    )
    rebuilt: Schema = restore(spec, fields)
    return rebuilt


def _header(key: str, exported: ExportedModel) -> dict[str, Any]:
    return {
        "key": key,
        "user_input_names": list(exported.user_input_names),
        "param_names": list(exported.param_names),
        "training": exported.training,
        "opset": exported.opset,
        "buffer_updates": dict(exported.buffer_updates),
        "variance_updates": {k: [v[0], v[1]] for k, v in exported.variance_updates.items()},
        "output_names": list(exported.output_schema.names),
        "output_requires_grad": [s.requires_grad for s in exported.output_schema.tensor_specs],
        "output_schema": repr(exported.output_schema),
        # Hugging Face models check sizes (``batch_size != position_ids.shape[0]``): without
        # their guards in the entry, such models were never cached at all
        "shape_guards": [shape_guard_to_json(g) for g in exported.shape_guards],
        # guards checked on a graph output (GPT-2's ``q_length > 1`` at full size, where an
        # ATen node hides the sizes from shape inference): their traced values are small
        "guards": [[name, guard_to_json(g)] for name, g in exported.guards],
        # the kernel choice's measurements (the key holds the machine they were made on)
        "kernel_choice": (
            kernel_choice.decisions_to_json()
            if kernel_choice.measures(exported.config.kernel_choice)
            else []
        ),
    }


def _unsafe_reason(st: os.stat_result, what: str) -> str | None:
    if st.st_uid != os.geteuid():
        return f"{what} belongs to user id {st.st_uid}, not to this user ({os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by other users (mode {stat.filemode(st.st_mode)})"
    return None


class ExportCache:
    """A folder of exported models. ``ExportCache(path)``; an unusable folder warns once."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))
        self._warned: set[str] = set()
        self._folder_checked = False
        self.hits = 0
        #: the kernel-choice decisions each entry this process stored or loaded holds: what
        #: ``store_decisions`` compares against without reading the entry again
        self._decisions: dict[str, Any] = {}
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
        h.update(code_fingerprint(classes).encode())
        for name, t in (*module.named_parameters(), *module.named_buffers()):
            h.update(
                f"{name}|{tuple(t.shape)}|{t.dtype}|{t.requires_grad}|{t.device.type}\n".encode()
            )
        h.update(repr(input_schema).encode())
        h.update(f"|training={training}|opset={opset}|{_versions()}|{extra}".encode())
        return h.hexdigest()

    def _file(self, key: str) -> str:
        return os.path.join(self.path, f"{key}{_SUFFIX}")

    # -- the folder -------------------------------------------------------------------------
    def _safe_folder(self, create: bool) -> bool:
        """Whether the folder is ours and private enough to use; warns once when it is not."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if not create:
                return False
            try:
                os.makedirs(self.path, mode=0o700, exist_ok=True)
                st = os.stat(self.path)
            except OSError as err:
                self._warn(
                    f"ORTMODULE_CACHE_DIR={self.path} is not writable ({err}); "
                    "training continues without the export cache"
                )
                return False
        except OSError as err:
            self._warn(
                f"ORTMODULE_CACHE_DIR={self.path} is not writable ({err}); "
                "training continues without the export cache"
            )
            return False
        reason = _unsafe_reason(st, f"ORTMODULE_CACHE_DIR={self.path}")
        if reason is not None:
            self._warn(
                f"{reason}: another user could plant graphs there, so the export cache is not "
                f"used. Use a folder only you can write (chmod go-w {self.path})."
            )
            return False
        return True

    # -- load ---------------------------------------------------------------------------
    def load(self, key: str) -> CacheEntry | None:
        """The entry for ``key``, or None (missing, damaged, unsafe: the caller exports)."""
        data = self._read(key)
        if data is None:
            self.misses += 1
            return None
        try:
            entry = self._decode(data, key)
        except Exception as err:  # noqa: BLE001 - any damage means: do not use it
            file = self._file(key)
            self._warn(f"export cache entry {file} is unusable ({err}); it is removed and rebuilt")
            try:
                os.remove(file)
            except OSError:
                pass
            self.misses += 1
            return None
        self.hits += 1
        self._decisions[key] = entry.header.get("kernel_choice")
        return entry

    def _read(self, key: str) -> bytes | None:
        """The bytes of ``key``'s entry; None where it is missing or not safe to read."""
        if not self._safe_folder(create=False):
            return None
        file = self._file(key)
        try:
            fd = os.open(file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            return None
        except OSError as err:
            self._warn(f"cannot read export cache entry {file}: {err}; exporting instead")
            return None
        with os.fdopen(fd, "rb") as f:
            reason = _unsafe_reason(os.fstat(f.fileno()), f"export cache entry {file}")
            if reason is not None:
                self._warn(f"{reason}; it is not loaded")
                return None
            return f.read()

    @staticmethod
    def _split(data: bytes, key: str) -> tuple[dict[str, Any], bytes]:
        """An entry's header and its ONNX bytes, checked against damage and against ``key``."""
        if not data.startswith(_MAGIC):
            raise ValueError("not an export cache file of this version")
        digest, sep, rest = data[len(_MAGIC) :].partition(b"\n")
        if not sep or hashlib.sha256(rest).hexdigest().encode() != digest:
            raise ValueError("checksum mismatch (truncated or corrupted)")
        size, sep, rest = rest.partition(b"\n")
        if not sep or not size.isdigit() or int(size) > len(rest):
            raise ValueError("bad header length")
        header = json.loads(rest[: int(size)].decode("utf-8"))
        if not isinstance(header, dict) or header.get("key") != key:
            raise ValueError("entry belongs to a different model")
        return header, rest[int(size) :]

    def _decode(self, data: bytes, key: str) -> CacheEntry:
        import onnx

        header, model_bytes = self._split(data, key)
        shape_guards, guards = header.get("shape_guards", []), header.get("guards", [])
        if not isinstance(shape_guards, list) or not isinstance(guards, list):
            raise ValueError("bad guards")
        if not all(isinstance(g, list) and len(g) == 2 and isinstance(g[0], str) for g in guards):
            raise ValueError("bad guards")
        model = onnx.load_from_string(model_bytes)
        outputs = {vi.name for vi in model.graph.output}
        if any(name not in outputs for name, _ in guards):
            raise ValueError("a guard names no output of the graph")
        return CacheEntry(
            model,
            header,
            tuple(shape_guard_from_json(g) for g in shape_guards),
            tuple((name, guard_from_json(g)) for name, g in guards),
        )

    # -- store --------------------------------------------------------------------------
    def store(self, key: str, exported: ExportedModel) -> None:
        try:
            fields = _header(key, exported)
        except TypeError:
            # a guard whose traced value is big or of another dtype (a ``tolist()`` of a
            # tensor): this graph is exported in each process, as every guarded one was before
            return
        try:
            header = json.dumps(fields, sort_keys=True).encode("utf-8")
        except (TypeError, ValueError) as err:
            self._warn(f"cannot cache this export ({err}); training continues without the cache")
            return
        if self._write(key, header, exported.model.SerializeToString()):
            self._decisions[key] = fields["kernel_choice"]

    def store_decisions(self, key: str, exported: ExportedModel) -> bool:
        """Put the kernel-choice decisions this process holds now into ``key``'s entry, when
        they differ from the entry's: those the gradient build made after the entry was
        stored (the engine's GELU gradient on GPT-2), which a warm start measured again
        otherwise. The entry's graph bytes stay as they are. True when the entry was
        rewritten; nothing happens without an entry or under a kernel choice that does not
        measure."""
        if not kernel_choice.measures(exported.config.kernel_choice):
            return False
        found = kernel_choice.decisions_to_json()
        if self._decisions.get(key) == found:
            return False  # the entry holds them already: no reading, no writing
        data = self._read(key)
        if data is None:
            return False
        try:
            header, model_bytes = self._split(data, key)
        except Exception:  # noqa: BLE001 - a damaged entry is left to the next load
            return False
        if header.get("kernel_choice") == found:  # another process wrote them meanwhile
            self._decisions[key] = found
            return False
        header["kernel_choice"] = found
        if not self._write(key, json.dumps(header, sort_keys=True).encode("utf-8"), model_bytes):
            return False
        self._decisions[key] = found
        return True

    def _write(self, key: str, header: bytes, model_bytes: bytes) -> bool:
        """Write ``key``'s entry atomically; False where the folder is unsafe or unwritable."""
        body = str(len(header)).encode() + b"\n" + header + model_bytes
        blob = _MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body
        if not self._safe_folder(create=True):
            return False
        try:
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=_SUFFIX, dir=self.path)
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
            return False
        return True

    def _warn(self, message: str) -> None:
        # folder-level problems repeat on every export: say them once
        once = "ORTMODULE_CACHE_DIR=" in message
        if once and message in self._warned:
            return
        if once:
            self._warned.add(message)
        warnings.warn(f"ORTModule: {message}", stacklevel=4)
