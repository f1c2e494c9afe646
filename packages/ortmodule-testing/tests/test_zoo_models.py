"""Every ZOO case trains in eager, deterministically; each model does what its docstring says."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

from ortmodule_testing.zoo import (
    ZOO,
    BertConfig,
    BertEncoder,
    DictIOModel,
    DictIOOutput,
    FrozenSubmoduleModel,
    GPTConfig,
    GPTDecoder,
    NonTensorArgsModel,
    ZooCase,
    bert_benchmark,
    gpt_benchmark,
    masked_lm_benchmark,
)

CASES = sorted(ZOO)
EXPECTED_KEYS = {"mlp", "cnn", "gpt", "bert", "masked_lm", "dict_io", "non_tensor_args", "frozen"}


def _loss(case: ZooCase, model: torch.nn.Module, step: int = 0) -> torch.Tensor:
    args, kwargs = case.make_batch(step)
    return case.loss_fn(model(*args, **kwargs), args, kwargs)


def _leaves(obj: Any) -> list[Any]:
    """Every non-container value, in order (tensors and Python values alike)."""
    if isinstance(obj, dict):
        return [leaf for value in obj.values() for leaf in _leaves(value)]
    if isinstance(obj, (list, tuple)):
        return [leaf for value in obj for leaf in _leaves(value)]
    return [obj]


def _structure(obj: Any) -> Any:
    """The batch with each tensor replaced by its (shape, dtype): what may not vary by step."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: _structure(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_structure(v) for v in obj)
    return obj


def test_zoo_has_the_agreed_keys() -> None:
    assert set(ZOO) == EXPECTED_KEYS
    for name, case in ZOO.items():
        assert case.name == name
        assert case.tolerance == (1e-4, 1e-5)


@pytest.mark.parametrize("name", CASES)
def test_case_trains_one_step_with_a_finite_scalar_loss(name: str) -> None:
    case = ZOO[name]
    model = case.build(seed=0).train()
    loss = _loss(case, model)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    assert math.isfinite(loss.item())
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert any(g is not None for g in grads)
    assert all(torch.isfinite(g).all() for g in grads if g is not None)


@pytest.mark.parametrize("name", CASES)
def test_no_parameter_has_a_gradient_that_is_only_rounding_noise(name: str) -> None:
    # A parameter the loss ignores by symmetry (a conv bias before BatchNorm, an attention key
    # bias) gets a gradient of ~1e-9 noise; Adam scales that to lr-sized steps that differ
    # between engines, so parity would fail for a reason that is no bug.
    case = ZOO[name]
    model = case.build(seed=0)
    _loss(case, model).backward()
    for param_name, p in model.named_parameters():
        if p.grad is not None:
            assert p.grad.abs().max() > 1e-6, f"{name}: {param_name}"


@pytest.mark.parametrize("name", CASES)
def test_case_is_deterministic_given_the_seed(name: str) -> None:
    case = ZOO[name]
    first, second = case.build(seed=0), case.build(seed=0)
    for (k1, v1), (k2, v2) in zip(
        first.state_dict().items(), second.state_dict().items(), strict=True
    ):
        assert k1 == k2 and torch.equal(v1, v2), k1
    assert _loss(case, first).item() == _loss(case, second).item()
    assert not torch.equal(
        next(iter(case.build(seed=1).parameters())), next(iter(first.parameters()))
    )


def test_build_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    ZOO["gpt"].build(seed=0)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", CASES)
def test_batches_depend_on_the_step_index_only(name: str) -> None:
    case = ZOO[name]
    again = case.make_batch(2)
    assert _structure(case.make_batch(2)) == _structure(again)
    for x, y in zip(_leaves(case.make_batch(2)), _leaves(again), strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    # Steps differ in tensor values only, never in structure or Python values.
    other = case.make_batch(3)
    assert _structure(other) == _structure(again)
    tensors = [
        (x, y)
        for x, y in zip(_leaves(other), _leaves(again), strict=True)
        if isinstance(x, torch.Tensor)
    ]
    assert any(not torch.equal(x, y) for x, y in tensors)


def test_make_batch_rejects_a_negative_step() -> None:
    with pytest.raises(ValueError, match="step index >= 0"):
        ZOO["mlp"].make_batch(-1)


def test_models_with_dropout_use_probability_zero_in_the_zoo() -> None:
    for name in CASES:
        for path, module in ZOO[name].build().named_modules():
            if isinstance(module, torch.nn.Dropout):
                assert module.p == 0.0, f"{name}: {path}"


def test_gpt_is_causal() -> None:
    model = GPTDecoder(GPTConfig.small()).eval()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 128
    with torch.no_grad():
        before, after = model(ids), model(changed)
    torch.testing.assert_close(after[:, :10], before[:, :10])
    assert not torch.allclose(after[:, 10:], before[:, 10:])


def test_gpt_returns_loss_and_logits_with_labels() -> None:
    model = GPTDecoder(GPTConfig.small())
    ids = torch.randint(0, 128, (2, 16))
    loss, logits = model(ids, labels=ids.clone())
    assert logits.shape == (2, 16, 128) and loss.dim() == 0
    # Labels are shifted inside: position t predicts token t + 1.
    expected = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1)
    )
    torch.testing.assert_close(loss, expected)


