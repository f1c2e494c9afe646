"""The fusion config: which ops a Triton subgraph may take, in the user guide's JSON format.

::

    {
      "ops": {
        "Add": {"versions": [13, 14]},
        "Identity": {"versions": [13], "is_no_op": true},
        "ReduceSum": {"versions": [13], "conditions": {"axes": "[-1]"}},
        "SoftmaxGrad_13": {"domain": "com.microsoft", "versions": [1]}
      },
      "initializer": "scalar",
      "min_nodes": 2
    }

* ``versions``: the op's schema versions (``since_version``) that may be fused;
* ``domain``: the op's domain (default: ONNX's);
* ``is_no_op``: fused but not counted towards ``min_nodes``;
* ``conditions``: per attribute or input (``axis``, ``axes``, ...): the exact value as JSON text
  (``"[-1]"``), ``"single"`` (one axis) or ``"constant"`` (a constant input);
* ``initializer``: which constants a subgraph embeds: ``"none"``, ``"scalar"`` or ``"all"``;
* ``min_nodes``: the fewest counted nodes worth a kernel.

The guide's sample writes Python's ``True``; that spelling is accepted too. Without a file the
config is every op the code generator supports, any version, ``initializer="scalar"``,
``min_nodes=2``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import onnx.defs

from .errors import TritonConfigError
from .ops import MS_DOMAIN, OPS

__all__ = ["FusionConfig", "OpRule", "load_config"]


@dataclass(frozen=True)
class OpRule:
    domain: str = ""
    #: ``None``: any version
    versions: frozenset[int] | None = None
    is_no_op: bool = False
    conditions: Mapping[str, str] = field(default_factory=dict)
    ignore_min_nodes: bool = False


@dataclass(frozen=True)
class FusionConfig:
    ops: Mapping[tuple[str, str], OpRule]
    initializer: str = "scalar"
    min_nodes: int = 2

    @classmethod
    def default(cls) -> FusionConfig:
        return cls({key: OpRule(domain=key[0]) for key in OPS})

    def rule(self, node: onnx.NodeProto) -> OpRule | None:
        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        return self.ops.get((domain, node.op_type))

    def to_json(self) -> str:
        """The config as the engine's TritonFusion transformer reads it (CUDA build)."""
        ops: dict[str, Any] = {}
        # the format keys ops by name alone: where a name exists in two domains (Gelu), the
        # com.microsoft one wins, the one the engine's own fusions produce
        for (domain, op), rule in sorted(self.ops.items()):
            if not domain and (MS_DOMAIN, op) in self.ops:
                continue
            entry: dict[str, Any] = {"versions": sorted(rule.versions or _all_versions(domain, op))}
            if domain:
                entry["domain"] = domain
            if rule.is_no_op:
                entry["is_no_op"] = True
            if rule.conditions:
                entry["conditions"] = dict(rule.conditions)
            if rule.ignore_min_nodes:
                entry["ignore_min_nodes"] = True
            ops[op] = entry
        return json.dumps(
            {"ops": ops, "initializer": self.initializer, "min_nodes": self.min_nodes}
        )


def _all_versions(domain: str, op: str) -> set[int]:
    if domain:
        return {1}
    found = set()
    for version in range(1, onnx.defs.onnx_opset_version() + 1):
        try:
            found.add(onnx.defs.get_schema(op, version, "").since_version)
        except onnx.defs.SchemaError:
            continue
    return found


def since_version(node: onnx.NodeProto, opsets: Mapping[str, int]) -> int:
    """The schema version ``node`` resolves to under the model's opset imports."""
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    version = opsets.get(domain, 1)
    if domain:
        return version
    try:
        return int(onnx.defs.get_schema(node.op_type, version, "").since_version)
    except onnx.defs.SchemaError:
        return version


def _fail(where: str, what: str) -> TritonConfigError:
    return TritonConfigError(f"Triton fusion config {where}: {what}")


def parse_config(text: str, source: str = "<text>") -> FusionConfig:
    """Parse and validate a config; errors name the file, the key and what is accepted."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError:
        # the user guide's sample spells booleans the Python way
        try:
            raw = json.loads(re.sub(r"\bTrue\b", "true", re.sub(r"\bFalse\b", "false", text)))
        except json.JSONDecodeError as err:
            raise _fail(source, f"is not JSON ({err})") from None
    if not isinstance(raw, dict):
        raise _fail(source, "must be a JSON object with 'ops', 'initializer', 'min_nodes'")
    unknown = set(raw) - {"ops", "initializer", "min_nodes"}
    if unknown:
        raise _fail(source, f"unknown keys {sorted(unknown)}; known: ops, initializer, min_nodes")
    ops_raw = raw.get("ops", {})
    if not isinstance(ops_raw, dict) or not ops_raw:
        raise _fail(source, "'ops' must be a non-empty object of op name -> settings")
    ops: dict[tuple[str, str], OpRule] = {}
    for name, spec in ops_raw.items():
        where = f"{source} ops.{name}"
        if not isinstance(spec, dict):
            raise _fail(where, "must be an object with 'versions'")
        bad = set(spec) - {"versions", "domain", "is_no_op", "conditions", "ignore_min_nodes"}
        if bad:
            raise _fail(where, f"unknown keys {sorted(bad)}")
        domain = str(spec.get("domain", ""))
        domain = "" if domain == "ai.onnx" else domain
        if (domain, name) not in OPS:
            supported = ", ".join(f"{d + '::' if d else ''}{o}" for d, o in sorted(OPS))
            raise _fail(
                where,
                f"{domain or 'ai.onnx'}::{name} has no Triton code generator; supported: {supported}",
            )
        versions = spec.get("versions")
        if (
            not isinstance(versions, list)
            or not versions
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in versions)
        ):
            raise _fail(where, "'versions' must be a non-empty list of positive opset versions")
        conditions = spec.get("conditions", {})
        if not isinstance(conditions, dict) or not all(
            isinstance(v, str) for v in conditions.values()
        ):
            raise _fail(where, "'conditions' must map attribute/input names to strings")
        for key, value in conditions.items():
            if value not in ("single", "constant"):
                try:
                    json.loads(value)
                except json.JSONDecodeError:
                    raise _fail(
                        where,
                        f"condition {key}={value!r} must be 'single', 'constant' or a JSON value",
                    ) from None
        for flag in ("is_no_op", "ignore_min_nodes"):
            if not isinstance(spec.get(flag, False), bool):
                raise _fail(where, f"'{flag}' must be true or false")
        ops[(domain, name)] = OpRule(
            domain=domain,
            versions=frozenset(versions),
            is_no_op=bool(spec.get("is_no_op", False)),
            conditions=dict(conditions),
            ignore_min_nodes=bool(spec.get("ignore_min_nodes", False)),
        )
    initializer = raw.get("initializer", "scalar")
    if initializer not in ("none", "scalar", "all"):
        raise _fail(source, f"'initializer' is {initializer!r}; expected 'none', 'scalar' or 'all'")
    min_nodes = raw.get("min_nodes", 2)
    if not isinstance(min_nodes, int) or isinstance(min_nodes, bool) or min_nodes < 1:
        raise _fail(source, f"'min_nodes' is {min_nodes!r}; expected a positive integer")
    return FusionConfig(ops, initializer, min_nodes)


def load_config(path: Path | None) -> FusionConfig:
    """The config in ``path``, or the default one."""
    if path is None:
        return FusionConfig.default()
    return parse_config(Path(path).read_text(), str(path))
