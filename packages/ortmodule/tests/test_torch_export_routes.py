"""The opt-in ATen routes and padding elimination on the torch_export frontend (issue #40):
attention as PyTorch's fused kernels (ORTMODULE_FUSED_ATTENTION, ORTMODULE_ATEN_SDPA_FALLBACK,
ORTMODULE_USE_EFFICIENT_ATTENTION), dropout with eager's masks (ORTMODULE_ATEN_DROPOUT), and
padding elimination, which starts from the fused attention node. The TorchScript frontend's
tests of the same options: test_fused_attention.py, test_reproducibility.py,
test_padding_elimination.py, ortmodule-exporter's test_aten_fallback.py. Fallback is disabled
(conftest)."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from hf_models import loss_only_case, padded_mlm_batch, trains_like_eager
from test_fused_attention import _train_both as train_attention
from test_reproducibility import _Dropouts
from torch import nn

from ortmodule import DebugOptions, ORTModule
from ortmodule_exporter.aten.token_rows import TAKE_ROWS
from ortmodule_exporter.onnx_graph import attribute
from ortmodule_testing.parity import assert_tree_close, clone_model
from ortmodule_testing.zoo import ZOO, LossOnly, ZooCase
from ortmodule_testing.zoo.gpt import GPTConfig, GPTDecoder

pytest.importorskip("onnxscript")

FLASH = "_scaled_dot_product_flash_attention_for_cpu"
#: the same kernel on token-major tensors (passes/attention_layout.py reads the Transposes)
FLASH_BSHD = "_ortmodule_flash_attention_bshd"
RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(autouse=True)
def _torch_export(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_EXPORTER", "torch_export")
    for name in (
        "ORTMODULE_ATEN_DROPOUT",
        "ORTMODULE_ATEN_SDPA_FALLBACK",
        "ORTMODULE_USE_EFFICIENT_ATTENTION",
        "ORTMODULE_FUSED_ATTENTION",
        "ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER",
    ):
        monkeypatch.delenv(name, raising=False)


def _graph(wrapped: ORTModule) -> Any:
    compiled = wrapped._runner.transitions.current(training=True, build_gradient=True)
    assert compiled is not None, "no training graph was built"
    return compiled


def _exported_ops(wrapped: ORTModule) -> list[str]:
    """Op types, an ATen node by its operator, of the graph as exported (before the build)."""
    nodes = _graph(wrapped).built.exported.model.graph.node
    return [attribute(n, "operator", "") or n.op_type for n in nodes]


def _built_ops(wrapped: ORTModule) -> list[str]:
    """The same of the built gradient graph."""
    return [
        attribute(n, "operator", "") or n.op_type for n in _graph(wrapped).built.model.graph.node
    ]


# -- attention ---------------------------------------------------------------------------------


class _Attention(nn.Module):
    """q, k, v projections and SDPA; ``mask`` picks the kind of mask."""

    def __init__(self, mask: str, d: int = 16, heads: int = 2, seq: int = 6) -> None:
        super().__init__()
        self.mask, self.heads = mask, heads
        # no bias: softmax ignores a key bias, whose gradient is rounding noise AdamW amplifies
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d // heads, d)
        # a learned additive bias (T5/ALiBi-like): its gradient must reach it
        self.bias = nn.Parameter(torch.randn(heads, seq, seq) * 0.1)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            y.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
            for y in self.qkv(x).chunk(3, dim=-1)
        )
        if self.mask == "none":
            y = F.scaled_dot_product_attention(q, k, v)
        elif self.mask == "causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.mask == "bool":  # True = attend
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        elif self.mask == "additive":  # HF style: finfo.min where padded
            add = (1.0 - keep[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=add)
        else:  # learned bias
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias[None])
        # per head: a (b, t, d) reshape of the transposed output is a view the translator's
        # retrace refuses after torch.onnx decomposes attention (the learned-bias case)
        return self.out(y)  # type: ignore[no-any-return]


def _train_both(mask: str, steps: int = 3, **options: Any) -> tuple[ORTModule, nn.Module]:
    """test_fused_attention's comparison, of :class:`_Attention` on this frontend."""
    return train_attention(
        mask, steps, make=_Attention, options=DebugOptions(exporter="torch_export", **options)
    )


