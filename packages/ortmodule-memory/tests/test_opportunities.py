"""Savings expressions to bytes, and the report's table."""

from __future__ import annotations

from ortmodule_memory.opportunities import (
    MemoryReport,
    dims_of_batch,
    evaluate_saving,
    opportunities_from_stat,
)

# as the engine writes them (CPU build 1.19.2)
GELU = "(((((input.input_ids_dim0)*(input.input_ids_dim1)*(128)) * 4 * 1.000000))) + (((((input.input_ids_dim0)*(input.input_ids_dim1)*(128)) * 4 * 1.000000)))"
UNKNOWN = "(((unknown * 4 * 1.000000))) + (((unknown * 4 * 1.000000)))"


def test_evaluate_saving_with_dotted_dim_names() -> None:
    dims = {"input.input_ids_dim0": 2, "input.input_ids_dim1": 16}
    assert evaluate_saving(GELU, dims) == 2 * (2 * 16 * 128 * 4)


def test_unnamed_dims_are_unknown_not_zero() -> None:
    assert evaluate_saving(UNKNOWN, {}) is None
    assert evaluate_saving("((empty_dim_param3)*(32)) * 4", {}) is None


def test_expressions_are_parsed_not_run() -> None:
    assert evaluate_saving("__import__('os').getpid()", {}) is None


def test_dims_of_batch() -> None:
    declared = [("input.x", ["input.x_dim0", 8]), ("w", [8, 8])]
    assert dims_of_batch(declared, {"input.x": (5, 8)}) == {"input.x_dim0": 5}


def test_report_rows_largest_first_and_totals() -> None:
    found = opportunities_from_stat(
        {"Gelu+:1:-1": (GELU, 2), "Where+:1:-1": (UNKNOWN, 2), "Cast+:2:-1": ("(4) * 2", 1)},
        {"input.input_ids_dim0": 2, "input.input_ids_dim1": 16},
    )
    assert [o.cluster_id for o in found] == ["Gelu+:1:-1", "Cast+:2:-1", "Where+:1:-1"]
    report = MemoryReport(1, "1:1", found, applied=("Gelu+:1:-1", "Cast+:2:-1"))
    assert report.saving_bytes() == 2 * 16384 + 8
    assert report.saving_bytes(applied_only=False) is None
    text = report.format()
    assert "Gelu+:1:-1" in text.splitlines()[2] and text.splitlines()[2].rstrip().endswith("yes")
    assert text.splitlines()[-1].rstrip().endswith("no")


def test_format_bytes() -> None:
    from ortmodule_memory.opportunities import format_bytes

    assert [format_bytes(n) for n in (512, 1536, 16 * 2**20, 3 * 2**30)] == [
        "512 B",
        "1.5 KiB",
        "16.0 MiB",
        "3.0 GiB",
    ]
