"""PyTorch's operator database (OpInfo) under ORTModule, one op at a time, against eager.

For each float32 CPU op with autograd, its first sample (and its first 0-d and first
zero-element sample, when it has them) runs through ``ORTModule`` with fallback disabled and
through eager from the same inputs; every output element, whether each float output requires
grad, and the gradient of a fixed random weighting of the outputs with respect to every floating
input must match (fp32: rtol 1e-4, atol 1e-5; NaN equals NaN, as the op's own eager result may
hold NaN).

It runs as a worker process: op names in on stdin, one JSON line per op out on stdout, so the
parent (``test_opinfo.py``) survives an op that kills the engine and reports it as that op's
failure. ``python opinfo_sweep.py OP [OP ...]`` runs the given ops here and prints the lines.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

os.environ["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"
os.environ.setdefault("ORTMODULE_LOG_LEVEL", "WARNING")
# the engine's own kernels: a timed choice (AUTO) would make an op's route vary between runs
os.environ["ORTMODULE_KERNEL_CHOICE"] = "ENGINE"

import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
#: how many samples of each op are examined to find its 0-d and zero-element cases
SAMPLE_SCAN = 24


def testable_ops() -> dict[str, Any]:
    """Every OpInfo entry (name.variant) that runs on CPU in float32 and supports autograd."""
    from torch.testing._internal.common_methods_invocations import op_db

    found: dict[str, Any] = {}
    for op in op_db:
        if not op.supports_autograd or torch.float32 not in op.supported_dtypes("cpu"):
            continue
        found[_name(op)] = op
    return found


def _name(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else str(op.name)


def _leaves(sample: Any) -> list[Any]:
    return list(pytree.tree_leaves((sample.input, sample.args, sample.kwargs)))


def _is_zero_d(sample: Any) -> bool:
    return isinstance(sample.input, torch.Tensor) and sample.input.dim() == 0


def _is_empty(sample: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.numel() == 0 for t in _leaves(sample))


def chosen_samples(op: Any) -> list[tuple[str, Any]]:
    """The first sample, then the first 0-d and the first zero-element one (if any)."""
    picked: list[tuple[str, Any]] = []
    want = {"0-d": _is_zero_d, "empty": _is_empty}
    torch.manual_seed(0)
    for i, sample in enumerate(op.sample_inputs("cpu", torch.float32, requires_grad=True)):
        if i == 0:
            picked.append(("first", sample))
        else:
            for kind, test in list(want.items()):
                if test(sample):
                    picked.append((kind, sample))
                    del want[kind]
                    break
        if not want or i >= SAMPLE_SCAN:
            break
    return picked


class OpModule(torch.nn.Module):
    """``op(sample)`` with the sample's tensors as the module's inputs, the rest as constants."""

    def __init__(self, op: Callable[..., Any], sample: Any) -> None:
        super().__init__()
        self.op = op
        leaves, self.spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        # where the tensors go among the leaves (None is a constant leaf too)
        self.slots = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        self.constants = [None if isinstance(v, torch.Tensor) else v for v in leaves]

    def forward(self, *tensors: torch.Tensor) -> Any:
        leaves: list[Any] = list(self.constants)
        for slot, tensor in zip(self.slots, tensors, strict=True):
            leaves[slot] = tensor
        first, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.op(first, *args, **kwargs)


def _inputs(sample: Any) -> list[torch.Tensor]:
    return [
        t.detach().clone().requires_grad_(t.requires_grad)
        for t in _leaves(sample)
        if isinstance(t, torch.Tensor)
    ]


def _float_outputs(out: Any) -> list[torch.Tensor]:
    return [
        t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]


def _weighted_sum(outputs: list[torch.Tensor]) -> torch.Tensor | None:
    """Every float output times its own random weights (drawn for each output, so which
    outputs require grad cannot shift the weights of the others), summed over those that do."""
    gen = torch.Generator().manual_seed(1234)
    weights = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outputs]
    terms = [(o * w).sum() for o, w in zip(outputs, weights, strict=True) if o.requires_grad]
    return torch.stack(terms).sum() if terms else None


def _graph_routes(model: Any) -> set[str]:
    """How the built training graph runs: 'aten' when it holds a node PyTorch runs."""
    from ortmodule_exporter.aten.executor import ATEN_DOMAIN

    graph = model._runner.transitions.current(True, True)
    if graph is None:
        return set()
    routes = set()
    for node in graph.built.exported.model.graph.node:
        if node.domain == ATEN_DOMAIN:
            routes.add("aten")
        elif node.op_type == "PythonOp":
            routes.add("aten")
    return routes


def run_sample(op: Any, sample: Any) -> set[str]:
    """Raise AssertionError (mismatch) or the engine's error; return the routes used."""
    from ortmodule import ORTModule

    eager_in, ort_in = _inputs(sample), _inputs(sample)
    module = OpModule(op.op, sample)
    eager_out = module(*eager_in)
    model = ORTModule(OpModule(op.op, sample))
    ort_out = model(*ort_in)
    e_leaves, e_spec = pytree.tree_flatten(eager_out)
    o_leaves, o_spec = pytree.tree_flatten(ort_out)
    if e_spec != o_spec:
        raise AssertionError(f"output structure {o_spec} != eager {e_spec}")
    for i, (o, e) in enumerate(zip(o_leaves, e_leaves, strict=True)):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(
                o, e, rtol=RTOL, atol=ATOL, equal_nan=True, msg=lambda m, i=i: f"output {i}: {m}"
            )
        elif o != e:
            raise AssertionError(f"output {i}: {o!r} != eager {e!r}")
    e_floats, o_floats = _float_outputs(eager_out), _float_outputs(ort_out)
    for i, (o, e) in enumerate(zip(o_floats, e_floats, strict=True)):
        if o.requires_grad != e.requires_grad:
            raise AssertionError(
                f"float output {i}: requires_grad is {o.requires_grad}, eager's {e.requires_grad}"
            )
    e_loss = _weighted_sum(e_floats)
    o_loss = _weighted_sum(o_floats)
    if e_loss is not None:
        if o_loss is None:
            raise AssertionError("ORTModule's outputs do not require grad, eager's do")
        e_loss.backward()
        o_loss.backward()
        for i, (o, e) in enumerate(zip(ort_in, eager_in, strict=True)):
            if not e.requires_grad:
                continue
            if e.grad is None:
                if o.grad is not None and o.grad.abs().sum() > 0:
                    raise AssertionError(f"grad of input {i}: eager has none, ORTModule nonzero")
                continue
            if o.grad is None:
                raise AssertionError(f"grad of input {i}: ORTModule gave none")
            torch.testing.assert_close(
                o.grad,
                e.grad,
                rtol=RTOL,
                atol=ATOL,
                equal_nan=True,
                msg=lambda m, i=i: f"grad of input {i}: {m}",
            )
    return _graph_routes(model)