@pytest.mark.parametrize("mask", ["causal", "bool", "additive"])
def test_attention_runs_fused_by_default_and_trains_like_eager(mask: str) -> None:
    ours, _ = _train_both(mask)
    exported = _exported_ops(ours)
    # fused, and the heads' Transposes read away (the kernel takes eager's strided views)
    assert FLASH_BSHD in exported and FLASH not in exported, exported
    assert "Softmax" not in exported


def test_a_mask_that_needs_a_gradient_stays_decomposed() -> None:
    ours, eager = _train_both("learned")
    assert not {FLASH, FLASH_BSHD} & set(_exported_ops(ours))
    assert eager.bias.grad is not None and ours.module.bias.grad is not None


def test_fused_attention_switched_off_the_engine_runs_attention(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ORTMODULE_FUSED_ATTENTION", "0")
    ours, _ = _train_both("causal", steps=1)
    exported = _exported_ops(ours)
    assert not {FLASH, FLASH_BSHD} & set(exported) and "Softmax" in exported


@pytest.mark.parametrize("mask", ["none", "bool"])
def test_sdpa_fallback_matches_eager(monkeypatch: pytest.MonkeyPatch, mask: str) -> None:
    # the fused default off: the fallback alone routes attention
    monkeypatch.setenv("ORTMODULE_FUSED_ATTENTION", "0")
    monkeypatch.setenv("ORTMODULE_ATEN_SDPA_FALLBACK", "1")
    ours, _ = _train_both(mask, steps=2)
    assert {FLASH, FLASH_BSHD} & set(_exported_ops(ours))
    # the registered gradient: PyTorch's flash attention backward
    assert {f"{FLASH}_backward", f"{FLASH_BSHD}_backward"} & set(_built_ops(ours))


class _Unfused(nn.Module):
    """Attention written out: Softmax(Q @ K^T / sqrt(d) + bias) @ V."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(4) + bias
        return (scores.softmax(-1) @ v).sum(1)


def test_efficient_attention_fuses_the_unfused_pattern(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_USE_EFFICIENT_ATTENTION", "1")
    torch.manual_seed(0)
    eager = _Unfused()
    ours = ORTModule(clone_model(eager))
    gen = torch.Generator().manual_seed(1)
    x, bias = torch.randn(2, 5, 8, generator=gen), torch.randn(2, 1, 5, 5, generator=gen)
    want, got = eager(x, bias), ours(x, bias)
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    for p_ours, p_eager in zip(ours.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p_ours.grad, p_eager.grad, rtol=RTOL, atol=ATOL)
    exported = _exported_ops(ours)
    assert {FLASH, FLASH_BSHD} & set(exported) and "Softmax" not in exported, exported


# -- dropout with eager's masks -----------------------------------------------------------------


class _FeatureDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.drop = nn.Dropout2d(0.4)
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.conv(x)))
        return self.head(h.mean(dim=(2, 3))).sum()  # type: ignore[no-any-return]


def _gpt() -> nn.Module:
    small = GPTConfig.small()
    # dropout 0.1 everywhere, attention's dropout_p (scaled_dot_product_attention) included
    return GPTDecoder(GPTConfig(**{**small.__dict__, "dropout": 0.1}))


_DROPOUT_CASES: dict[str, Any] = {
    "dropouts": (_Dropouts, lambda g: torch.randn(4, 8, generator=g), False),
    "dropout2d": (_FeatureDropout, lambda g: torch.randn(2, 3, 5, 5, generator=g), False),
    "gpt": (_gpt, lambda g: torch.randint(0, 128, (2, 16), generator=g), True),
}


def _record(model: nn.Module, inputs: list[torch.Tensor], labels: bool) -> list[object]:
    """Per step: the loss, every parameter's gradient and the generator's state after it."""
    torch.manual_seed(21)
    record: list[object] = []
    for x in inputs:
        out = model(x, labels=x) if labels else model(x)
        loss = out[0] if isinstance(out, tuple) else out
        grads = torch.autograd.grad(loss, list(model.parameters()))
        record.append((loss.detach(), [g.clone() for g in grads], torch.get_rng_state().float()))
    return record


@pytest.mark.parametrize("case", sorted(_DROPOUT_CASES))
def test_aten_dropout_draws_eagers_masks(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    monkeypatch.setenv("ORTMODULE_ATEN_DROPOUT", "1")
    make, draw, labels = _DROPOUT_CASES[case]
    gen = torch.Generator().manual_seed(0)
    inputs = [draw(gen) for _ in range(2)]
    torch.manual_seed(0)
    eager = make()
    ours = ORTModule(clone_model(eager))
    want = _record(eager, inputs, labels)
    got = _record(ours, inputs, labels)
    exported = _exported_ops(ours)
    assert "native_dropout" in exported and "Dropout" not in exported, exported
    if case == "dropouts":
        assert exported.count("native_dropout") == 3
    if case == "gpt":
        # attention with dropout_p runs in PyTorch (an AtenOp PythonOp: no gradient definition),
        # which draws its mask as eager does
        nodes = _graph(ours).built.exported.model.graph.node
        assert any("scaled_dot_product_attention" in str(n.attribute) for n in nodes)
    assert_tree_close(got, want, RTOL, ATOL)


def test_aten_dropout_on_a_hugging_face_model_draws_eagers_masks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GPT-2 with sdpa attention: dropout on the embeddings, the residuals and the attention
    probabilities (scaled_dot_product_attention's dropout_p), on padded batches."""
    monkeypatch.setenv("ORTMODULE_ATEN_DROPOUT", "1")
    config = tf.GPT2Config(
        vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2, attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    eager = LossOnly(tf.GPT2LMHeadModel(config))
    ours = ORTModule(clone_model(eager))

    def record(model: nn.Module) -> list[object]:
        torch.manual_seed(7)
        steps: list[object] = []
        for step in range(2):
            (ids, mask, labels), _ = padded_mlm_batch(step)
            loss = model(ids, mask, labels)
            grads = torch.autograd.grad(loss, list(model.parameters()))
            steps.append((loss.detach(), [g.clone() for g in grads], torch.get_rng_state().float()))
        return steps

    want, got = record(eager), record(ours)
    assert "native_dropout" in _exported_ops(ours)
    assert_tree_close(got, want, RTOL, ATOL)


def test_aten_dropout_p0_and_eval_draw_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_ATEN_DROPOUT", "1")
    torch.manual_seed(0)
    model = ORTModule(nn.Sequential(nn.Linear(8, 4), nn.Dropout(0.0), nn.Linear(4, 1)))
    torch.manual_seed(5)
    before = torch.get_rng_state()
    model(torch.ones(2, 8)).sum().backward()
    model.eval()
    with torch.no_grad():
        model(torch.ones(2, 8))
    assert torch.equal(torch.get_rng_state(), before)


# -- padding elimination --------------------------------------------------------------------------


def _decisions(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "padding elimination" in r.getMessage()]


@pytest.mark.parametrize("name", ["masked_lm", "hf_bert", "hf_llama"])
def test_padding_elimination_is_applied_and_training_matches_eager(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    monkeypatch.setenv("ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER", "1")
    # the zoo's masked LM, and Hugging Face models (sdpa attention) on padded batches
    case = loss_only_case(name.removeprefix("hf_")) if name.startswith("hf_") else ZOO[name]
    wrapped = trains_like_eager(case, 3, caplog)
    (decision,) = _decisions(caplog)
    assert decision.startswith("padding elimination on (mask input.attention_mask)"), decision
    assert TAKE_ROWS in _built_ops(wrapped)


@pytest.mark.parametrize("name", ["bert", "roberta"])
def test_padding_elimination_reads_a_classifiers_first_token_from_the_rows(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    """``hidden[:, 0]`` is a whole Slice of the batch axis, then a Gather: the Slice read as a
    node the analysis cannot follow, and the pass stayed off on this frontend."""
    from test_padding_elimination import _CLASSIFIERS, _classifier_batch  # the same cases

    monkeypatch.setenv("ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER", "1")
    case = ZooCase(
        f"hf_{name}_classifier", _CLASSIFIERS[name], _classifier_batch, lambda o, a, k: o.loss
    )
    wrapped = trains_like_eager(case, 3, caplog)
    (decision,) = _decisions(caplog)
    assert decision.startswith("padding elimination on (mask input.attention_mask)"), decision
    assert TAKE_ROWS in _built_ops(wrapped)


def test_padding_elimination_without_fused_attention_stays_off_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER", "1")
    monkeypatch.setenv("ORTMODULE_FUSED_ATTENTION", "0")
    with caplog.at_level(logging.INFO, logger="ortmodule"):
        trains_like_eager(ZOO["masked_lm"], 2, caplog)
    (decision,) = _decisions(caplog)
    assert decision.startswith("padding elimination off: no fused attention node"), decision
