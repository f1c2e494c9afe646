"""Label-density flags: finding the loss's labels, measuring them, and the engine acting on the flag."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_engine_matches_eager
from torch import nn

from ortmodule_exporter import (
    ExportedModel,
    export,
    register_post_export_pass,
    unregister_post_export_pass,
)
from ortmodule_exporter.passes.density import (
    ENGINE_FLAG,
    PRINT_ONLY,
    DensityFlag,
    density_flags,
    embedding_sites,
    infer_symbolic_shapes,
    insert_density_flag,
    insert_embedding_density_print,
    label_density,
    label_sites,
    site_labels,
    strip_density_flags,
)
from ortmodule_exporter.python_op import REGISTRY

VOCAB, HIDDEN = 64, 16


class MaskedLM(nn.Module):
    """Embedding -> MLP head -> cross-entropy over the vocabulary; returns only the loss."""

    def __init__(
        self, shift: bool = False, reduction: str = "mean", padding_idx: int | None = None
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN, padding_idx=padding_idx)
        self.hidden = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.shift = shift
        self.reduction = reduction

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.head(torch.tanh(self.hidden(self.embed(ids))))
        if self.shift:  # a causal LM's "predict the next token"
            x, labels = x[:, :-1], labels[:, 1:]
        return F.cross_entropy(
            x.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction=self.reduction
        )


def _batch(density: float = 0.25, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (4, 8), generator=gen)
    chosen = torch.rand(4, 8, generator=gen) < density
    chosen[0, 1] = True  # never an empty loss
    return ids, torch.where(chosen, ids, -100)


def _export(model: nn.Module) -> ExportedModel:
    ids, labels = _batch()
    return export(model, (ids, labels), training=True)


def test_finds_the_cross_entropy_and_its_label_input() -> None:
    exported = _export(MaskedLM())
    (site,) = label_sites(exported.model)
    assert site.ignore_index == -100
    assert site.reduction == "mean"
    assert site.sources == ("input.labels",)
    loss = [n for n in exported.model.graph.node if n.name == site.node]
    assert loss[0].op_type == "SoftmaxCrossEntropyLoss"
    assert loss[0].input[1] == site.labels


def test_a_per_token_loss_is_not_a_site() -> None:
    # reduction="none" gives a loss per token: dropping rows would change its shape
    assert label_sites(_export(MaskedLM(reduction="none")).model) == []


@pytest.mark.parametrize("shift", [False, True])
def test_site_labels_are_what_the_loss_reads(shift: bool) -> None:
    exported = _export(MaskedLM(shift=shift))
    (site,) = label_sites(exported.model)
    ids, labels = _batch(seed=3)
    got = site_labels(exported.model, site, {"input.ids": ids, "input.labels": labels})
    want = (labels[:, 1:] if shift else labels).reshape(-1).numpy()
    assert got is not None
    np.testing.assert_array_equal(got, want)
    assert label_density(got, -100) == pytest.approx(float((want != -100).mean()))


def test_site_labels_need_the_inputs_they_come_from() -> None:
    exported = _export(MaskedLM())
    (site,) = label_sites(exported.model)
    assert site_labels(exported.model, site, {"input.ids": _batch()[0]}) is None


def test_label_density_of_no_labels_is_one() -> None:
    assert label_density(np.zeros((0,), dtype=np.int64), -100) == 1.0
    assert label_density(np.array([1, -100, -100, 2]), -100) == 0.5


def test_symbolic_shapes_keep_the_declared_type_of_an_aten_output() -> None:
    # bool & int32 is int32 in PyTorch (CPM-Ant's attention mask); the inference typed the
    # ATen node's output as its first input (bool), and the engine then refused the Equal
    # comparing it with an int32 constant
    h = onnx.helper
    graph = h.make_graph(
        [
            h.make_node("Cast", ["m"], ["b"], to=onnx.TensorProto.BOOL),
            h.make_node("ATen", ["b", "i"], ["and"], domain="org.pytorch.aten", operator="__and__"),
            h.make_node("Constant", [], ["zero"], value=h.make_tensor("z", 6, [], [0])),
            h.make_node("Equal", ["and", "zero"], ["out"]),
        ],
        "g",
        [
            h.make_tensor_value_info("m", onnx.TensorProto.FLOAT, ["b", 3]),
            h.make_tensor_value_info("i", onnx.TensorProto.INT32, ["b", 3]),
        ],
        [h.make_tensor_value_info("out", onnx.TensorProto.BOOL, None)],
        value_info=[h.make_tensor_value_info("and", onnx.TensorProto.INT32, [None, None])],
    )
    model = h.make_model(
        graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("org.pytorch.aten", 1)]
    )
    inferred = infer_symbolic_shapes(model)
    types = {vi.name: vi.type.tensor_type for vi in inferred.graph.value_info}
    assert types["and"].elem_type == onnx.TensorProto.INT32
    assert len(types["and"].shape.dim) == 2


@pytest.fixture
def flag_pass() -> Iterator[dict[str, Any]]:
    """A post-export pass that flags every label site; the test sets ``engine`` and ``emit``."""
    settings: dict[str, Any] = {"engine": True, "emit": False}

    def flag(exported: ExportedModel, _options: Any) -> None:
        for site in label_sites(exported.model):
            insert_density_flag(exported.model, site, **settings)
        exported.model = infer_symbolic_shapes(exported.model)

    register_post_export_pass("test_label_flag", flag, order=200)
    yield settings
    unregister_post_export_pass("test_label_flag")


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def test_engine_drops_ignored_labels_and_matches_eager(flag_pass: dict[str, Any]) -> None:
    torch.manual_seed(0)
    run = assert_engine_matches_eager(MaskedLM(), _batch())
    ops = _ops(run.built.model)
    # the engine acted on the flag: it removed it and gathers the counted rows before the loss
    assert "PythonOp" not in ops
    assert "ShrunkenGather" in ops
    assert "NonZero" in ops


def test_engine_keeps_a_printing_flag(
    flag_pass: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    flag_pass["emit"] = True
    torch.manual_seed(0)
    ids, labels = _batch(density=0.5, seed=1)
    with caplog.at_level(logging.WARNING, logger="ortmodule.density"):
        # the engine keeps the flag only when it is told densities are printed
        run = assert_engine_matches_eager(MaskedLM(), (ids, labels), print_input_density=True)
    ops = _ops(run.built.model)
    assert "ShrunkenGather" in ops and "PythonOp" in ops
    valid = int((labels != -100).sum())
    lines = [r.getMessage() for r in caplog.records if "input density" in r.getMessage()]
    assert len(lines) == 1
    assert f"({valid} of {labels.numel()})" in lines[0]
    assert f"{100 * valid / labels.numel():.2f} %" in lines[0]
    assert "LABEL labels (ignore_index -100)" in lines[0]


def test_print_only_flag_leaves_the_loss_alone(flag_pass: dict[str, Any]) -> None:
    flag_pass.update(engine=False, emit=True)
    torch.manual_seed(0)
    run = assert_engine_matches_eager(MaskedLM(), _batch())
    ops = _ops(run.built.model)
    assert "ShrunkenGather" not in ops
    assert "PythonOp" in ops


def test_strip_removes_only_silent_engine_flags() -> None:
    exported = _export(MaskedLM())
    (site,) = label_sites(exported.model)
    model = onnx.ModelProto()
    model.CopyFrom(exported.model)
    insert_density_flag(model, site, engine=True, emit=True)
    assert strip_density_flags(model, keep_printing=True) == 0
    assert strip_density_flags(model, keep_printing=False) == 1
    assert density_flags(model) == []
    (loss,) = [n for n in model.graph.node if n.name == site.node]
    assert loss.input[1] == site.labels  # rewired to the original labels
    onnx.checker.check_model(model)


def test_flagged_site_is_not_flagged_twice() -> None:
    exported = _export(MaskedLM())
    (site,) = label_sites(exported.model)
    insert_density_flag(exported.model, site, engine=False, emit=False)
    assert label_sites(exported.model) == []
    assert [n.name for n in density_flags(exported.model)] == [f"{site.node}/density_flag"]


def test_flag_names_belong_to_the_density_function() -> None:
    exported = _export(MaskedLM())
    (site,) = label_sites(exported.model)
    insert_density_flag(exported.model, site, engine=True, emit=False)
    assert REGISTRY.lookup(ENGINE_FLAG).cls is DensityFlag
    insert_density_flag(exported.model, site, engine=False, emit=False)
    assert REGISTRY.lookup(PRINT_ONLY).cls is DensityFlag

    class Other(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(ValueError, match="already belongs to"):
        REGISTRY.register(Other, name=ENGINE_FLAG)


def test_embedding_sites_need_a_padding_idx() -> None:
    plain = _export(MaskedLM())
    assert embedding_sites(plain.model, frozenset(plain.param_names)) == []
    padded = _export(MaskedLM(padding_idx=3))
    (site,) = embedding_sites(padded.model, frozenset(padded.param_names))
    assert site.padding_idx == 3 and site.sources == ("input.ids",) and site.indices == "input.ids"


def test_embedding_density_print_runs_in_the_engine(caplog: pytest.LogCaptureFixture) -> None:
    def flag(exported: ExportedModel, _options: Any) -> None:
        for site in embedding_sites(exported.model, frozenset(exported.param_names)):
            insert_embedding_density_print(exported.model, site, rank=2)

    register_post_export_pass("test_embedding_flag", flag, order=200)
    try:
        torch.manual_seed(0)
        ids, labels = _batch(seed=2)
        ids[:, 5:] = 3  # padding
        with caplog.at_level(logging.WARNING, logger="ortmodule.density"):
            run = assert_engine_matches_eager(MaskedLM(padding_idx=3), (ids, labels))
    finally:
        unregister_post_export_pass("test_embedding_flag")
    assert "PythonOp" in _ops(run.built.model)
    valid = int((ids != 3).sum())
    (line,) = [r.getMessage() for r in caplog.records if "input density" in r.getMessage()]
    assert f"EMBED ids (padding_idx 3): {100 * valid / ids.numel():.2f} % ({valid} of 32)" in line