def _outside_engine(op: Any, sample: Any) -> str | None:
    """Why the engine cannot take this op at all (complex or sparse tensors), or None."""
    try:
        out = op.op(sample.input, *sample.args, **sample.kwargs)
    except Exception:  # noqa: BLE001 - run_sample reports eager's own errors
        return None
    for t in [*_leaves(sample), *pytree.tree_leaves(out)]:
        if isinstance(t, torch.Tensor) and (t.is_complex() or t.layout != torch.strided):
            return f"{'complex' if t.is_complex() else 'sparse'} tensors: the engine takes dense real tensors"
    return None


def _is_random(op: Any) -> bool:
    """OpInfo runs random operators under a fixed seed (``wrapper_set_seed``)."""
    code = getattr(op.op, "__code__", None)
    return code is not None and "wrapper_set_seed" in code.co_names


def _short(text: str) -> str:
    """An error without the engine's C++ source locations and signatures."""
    text = re.sub(r"/onnxruntime_src/\S+ ", "", text)
    text = re.sub(r"\S*addObjectMethodsForTraining.*?\[ONNXRuntimeError\] : \d+ : ", "", text)
    text = re.sub(r"\S*GetGradientForOp\(.*?\) gradient_builder", "gradient_builder", text)
    return text.strip()


#: ops whose result changes from run to run, so no status can be recorded for them
UNSTABLE = {
    "linalg.pinv.singular": "unstable: on its zero-element sample the SVD sometimes reports "
    "non-finite input (uninitialised memory), in eager and under ORTModule alike",
}


def run_op(op: Any) -> dict[str, Any]:
    """{'status': 'native' | 'aten' | 'fail' | 'skip', 'error': first line, 'sample': kind}."""
    start = time.perf_counter()
    if _name(op) in UNSTABLE:
        return {"status": "skip", "error": UNSTABLE[_name(op)]}
    try:
        samples = chosen_samples(op)
    except Exception as err:  # noqa: BLE001 - OpInfo's own sample generator
        return {"status": "skip", "error": f"no samples: {err}"}
    if not samples:
        return {"status": "skip", "error": "no float32 samples on cpu"}
    outside = _outside_engine(op, samples[0][1])
    if outside:
        return {"status": "skip", "error": outside}
    routes: set[str] = set()
    for kind, sample in samples:
        try:
            routes |= run_sample(op, sample)
        except Exception as err:  # noqa: BLE001 - the failure is the result
            text = _short(f"{type(err).__name__}: {err}")
            if _is_random(op):
                # the engine draws its own random numbers: no element-by-element oracle
                return {"status": "skip", "error": f"random: {' '.join(text.split())[:200]}"}
            return {
                "status": "fail",
                "sample": kind,
                "error": " ".join(text.split())[:400],
                "trace": traceback.format_exc(limit=-4)[-2000:],
                "seconds": round(time.perf_counter() - start, 2),
            }
    return {
        "status": "aten" if "aten" in routes else "native",
        "samples": [k for k, _ in samples],
        "seconds": round(time.perf_counter() - start, 2),
    }


def serve() -> None:
    """Worker loop: an op name per stdin line, a JSON result per stdout line."""
    torch.set_num_threads(1)
    ops = testable_ops()
    out = sys.stdout
    # engine and exporter chatter must not mix with the protocol lines
    sys.stdout = sys.stderr
    print(json.dumps({"ready": sorted(ops)}), file=out, flush=True)
    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        result = run_op(ops[name]) if name in ops else {"status": "skip", "error": "unknown op"}
        print(json.dumps({"op": name, **result}), file=out, flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] != "--serve":
        torch.set_num_threads(1)
        all_ops = testable_ops()
        for op_name in sys.argv[1:]:
            res = run_op(all_ops[op_name])
            res.pop("trace", None) if res["status"] != "fail" else None
            print(json.dumps({"op": op_name, **res}, indent=1))
    else:
        serve()
