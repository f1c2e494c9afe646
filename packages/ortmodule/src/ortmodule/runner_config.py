"""RuntimeOptions -> the runner's configuration: the one place options reach the engine."""

from __future__ import annotations

import logging
import os

from ortmodule_exporter import ExportConfig, SaveOptions
from ortmodule_exporter.aten.kernel_choice import LOSSES
from ortmodule_exporter.aten.parallel import THREADS_AUTO

from .execution import RunnerConfig
from .log import engine_severity, exporter_verbose
from .options import DEFAULT, RuntimeOptions, keeps_engine_nodes

logger = logging.getLogger("ortmodule")


def runner_config(options: RuntimeOptions) -> RunnerConfig:
    save = None
    if options.save_onnx:
        save = SaveOptions(path=options.save_onnx_path or os.getcwd(), prefix=options.onnx_prefix)
    return RunnerConfig(
        opset=options.onnx_opset_version,
        export_config=export_config(options),
        deepcopy=options.deepcopy_before_model_export,
        cache_dir=options.cache_dir or None,
        save=save,
        enable_compute_optimizer=options.enable_compute_optimizer,
        print_input_density=options.print_input_density,
        label_sparsity=options.enable_compute_optimizer
        and options.enable_sparse_optimizer
        and options.enable_label_sparse_optimizer,
        padding_elimination=options.enable_compute_optimizer
        and options.enable_sparse_optimizer
        and options.enable_embedding_sparse_optimizer,
        engine_log_severity=engine_severity(options.log_level),
        exporter_verbose=exporter_verbose(options.log_level),
        conv_algo_search=options.conv_algo_search,
        cpu_mem_arena=options.cpu_mem_arena,
        torch_threads_in_engine=torch_threads_in_engine(options.torch_threads_in_engine),
        pass_options=component_options(options),
    )


def torch_threads_in_engine(value: str) -> int:
    """``ORTMODULE_TORCH_THREADS_IN_ENGINE`` as the sessions take it (``AUTO``: THREADS_AUTO)."""
    return THREADS_AUTO if value == "AUTO" else int(value)


def kernel_choice_threads(value: str) -> int:
    """The thread count the kernel choice times PyTorch's side at: under ``AUTO`` the count a
    graph's steps start with (1)."""
    return 1 if value == "AUTO" else int(value)


def export_config(options: RuntimeOptions) -> ExportConfig:
    """The options that change the exported graph, carried to every export of this module."""
    fused_attention, kernel_choice = options.fused_attention, options.kernel_choice.lower()
    graph_rewriters = keeps_engine_nodes(options)
    attention_rewriters = keeps_engine_nodes(options, attention=True)
    # Fused attention and PyTorch kernels become ATen nodes, which the engine's memory optimizer
    # cannot recompute (1.19.2 recomputes only its own nodes) and Triton's attention matcher
    # cannot see; the defaults step aside, an explicit setting stays. Recompute levels keep
    # fused attention: its node keeps only its output and logsumexp, where the decomposed
    # attention kept (batch, heads, tokens, tokens) tensors the levels did not recompute (GPT-2
    # 124M at level 1: steps peak 3539 -> 3110 MiB, step 7.04 -> 6.79 s). The loss, after
    # every layer, is never recomputed: the kernel choice still decides it.
    if attention_rewriters and options.source("fused_attention") == DEFAULT and fused_attention:
        fused_attention = False
        logger.info("%s: attention stays decomposed in the engine", attention_rewriters)
    if graph_rewriters and options.source("kernel_choice") == DEFAULT and kernel_choice == "auto":
        kernel_choice = LOSSES
        logger.info(
            "%s: every operator but the cross-entropy loss stays on the engine's kernels",
            graph_rewriters,
        )
    return ExportConfig(
        opset=options.onnx_opset_version,
        custom_autograd=options.enable_custom_autograd,
        allow_autograd_checkpoint=options.allow_autograd_checkpoint,
        aten_sdpa_fallback=options.aten_sdpa_fallback or fused_attention,
        efficient_attention=options.use_efficient_attention,
        aten_dropout=options.aten_dropout,
        kernel_choice=kernel_choice,
        kernel_choice_threads=kernel_choice_threads(options.torch_threads_in_engine),
        frontend=options.exporter,
    )


def component_options(options: RuntimeOptions) -> tuple[tuple[str, object], ...]:
    """Every ``ORTMODULE_*`` variable with its resolved value: what passes and components read."""
    return options.values()
