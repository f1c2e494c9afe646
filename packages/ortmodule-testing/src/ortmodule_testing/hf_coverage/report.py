"""``docs/models.md``: the coverage figure, failures grouped by cause, every model type's row.

    text = render(results, total_types=293, date="2026-11-26", machine="2-core CPU", note="")
    cause("RuntimeError: shape '[2, 12, 64]' is invalid for input of size 3072")
    # "RuntimeError: shape '[N, N, N]' is invalid for input of size N"

Coverage = model types that train under ORTModule with parity / model types that train in
eager (:data:`~.run_one.TRAINS_IN_EAGER`). A cause is an error's first line with what varies
between model types (numbers, class and module names, paths, addresses) blanked, so that one
bug in the exporter is one row however many model types it breaks.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable

from .run_one import STATUSES, TRAINS_IN_EAGER, Result

__all__ = ["cause", "coverage", "render"]

_BLANKS = (
    (re.compile(r"\btransformers\.models\.[\w.]+"), "<Model>"),
    (re.compile(r"0x[0-9a-fA-F]+"), "0x?"),
    (re.compile(r"(/[\w.\-]+)+\.(py|cc|cpp|h)(:\d+)?"), "<file>"),
    # a parameter or module path such as model.layers.0.self_attn.q_proj.weight
    (re.compile(r"'[\w]+(\.[\w]+){2,}'"), "'<name>'"),
    # an unquoted module path with a layer index: model.layers.0.self_attn
    (re.compile(r"\b[A-Za-z_]\w*(\.\w+)*\.\d+(\.\w+)*\b"), "<module>"),
    (re.compile(r"\b[A-Z]\w*(For\w+|Model|Config|PreTrainedModel)\b"), "<Model>"),
    (re.compile(r"\d+(\.\d+)?(e-?\d+)?"), "N"),
)
_CAUSE_LEN = 160


def cause(error: str, model_type: str = "") -> str:
    """``error`` with the parts that vary between model types blanked (see module docstring)."""
    text = error
    for pattern, blank in _BLANKS:
        text = pattern.sub(blank, text)
    if model_type:
        text = re.sub(rf"\b{re.escape(model_type)}\b", "<type>", text, flags=re.IGNORECASE)
    # what follows a source location is the engine's C++ stack: the same for every cause
    head, file, _ = text.partition("<file>")
    return (head + file)[:_CAUSE_LEN]


def coverage(results: Iterable[Result]) -> tuple[int, int]:
    """(model types with parity, model types that train in eager)."""
    results = list(results)
    good = sum(r.status == "parity" for r in results)
    return good, sum(r.status in TRAINS_IN_EAGER for r in results)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").replace("`", "'")


def _causes(results: list[Result], statuses: tuple[str, ...]) -> list[str]:
    groups: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        if r.status in statuses:
            groups[cause(r.error, r.model_type)].append(r)
    if not groups:
        return ["None.", ""]
    lines = [
        "| count | cause (first line, varying parts blanked) | model types |",
        "|---:|---|---|",
    ]
    for text, members in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        types = ", ".join(sorted(f"`{r.model_type}`" for r in members))
        lines.append(f"| {len(members)} | `{_cell(text)}` | {types} |")
    return [*lines, ""]


def render(
    results: list[Result],
    total_types: int,
    date: str,
    machine: str,
    versions: str = "",
    note: str = "",
) -> str:
    """The markdown report of ``results`` out of ``total_types`` model types in the mappings."""
    good, trains = coverage(results)
    share = f"{100 * good / trains:.1f} %" if trains else "n/a"
    counts = Counter(r.status for r in results)
    by_task: dict[str, Counter[str]] = defaultdict(Counter)
    for r in results:
        by_task[r.task][r.status] += 1

    out = [
        "# Coverage of all of transformers",
        "",
        "Every model type of transformers' auto mappings (causal LM, masked LM, seq2seq LM, "
        "sequence classification, image classification; a type listed in several is trained "
        "under the first) is built tiny from its own configuration class (hidden 64, 2 layers, "
        "4 heads, vocabulary 128, dropout 0; see `ortmodule_testing/hf_coverage/shrink.py`), "
        "then trained 3 AdamW steps in PyTorch eager and under `ORTModule` "
        "(`ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE`) from the same weights on the same "
        "batches. Parity: every loss, first-step gradient and final parameter and buffer within "
        "rtol 1e-4, atol 1e-5 of eager; or, where that fails, each of them as close to the "
        "same training in float64 (eager, same weights and batches) as eager's own float32 "
        "values are, within 4x plus that tolerance (AdamW turns a rounding-level gradient "
        "element into a step of up to its learning rate; "
        "`ortmodule_testing.parity.against_float64`). There, a parameter whose float64 "
        "first-step gradient is 10x smaller than eager's own float32 error on it (its true "
        "gradient is below rounding: a bias a softmax ignores) has its gradient checked and "
        "not its final value; a gradient exactly 0 in both is checked like any other.",
        "",
        "Regenerate with `nox -s models` (or `python -m ortmodule_testing.hf_coverage --out "
        "docs/models.md`; `--only llama bert` for a few types).",
        "",
        f"Measured {date} on {machine}.{(' ' + versions) if versions else ''}",
        "",
    ]
    if note:
        out += [note, ""]
    out += [
        "## Coverage",
        "",
        f"**{good} / {trains} = {share}** of the model types that train in eager train under "
        f"ORTModule with parity ({len(results)} of the {total_types} model types in the "
        "mappings were run).",
        "",
        "| status | meaning | count |",
        "|---|---|---:|",
    ]
    meaning = {
        "parity": "trains under ORTModule, matches eager",
        "wrong": "trains under ORTModule, a value differs from eager",
        "engine-error": "eager trains, ORTModule raises",
        "engine-crash": "eager trains, ORTModule kills the process or hangs past the timeout",
        "eager-error": "the tiny model does not train in eager (not counted)",
        "not-built": "no tiny model: the configuration needs arguments, a package or a download",
    }
    out += [f"| {s} | {meaning[s]} | {counts.get(s, 0)} |" for s in STATUSES]
    out += ["", "| task | " + " | ".join(STATUSES) + " |", "|---|" + "---:|" * len(STATUSES)]
    for task, c in by_task.items():
        out.append(f"| {task} | " + " | ".join(str(c.get(s, 0)) for s in STATUSES) + " |")
    out += [
        "",
        "## Failures under ORTModule, by cause",
        "",
        "`engine-error`, `engine-crash` and `wrong` (for `wrong`, the first value that differs).",
        "",
        *_causes(results, ("engine-error", "engine-crash", "wrong")),
        "## Not training in eager, by cause",
        "",
        "The generic shrinking or the generic batch does not suit these model types; they are "
        "left out of the figure.",
        "",
        *_causes(results, ("eager-error",)),
        "## Not built, by cause",
        "",
        *_causes(results, ("not-built",)),
        "## Every model type",
        "",
        "| model type | task | class | status | seconds | error |",
        "|---|---|---|---|---:|---|",
    ]
    for r in sorted(results, key=lambda r: r.model_type):
        out.append(
            f"| `{r.model_type}` | {r.task} | {r.class_name} | {r.status} | {r.seconds:.0f} "
            f"| {_cell(r.error[:200])} |"
        )
    return "\n".join(out) + "\n"
