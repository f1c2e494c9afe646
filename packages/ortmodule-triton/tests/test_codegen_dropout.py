"""Dropout and DropoutGrad: random masks cannot match numpy's, so the checks are what Dropout
promises: the kept elements are scaled exactly, the keep rate is near 1 - ratio, a fixed seed
repeats its mask, and DropoutGrad applies the same mask and scale."""

from __future__ import annotations

import numpy as np
import torch
from helpers import model
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

from ortmodule_triton import compile_subgraph


def dropout_model(seed: int | None, training: bool = True):
    attrs = {} if seed is None else {"seed": seed}
    return model(
        [h.make_node("Dropout", ["x", "ratio", "train"], ["y", "mask"], **attrs)],
        [("x", T.FLOAT, ["a", "b"])],
        [("y", T.FLOAT, ["a", "b"]), ("mask", T.BOOL, ["a", "b"])],
        [
            numpy_helper.from_array(np.array(0.25, dtype=np.float32), "ratio"),
            numpy_helper.from_array(np.array(training), "train"),
        ],
    )


def test_dropout_scales_kept_elements_and_keeps_about_three_quarters():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    y, mask = compile_subgraph(dropout_model(seed=7))(x)
    torch.testing.assert_close(
        y, torch.where(mask, x / 0.75, torch.zeros_like(x)), rtol=1e-6, atol=0
    )
    kept = mask.float().mean().item()
    assert abs(kept - 0.75) < 0.03, kept  # 4096 draws: 4 standard deviations


def test_fixed_seed_repeats_unseeded_draws_anew():
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    seeded = compile_subgraph(dropout_model(seed=3))
    assert torch.equal(seeded(x)[1], seeded(x)[1])
    unseeded = compile_subgraph(dropout_model(seed=None))
    torch.manual_seed(0)
    first = unseeded(x)[1]
    second = unseeded(x)[1]
    assert not torch.equal(first, second)
    torch.manual_seed(0)
    assert torch.equal(unseeded(x)[1], first)  # seeds come from torch's generator


def test_inference_mode_is_identity_with_a_full_mask():
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    y, mask = compile_subgraph(dropout_model(seed=1, training=False))(x)
    assert torch.equal(y, x) and bool(mask.all())


def test_dropout_grad_applies_mask_and_scale():
    gen = torch.Generator().manual_seed(3)
    dy, mask = torch.randn(6, 10, generator=gen), torch.rand(6, 10, generator=gen) > 0.3
    m = model(
        [h.make_node("DropoutGrad", ["dy", "mask", "ratio"], ["dx"], domain="com.microsoft")],
        [("dy", T.FLOAT, ["a", "b"]), ("mask", T.BOOL, ["a", "b"])],
        [("dx", T.FLOAT, ["a", "b"])],
        [numpy_helper.from_array(np.array(0.3, dtype=np.float32), "ratio")],
    )
    (dx,) = compile_subgraph(m)(dy, mask)
    torch.testing.assert_close(
        dx, torch.where(mask, dy / 0.7, torch.zeros_like(dy)), rtol=1e-6, atol=0
    )
