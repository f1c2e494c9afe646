"""An export is a function of its ExportConfig: the symbolic table is computed from it, and
applying it installs nothing into a module that another thread's export could read (issue #39)."""

from __future__ import annotations

import threading

import pytest
import torch

from ortmodule_exporter import export, python_op
from ortmodule_exporter.aten import kernel_choice
from ortmodule_exporter.aten import routes as aten_routes
from ortmodule_exporter.export.config import ExportConfig
from ortmodule_exporter.symbolics.registry import registered_symbolics, symbolic_table


def _defaults() -> tuple[object, ...]:
    """Everything an export without a config would read from the process."""
    return (
        kernel_choice.current_mode(),
        kernel_choice.current_torch_threads(),
        aten_routes.aten_routes(),
        python_op.custom_autograd_enabled(),
        python_op.allow_autograd_checkpoint(),
    )


def test_a_config_in_force_in_one_thread_is_invisible_to_another() -> None:
    config = ExportConfig(
        kernel_choice="torch",
        kernel_choice_threads=1,
        aten_dropout=True,
        aten_sdpa_fallback=True,
        custom_autograd=not python_op.custom_autograd_enabled(),
        allow_autograd_checkpoint=True,
    )
    before, symbolics = _defaults(), registered_symbolics()
    inside: list[object] = []
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        with config.applied():
            inside.append(_defaults())
            entered.set()
            release.wait(timeout=30)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert entered.wait(timeout=30)
        # while the other thread's config is in force, this thread reads the process's own
        assert _defaults() == before
        assert registered_symbolics() == symbolics
    finally:
        release.set()
        thread.join()
    mode, threads, routes, autograd, checkpoint = inside[0]  # type: ignore[misc]
    assert (mode, threads, autograd, checkpoint) == ("torch", 1, config.custom_autograd, True)
    assert routes.dropout and routes.sdpa_fallback and not routes.embedding
    assert _defaults() == before


def test_the_symbolic_table_is_a_function_of_the_config() -> None:
    base = registered_symbolics()
    plain = symbolic_table(ExportConfig())
    routed = symbolic_table(ExportConfig(kernel_choice="torch", aten_dropout=True))
    # the same config gives the same table, made once
    assert symbolic_table(ExportConfig()) is plain
    # the kernel choice covers GELU only when asked, over our own GELU symbolic
    assert plain["aten::gelu"] == base["aten::gelu"]
    gelu = routed["aten::gelu"].fn
    assert gelu is not base["aten::gelu"].fn
    assert gelu.__wrapped__ is kernel_choice.registry._COVERED["aten::gelu"].symbolic  # type: ignore[attr-defined]
    # the dropout route only with aten_dropout; the default routes always
    assert "aten::dropout" in routed and "aten::dropout" not in plain
    assert all(op in plain for op in aten_routes.DEFAULT_ROUTES)
    # computing tables registers nothing
    assert registered_symbolics() == base


def test_an_invalid_kernel_choice_is_refused_when_the_config_is_made() -> None:
    with pytest.raises(ValueError, match="kernel_choice='fast' is not one of auto, engine, torch"):
        ExportConfig(kernel_choice="fast")


def test_exports_of_two_configs_in_two_threads_each_write_their_own_graph() -> None:
    """GELU exported with the kernel choice ``torch`` is an ATen node, with ``engine`` ONNX;
    the two exports run at once and neither takes the other's."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    x = torch.randn(3, 4)
    graphs: dict[str, list[str]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run(mode: str) -> None:
        try:
            start.wait()
            for _ in range(3):
                exported = export(
                    module, (x,), training=True, config=ExportConfig(kernel_choice=mode)
                )
                ops = sorted(n.op_type for n in exported.model.graph.node)
                assert graphs.setdefault(mode, ops) == ops
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(m,)) for m in ("torch", "engine")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert "ATen" in graphs["torch"] and "ATen" not in graphs["engine"]
