"""Moved to :mod:`ortmodule_exporter.sparsity.token_rows`; this name stays for the tests'
imports (patch the functions there, not here)."""

from ..sparsity.token_rows import PUT_ROWS, TAKE_ROWS, put_rows, take_rows

__all__ = ["PUT_ROWS", "TAKE_ROWS", "put_rows", "take_rows"]
