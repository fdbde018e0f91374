"""server/compare/layout.py: framework storage layouts and shape compatibility."""

from __future__ import annotations

import numpy as np
import pytest

from twinstep.server.compare import layout


@pytest.mark.parametrize("module_type", ["Linear", "ColumnParallelLinear", "RowParallelLinear", "FusedLinear"])
def test_paddle_linear_weights_are_in_out(module_type):
    assert layout.is_in_out("paddle", module_type, "layers.0.fc.weight")
    assert layout.is_in_out("paddle", module_type, "weight")
    assert not layout.is_in_out("paddle", module_type, "layers.0.fc.bias")
    assert not layout.is_in_out("torch", module_type, "layers.0.fc.weight")


def test_other_modules_are_not_in_out():
    assert not layout.is_in_out("paddle", "Conv2D", "conv.weight")
    assert not layout.is_in_out("paddle", "Embedding", "embed.weight")
    assert not layout.is_in_out("paddle", "LayerNorm", "norm.weight")
    # the local name must be exactly "weight"
    assert not layout.is_in_out("paddle", "Linear", "fc.weight_scale")


def test_needs_transpose_decided_by_framework_and_module_type():
    torch_fc = ("torch", "Linear", "fc.weight")
    paddle_fc = ("paddle", "Linear", "fc.weight")
    assert layout.needs_transpose(torch_fc, paddle_fc)
    assert layout.needs_transpose(paddle_fc, torch_fc)
    assert not layout.needs_transpose(torch_fc, torch_fc)
    assert not layout.needs_transpose(paddle_fc, paddle_fc)
    assert not layout.needs_transpose(("torch", "Linear", "fc.bias"), ("paddle", "Linear", "fc.bias"))
    # a paddle Linear against a paddle tensor-parallel Linear: same layout
    assert not layout.needs_transpose(paddle_fc, ("paddle", "ColumnParallelLinear", "fc.weight"))
    # the module type, not the parameter name, decides
    assert not layout.needs_transpose(("torch", "Embedding", "fc.weight"), ("paddle", "Embedding", "fc.weight"))


def test_square_weight_transposed_although_shapes_match():
    n = 6
    rng = np.random.default_rng(0)
    w_torch = rng.normal(size=(n, n))  # [out, in]
    w_paddle = w_torch.T.copy()  # [in, out]
    transpose = layout.needs_transpose(("torch", "Linear", "fc.weight"), ("paddle", "Linear", "fc.weight"))
    assert transpose  # shapes alone (6x6 vs 6x6) could not tell
    assert layout.shapes_compatible(w_torch.shape, w_paddle.shape, transpose)
    a, b = layout.align(w_torch, w_paddle, transpose)
    np.testing.assert_array_equal(a, b)
    # without the transpose the same square weights are different numbers
    a, b = layout.align(w_torch, w_paddle, False)
    assert not np.array_equal(a, b)


def test_non_square_weight_shapes_with_and_without_transpose():
    assert layout.shapes_compatible((8, 4), (4, 8), True)
    assert not layout.shapes_compatible((8, 4), (4, 8), False)
    assert not layout.shapes_compatible((8, 4), (8, 4), True)
    w = np.arange(32.0).reshape(8, 4)
    a, b = layout.align(w, w.T.copy(), True)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (8, 4)


def test_equal_shapes_compatible():
    assert layout.shapes_compatible((2, 3, 4), (2, 3, 4), False)
    assert layout.shapes_compatible((), (), False)
    assert layout.shapes_compatible((5,), (5,), True)  # 1-D reversed is itself


@pytest.mark.parametrize("base,cand", [((1, 5, 8), (3, 5, 8)), ((3, 5, 8), (1, 5, 8)), ((5, 8), (3, 5, 8))])
def test_batch_broadcast_compatible_and_aligned(base, cand):
    assert layout.shapes_compatible(base, cand, False)
    rng = np.random.default_rng(1)
    small_shape = base if np.prod(base) < np.prod(cand) else cand
    x = rng.normal(size=small_shape)
    big = np.broadcast_to(x, base if small_shape is cand else cand).copy()
    a_in, b_in = (x, big) if small_shape is base else (big, x)
    a, b = layout.align(a_in, b_in, False)
    assert a.shape == b.shape == (3, 5, 8)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "base,cand",
    [((6, 4), (4, 6)), ((2, 5, 8), (3, 5, 8)), ((5, 8), (5, 9)), ((4,), (5,)), ((2, 3), (2, 3, 4))],
)
def test_incompatible_shapes(base, cand):
    assert not layout.shapes_compatible(base, cand, False)


@pytest.mark.parametrize("base,cand", [((8, 1), (1, 8)), ((1, 5, 1), (3, 1, 8))])
def test_mutual_broadcast_is_not_equivalent(base, cand):
    # [8,1] vs [1,8] (a transposed vector) would broadcast to [8,8]: not an equivalent broadcast
    assert not layout.shapes_compatible(base, cand, False)
