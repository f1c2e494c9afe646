"""The ``ORTMODULE_*`` variables ortmodule-memory acts on, declared here and nowhere else.

The runtime parses them with these declarations (``Component(options=OPTIONS)``), documents them
in ``docs/options.md`` and hands the parsed values to the component's passes, contributors and
hooks as ``options[NAME]``.

>>> MEMORY_OPT_LEVEL.convert("1"), MEMORY_OPT_LEVEL.debug_field
(1, 'memory_opt_level')
"""

from __future__ import annotations

from ortmodule_exporter.option import Option, existing_file, int_in, switch

__all__ = [
    "MEMORY_OPT_CONFIG",
    "MEMORY_OPT_LEVEL",
    "MEM_EFFICIENT_GRAD_MGMT",
    "OPTIONS",
    "PRINT_MEMORY_STATS",
]

DIST = "ortmodule-memory"
#: what recompute wants of the exported graph, named in the runtime's INFO line
_RECOMPUTE = "recompute (ORTMODULE_MEMORY_OPT_LEVEL/CONFIG)"

PRINT_MEMORY_STATS = switch(
    "ORTMODULE_PRINT_MEMORY_STATS",
    False,
    DIST,
    "Print memory statistics before and after forward and backward of each step.",
)
MEMORY_OPT_LEVEL = Option(
    "ORTMODULE_MEMORY_OPT_LEVEL",
    "int",
    0,
    int_in(0, 2),
    "0 (plans in ORTMODULE_MEMORY_OPT_CONFIG), 1 (recompute every transformer layer), "
    "2 (layers, compromised subgraphs included)",
    DIST,
    "Recompute level that trades compute for activation memory.",
    "1",
    debug_field="memory_opt_level",
    # the engine's memory optimizer (1.19.2) recomputes only its own nodes
    keeps_engine_nodes=_RECOMPUTE,
    # but a fused attention node keeps less than the decomposed attention the levels leave
    # stashed (a plan file may name the decomposed attention's nodes: it keeps them)
    fused_attention_stays=True,
)
MEMORY_OPT_CONFIG = Option(
    "ORTMODULE_MEMORY_OPT_CONFIG",
    "path",
    None,
    existing_file,
    "an existing JSON file of recompute plans",
    DIST,
    "Recompute plans applied at ORTMODULE_MEMORY_OPT_LEVEL=0.",
    "mem_opt.json",
    debug_field="memory_opt_config",
    keeps_engine_nodes=_RECOMPUTE,
)
MEM_EFFICIENT_GRAD_MGMT = switch(
    "ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT",
    False,
    DIST,
    "Hand each gradient to its parameter as soon as it is computed, freeing it early.",
)

#: in the order docs/options.md lists them
OPTIONS = (PRINT_MEMORY_STATS, MEMORY_OPT_LEVEL, MEMORY_OPT_CONFIG, MEM_EFFICIENT_GRAD_MGMT)
