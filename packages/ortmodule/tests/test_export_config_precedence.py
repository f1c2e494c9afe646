"""Recompute and Triton want the engine's own nodes: the speed defaults step aside for them."""

from __future__ import annotations

import pytest

from ortmodule.options import RuntimeOptions, variables
from ortmodule.runner_config import export_config


def _config(**environ: str):  # type: ignore[no-untyped-def]
    return export_config(RuntimeOptions.resolve(None, environ=environ))


def test_defaults_fuse_attention_and_choose_kernels_by_measurement() -> None:
    config = _config()
    assert config.aten_sdpa_fallback and config.kernel_choice == "auto"


@pytest.mark.parametrize(
    ("environ", "fused_attention"),
    [
        # the levels keep fused attention (its node keeps less than the decomposed attention);
        # a plan file may name the decomposed attention's nodes
        ({"ORTMODULE_MEMORY_OPT_LEVEL": "1"}, True),
        ({"ORTMODULE_MEMORY_OPT_LEVEL": "2"}, True),
        ({"ORTMODULE_MEMORY_OPT_CONFIG": __file__}, False),
        ({"ORTMODULE_USE_TRITON": "1"}, False),
    ],
)
def test_recompute_and_triton_keep_the_engines_nodes(
    environ: dict[str, str], fused_attention: bool
) -> None:
    # the components declare what keeps the engine's nodes (Option.keeps_engine_nodes)
    (name,) = environ
    declared = name in {var.name for var in variables()}
    config = _config(**environ)
    if declared:
        assert config.aten_sdpa_fallback == fused_attention and config.kernel_choice == "losses"
    else:  # the component is not installed: the variable does nothing (a warning says so)
        assert config.aten_sdpa_fallback and config.kernel_choice == "auto"


def test_an_explicit_setting_wins() -> None:
    config = _config(
        ORTMODULE_MEMORY_OPT_LEVEL="1",
        ORTMODULE_FUSED_ATTENTION="1",
        ORTMODULE_KERNEL_CHOICE="TORCH",
    )
    assert config.aten_sdpa_fallback and config.kernel_choice == "torch"