def test_bert_ignores_what_is_behind_the_padding_mask() -> None:
    model = BertEncoder(BertConfig.small()).eval()
    ids = torch.randint(2, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[:, 12:] = 0
    changed = ids.clone()
    changed[:, 12:] = 5
    with torch.no_grad():
        before = model(ids, mask)["logits"]
        after = model(changed, mask)["logits"]
    torch.testing.assert_close(after[:, :12], before[:, :12])
    assert set(model(ids, mask)) == {"logits"}


def test_bert_loss_ignores_unlabelled_positions_and_skips_padding_grads() -> None:
    case = ZOO["bert"]
    (input_ids, attention_mask), kwargs = case.make_batch(0)
    labels = kwargs["labels"]
    assert ((input_ids == 0) == (attention_mask == 0)).all()
    assert (labels[attention_mask == 0] == -100).all()
    model = case.build()
    out = model(input_ids, attention_mask, **kwargs)
    assert list(out) == ["loss", "logits"]
    out["loss"].backward()
    # padding_idx=0: the padding row neither starts non-zero nor gets a gradient.
    word = model.embeddings.word.weight
    assert torch.count_nonzero(word[0]) == 0 and torch.count_nonzero(word.grad[0]) == 0


def test_bert_can_tie_the_decoder_to_the_word_embeddings() -> None:
    from dataclasses import replace

    model = BertEncoder(replace(BertConfig.small(), tie_word_embeddings=True))
    assert model.mlm_head.decoder.weight is model.embeddings.word.weight


def test_dict_io_returns_a_model_output_without_none_fields() -> None:
    case = ZOO["dict_io"]
    (inputs,), kwargs = case.make_batch(0)
    model = DictIOModel()
    out = model(inputs, **kwargs)
    assert type(out) is DictIOOutput
    assert list(out.keys()) == ["loss", "logits", "hidden"]
    assert out[0] is out.loss is out["loss"]
    no_loss = model(inputs)
    assert list(no_loss.keys()) == ["logits", "hidden"] and no_loss.loss is None
    assert no_loss[0] is no_loss.logits
    # Masked positions contribute nothing.
    assert (out.hidden[~inputs["mask"]] == 0).all()
    with torch.no_grad():
        copied = copy.deepcopy(model(inputs, **kwargs))
    assert type(copied) is DictIOOutput and list(copied.keys()) == list(out.keys())
    assert torch.equal(copied.logits, out.logits) and copied["logits"] is copied.logits


def test_non_tensor_args_change_the_result() -> None:
    model = NonTensorArgsModel()
    x = torch.randn(4, 8)
    base = model(x)
    assert not torch.allclose(model(x, mode="gelu"), base)
    assert not torch.allclose(model(x, use_bias=False), base)
    assert not torch.allclose(model(x, scale=2.0), base)
    with pytest.raises(ValueError, match="unknown mode 'swish'"):
        model(x, mode="swish")


def test_non_tensor_args_case_leaves_the_unused_bias_without_grad() -> None:
    case = ZOO["non_tensor_args"]
    model = case.build()
    _loss(case, model).backward()
    assert model.fc1.bias.grad is None
    assert model.fc1.weight.grad is not None


def test_frozen_parts_get_no_grad_but_pass_it_through() -> None:
    case = ZOO["frozen"]
    model = case.build()
    assert isinstance(model, FrozenSubmoduleModel)
    _loss(case, model).backward()
    for name, p in model.named_parameters():
        trainable = name.startswith(("adapter.", "head."))
        assert p.requires_grad == trainable, name
        assert (p.grad is not None) == trainable, name


@pytest.mark.parametrize(("factory", "n_inputs"), [(gpt_benchmark, 1), (bert_benchmark, 2)])
def test_benchmark_sizes(factory: Any, n_inputs: int) -> None:
    make_model, make_batch = factory()
    args, kwargs = make_batch(0)
    assert len(args) == n_inputs and args[0].shape == (8, 128) and set(kwargs) == {"labels"}
    model = make_model()
    assert model.config.vocab_size == 1024 and model.config.d_model == 256
    assert model.config.n_layers == 4 and model.config.n_heads == 4
    if factory is bert_benchmark:
        attention_mask, labels = args[1], kwargs["labels"]
        assert (attention_mask == 0).any(), "the benchmark batch has padding"
        share = float((labels != -100).sum() / attention_mask.sum())
        assert 0.1 < share < 0.2


def test_masked_lm_benchmark_returns_only_the_loss() -> None:
    make_model, make_batch = masked_lm_benchmark()
    args, kwargs = make_batch(0)
    model = make_model()
    assert model.config.vocab_size == 8192 and not model.config.return_logits
    assert set(model(*args, **kwargs)) == {"loss"}
    share = float((kwargs["labels"] != -100).float().mean())
    assert 0.05 < share < 0.2  # well below the 90% where label sparsity is applied
