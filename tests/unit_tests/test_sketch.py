"""Count-sketches: the definition (twinstep.wire.sketch), the torch and paddle device
sketchers, and the server's estimates of rel_l2 and cosine from two sketches.

The numpy reference ``sketch_array`` hashes element by element; the device
sketchers use the blocked plan.  Statistical checks use fixed seeds, so they
are deterministic, with bounds a wrong estimator would break.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from twinstep.wire import sketch
from twinstep.runtime.capture.torch.sketch import TorchSketcher
from twinstep.server.compare import sketch as estimate
from twinstep.server.compare.metrics import from_tensors
from twinstep.wire.sketch import SketchSpec

os.environ.setdefault("OMP_NUM_THREADS", "1")
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="No ccache found")
    import paddle

from twinstep.runtime.capture.paddle.sketch import PaddleSketcher  # noqa: E402

RNG_SEED = 20240611
SPEC = SketchSpec()
# Sizes crossing every path: element by element (< direct_max), blocked with a
# tail, blocked with several float32 chunks (> BAG_ROWS * 2 * buckets blocks).
SIZES = [0, 1, 60, SPEC.direct_max - 1, SPEC.direct_max, SPEC.direct_max + 45,
         sketch.BAG_ROWS * 2 * SPEC.buckets * SPEC.block * 2 + 17]


def _rng() -> np.random.Generator:
    return np.random.default_rng(RNG_SEED)


def _sketchers(spec: SketchSpec = SPEC) -> dict:
    return {"torch": (TorchSketcher(spec), torch.from_numpy), "paddle": (PaddleSketcher(spec), paddle.to_tensor)}


def _sketch(framework: str, array: np.ndarray, spec: SketchSpec = SPEC, **kwargs) -> np.ndarray:
    sketcher, to_tensor = _sketchers(spec)[framework]
    out = sketcher.sketch(to_tensor(np.ascontiguousarray(array)), **kwargs)
    return sketcher.to_host([out])[0]


def _close(got: np.ndarray, want: np.ndarray, rel: float) -> None:
    """Equal up to ``rel`` of the sketch's scale (buckets are sums: compare to their rms)."""
    scale = max(float(np.sqrt(np.mean(np.square(want)))), 1e-300)
    np.testing.assert_array_less(np.abs(got - want), rel * scale + 1e-300)


# -- the definition --------------------------------------------------------------


def test_spec_validation():
    with pytest.raises(ValueError, match="sketch.buckets"):
        SketchSpec(buckets=8)
    with pytest.raises(ValueError, match="sketch.buckets"):
        SketchSpec(buckets=sketch.MAX_BUCKETS + 1)
    with pytest.raises(ValueError, match="sketch.seed"):
        SketchSpec(seed=-1)
    with pytest.raises(ValueError, match="sketch.seed"):
        SketchSpec(seed=2**64)


@pytest.mark.parametrize("buckets", [16, 64, 100, 256, 1024, 4096])
def test_block_length_is_a_prime_at_most_half_the_buckets(buckets):
    block = SketchSpec(buckets=buckets).block
    assert block <= min(64, buckets // 2)
    assert all(block % d for d in range(2, block))
    assert not any(all(p % d for d in range(2, p)) for p in range(block + 1, min(64, buckets // 2) + 1))


def test_buckets_and_signs_are_balanced_and_blocks_never_self_collide():
    spec = SketchSpec(buckets=256, seed=3)
    folded = sketch.folded_index(np.arange(2_000_000), spec)
    bucket, negative = folded // 2, folded % 2
    counts = np.bincount(bucket, minlength=256)
    assert abs(counts.mean() - 2_000_000 / 256) < 1e-9
    assert counts.std() < 3 * np.sqrt(2_000_000 / 256)  # ~multinomial spread, no dead buckets
    assert abs(negative.mean() - 0.5) < 0.002
    per_block = bucket[: (bucket.size // spec.block) * spec.block].reshape(-1, spec.block)
    assert all(len(set(row)) == spec.block for row in per_block[:2000])


def test_seed_changes_every_table():
    a = sketch.folded_index(np.arange(100_000), SketchSpec(seed=1))
    b = sketch.folded_index(np.arange(100_000), SketchSpec(seed=2))
    assert (a != b).mean() > 0.99


def test_tables_are_identical_in_another_process():
    spec = SketchSpec(buckets=128, seed=12345)
    positions = np.arange(0, 50_000_000, 4999)
    here = sketch.folded_index(positions, spec)
    values = np.sin(np.arange(100_000, dtype=np.float64))
    script = (
        "import numpy as np, sys\n"
        "from twinstep.wire import sketch\n"
        "spec = sketch.SketchSpec(buckets=128, seed=12345)\n"
        "np.save(sys.stdout.buffer, sketch.folded_index(np.arange(0, 50_000_000, 4999), spec))\n"
        "np.save(sys.stdout.buffer, sketch.sketch_array(np.sin(np.arange(100_000, dtype=np.float64)), spec))\n"
        "np.save(sys.stdout.buffer, sketch.fold_table(spec))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # Python's own hashing must play no part
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120, env=env, check=True)
    import io

    stream = io.BytesIO(out.stdout)
    np.testing.assert_array_equal(np.load(stream), here)
    np.testing.assert_array_equal(np.load(stream), sketch.sketch_array(values, spec))
    np.testing.assert_array_equal(np.load(stream), sketch.fold_table(spec))


def test_reference_sketch_is_the_signed_bucket_sum():
    spec = SketchSpec(buckets=32, seed=9)
    x = _rng().normal(size=1000)
    folded = sketch.folded_index(np.arange(1000), spec)
    want = np.zeros(32)
    for value, f in zip(x, folded):
        want[f // 2] += -value if f % 2 else value
    np.testing.assert_allclose(sketch.sketch_array(x, spec), want, rtol=1e-12, atol=1e-12)


def test_merge_of_shards_with_offsets_equals_the_whole():
    x = _rng().normal(size=200_003)
    cuts = [0, 7, 61 * 40 + 3, 100_000, 200_003]
    parts = [sketch.sketch_array(x[a:b], SPEC, offset=a) for a, b in zip(cuts, cuts[1:])]
    np.testing.assert_allclose(sketch.merge(parts), sketch.sketch_array(x, SPEC), rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="at least one"):
        sketch.merge([])


# -- device sketchers --------------------------------------------------------------


@pytest.mark.parametrize("framework", ["torch", "paddle"])
@pytest.mark.parametrize("numel", SIZES)
def test_device_sketch_matches_the_reference(framework, numel):
    x = _rng().normal(size=numel).astype(np.float32)
    _close(_sketch(framework, x), sketch.sketch_array(x, SPEC), rel=1e-6)


@pytest.mark.parametrize("framework", ["torch", "paddle"])
@pytest.mark.parametrize("offset", [5, SPEC.block * 1000, SPEC.group * 7, 10**10 + 1])
def test_device_shards_add_up_to_the_whole(framework, offset):
    x = _rng().normal(size=150_000).astype(np.float64)
    cut = 77_777
    whole = sketch.sketch_array(x, SPEC, offset=offset)
    parts = [_sketch(framework, x[:cut], offset=offset), _sketch(framework, x[cut:], offset=offset + cut)]
    _close(sketch.merge(parts), whole, rel=1e-12)


@pytest.mark.parametrize("numel", SIZES)
def test_paddle_before_3_2_without_new_zeros_sketches_the_same(monkeypatch, numel):
    """paddle 3.0 and 3.1 have no Tensor.new_zeros (the oldest test leg runs them natively)."""
    import paddle

    x = _rng().normal(size=numel).astype(np.float32)
    expected = _sketch("paddle", x)
    monkeypatch.delattr(paddle.Tensor, "new_zeros", raising=False)
    _close(_sketch("paddle", x), expected, rel=1e-12)


@pytest.mark.parametrize("numel", SIZES[1:])
def test_torch_and_paddle_agree_on_the_same_data(numel):
    x = _rng().normal(1.0, 3.0, size=numel).astype(np.float32)
    _close(_sketch("paddle", x), _sketch("torch", x), rel=1e-9)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64", "int32"])
def test_low_precision_and_integer_tensors(dtype):
    values = (_rng().normal(size=(200, 300)) * 50).astype(np.float32)
    t = torch.from_numpy(values).to(getattr(torch, dtype))
    p = paddle.to_tensor(values).astype(dtype)
    exact = t.to(torch.float64).numpy()  # the values as stored, widened
    want = sketch.sketch_array(exact, SPEC)
    torch_out = TorchSketcher(SPEC).sketch(t)
    paddle_out = PaddleSketcher(SPEC).sketch(p)
    assert torch_out.dtype == torch.float64 and str(paddle_out.dtype).endswith("float64")
    _close(torch_out.numpy(), want, rel=1e-6)
    # Against paddle's own stored values: paddle 3.0's CPU cast to float16 truncates where torch
    # rounds to nearest (half the elements differ by one unit), from 3.2 they agree.
    _close(paddle_out.numpy(), sketch.sketch_array(p.astype("float64").numpy(), SPEC), rel=1e-6)


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_linearity(framework):
    rng = _rng()
    a, b = rng.normal(size=(300, 400)), rng.normal(size=(300, 400))
    _close(_sketch(framework, a) - _sketch(framework, b), _sketch(framework, a - b), rel=1e-12)
    _close(_sketch(framework, 2.5 * a), 2.5 * _sketch(framework, a), rel=1e-12)


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_non_contiguous_tensor_is_read_in_logical_order(framework):
    x = _rng().normal(size=(500, 300)).astype(np.float32)
    tensor = torch.from_numpy(x).t() if framework == "torch" else paddle.transpose(paddle.to_tensor(x), [1, 0])
    sketcher = _sketchers()[framework][0]
    _close(sketcher.to_host([sketcher.sketch(tensor)])[0], sketch.sketch_array(x.T, SPEC), rel=1e-6)


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_nan_and_inf_poison_only_their_buckets(framework):
    x = _rng().normal(size=100_000)
    bad = {12: np.nan, 70_001: np.inf}
    for i, value in bad.items():
        x[i] = value
    got = _sketch(framework, x)
    poisoned = {int(sketch.folded_index(np.array([i]), SPEC)[0] // 2) for i in bad}
    assert set(np.flatnonzero(~np.isfinite(got))) == poisoned
    clean = x.copy()
    clean[list(bad)] = 0.0
    keep = np.ones(SPEC.buckets, bool)
    keep[list(poisoned)] = False
    _close(got[keep], sketch.sketch_array(clean, SPEC)[keep], rel=1e-9)


@pytest.mark.parametrize("shape", [(3, 5), (64, 64), (300, 300), (200, 700)])
def test_paddle_linear_weight_transposed_matches_torch_weight(shape):
    """A paddle Linear stores [in, out]; sketched with transpose=True it equals torch's [out, in]."""
    out_features, in_features = shape
    weight = _rng().normal(size=shape).astype(np.float32)  # torch layout [out, in]
    torch_linear = torch.nn.Linear(in_features, out_features)
    paddle_linear = paddle.nn.Linear(in_features, out_features)
    with torch.no_grad():
        torch_linear.weight.copy_(torch.from_numpy(weight))
        torch_linear.bias.zero_()
    paddle_linear.weight.set_value(np.ascontiguousarray(weight.T))
    paddle_linear.bias.set_value(np.zeros(out_features, np.float32))
    assert tuple(paddle_linear.weight.shape) == (in_features, out_features)

    inputs = _rng().normal(size=(16, in_features)).astype(np.float32)
    torch_linear(torch.from_numpy(inputs)).square().sum().backward()
    paddle_linear(paddle.to_tensor(inputs)).square().sum().backward()

    torch_sk, paddle_sk = TorchSketcher(SPEC), PaddleSketcher(SPEC)
    for t_tensor, p_tensor, rel in ((torch_linear.weight, paddle_linear.weight, 1e-9),
                                    (torch_linear.weight.grad, paddle_linear.weight.grad, 1e-5)):
        want = torch_sk.to_host([torch_sk.sketch(t_tensor)])[0]
        got = paddle_sk.to_host([paddle_sk.sketch(p_tensor, transpose=True)])[0]
        _close(got, want, rel=rel)
    if shape[0] == shape[1] and shape[0] > 3:
        # A square weight has the same shape either way: only transpose=True makes them agree.
        untransposed = paddle_sk.to_host([paddle_sk.sketch(paddle_linear.weight)])[0]
        want = torch_sk.to_host([torch_sk.sketch(torch_linear.weight)])[0]
        assert np.linalg.norm(untransposed - want) > 0.5 * np.linalg.norm(want)


def test_transpose_needs_a_matrix():
    with pytest.raises(ValueError, match="2-D"):
        TorchSketcher(SPEC).sketch(torch.zeros(2, 3, 4), transpose=True)
    with pytest.raises(ValueError, match="2-D"):
        PaddleSketcher(SPEC).sketch(paddle.zeros([2, 3, 4]), transpose=True)
    with pytest.raises(ValueError, match="2-D"):
        sketch.sketch_array(np.zeros(5), SPEC, transpose=True)


def test_plan_cache_is_bounded_and_rebuilds():
    sketcher = TorchSketcher(SPEC, max_plans=2)
    tensors = [torch.randn(SPEC.direct_max + 100 * k) for k in range(4)]
    first = sketcher.to_host([sketcher.sketch(tensors[0])])[0]
    for t in tensors[1:]:
        sketcher.sketch(t)
    assert len(sketcher._plans) == 2
    np.testing.assert_array_equal(sketcher.to_host([sketcher.sketch(tensors[0])])[0], first)
    assert sketcher.cached_bytes() > 0


# -- estimates (server) -------------------------------------------------------------


def _estimates(a: np.ndarray, b: np.ndarray, seeds: range, buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """rel_l2 and cosine-gap estimates of one pair under many seeds, with exact norms."""
    sa = np.stack([sketch.sketch_array(a, SketchSpec(buckets=buckets, seed=s)) for s in seeds])
    sb = np.stack([sketch.sketch_array(b, SketchSpec(buckets=buckets, seed=s)) for s in seeds])
    n = len(seeds)
    out = estimate.from_sketches(sa, sb, np.full(n, np.dot(a.ravel(), a.ravel())), np.full(n, np.dot(b.ravel(), b.ravel())))
    return out["rel_l2"], out["cosine"]


def _differences() -> dict[str, np.ndarray]:
    rng = _rng()
    shape = (96, 128)
    column = np.zeros(shape)
    column[:, 5] = rng.normal(size=96)
    sparse = np.zeros(shape)
    sparse.flat[rng.choice(column.size, 40, replace=False)] = rng.normal(size=40)
    return {
        "spread": rng.normal(size=shape),
        "one_column": column,
        "rank_one": np.outer(rng.normal(size=96), rng.normal(size=128)),
        "sparse": sparse,
        # Coherent differences: a blocked hash with one sign pattern for every
        # block gets 1.4x the modelled spread on these.
        "constant": np.ones(shape),
        "smooth": np.sin(np.arange(96 * 128) / 500.0).reshape(shape),
        "period_of_a_block": np.tile(rng.normal(size=SPEC.block), 96 * 128 // SPEC.block + 1)[: 96 * 128].reshape(shape),
        "per_row_offset": np.repeat(rng.normal(size=96), 128).reshape(shape),
    }


@pytest.mark.parametrize("kind", ["spread", "one_column", "rank_one", "sparse", "constant", "smooth",
                                  "period_of_a_block", "per_row_offset"])
@pytest.mark.parametrize("buckets", [64, 256])
def test_estimates_are_unbiased_with_the_modelled_spread(kind, buckets):
    rng = _rng()
    a = rng.normal(size=(96, 128))
    d = _differences()[kind]
    d *= 1e-3 * np.linalg.norm(a) / np.linalg.norm(d)
    b = a + d
    exact = from_tensors(a, b)
    rel, cos = _estimates(a, b, range(300), buckets)
    # E[estimate^2] = truth^2 for a count-sketch: the mean of 300 draws is within
    # 4 standard errors (sqrt(2/buckets)/sqrt(300)) of 1.
    tolerance = 4 * np.sqrt(2 / buckets) / np.sqrt(300)
    assert abs(np.mean((rel / exact["rel_l2"]) ** 2) - 1) < tolerance
    assert abs(np.mean(cos / exact["cosine"]) - 1) < tolerance + 1 / buckets  # numerator bias ~ -1/buckets
    # The spread never exceeds the model (by more than sampling error); a
    # difference in few elements collides less and is estimated better.
    spread_rel = np.std(rel / exact["rel_l2"] - 1) / estimate.relative_std("rel_l2", buckets)
    spread_cos = np.std(cos / exact["cosine"] - 1) / estimate.relative_std("cosine", buckets)
    assert spread_rel < 1.15 and spread_cos < 1.15
    if kind != "sparse":
        assert spread_rel > 0.8 and spread_cos > 0.8


def test_device_sketch_of_a_long_constant_difference_is_unbiased():
    """Elements K*L apart share the in-block sign w: only the block sign u keeps
    their collisions from adding up (without it this estimate is ~30% high)."""
    d = torch.full((300_000,), 0.5)
    ratios = []
    for seed in range(60):
        sketcher = TorchSketcher(SketchSpec(seed=seed))
        s = sketcher.to_host([sketcher.sketch(d)])[0]
        ratios.append(np.dot(s, s) / (0.25 * d.numel()))
    assert abs(np.mean(ratios) - 1) < 4 * np.sqrt(2 / 256) / np.sqrt(60)


def test_rescaled_tensor_has_zero_cosine_gap():
    a = _rng().normal(size=5000)
    s = sketch.sketch_array(a, SPEC)
    out = estimate.from_sketches(s, 1.5 * s, [np.dot(a, a)], [2.25 * np.dot(a, a)])
    assert out["cosine"][0] < 1e-12  # exact, whatever the sketch's own error
    sketch_only = estimate.from_sketches(s, 1.5 * s)
    assert sketch_only["cosine"][0] < 1e-12
    assert sketch_only["rel_l2"][0] == pytest.approx(0.5, rel=1e-12)
    same = estimate.from_sketches(s, s)
    assert same["rel_l2"][0] == 0.0 and same["cosine"][0] == 0.0


def test_zero_tensors_and_shape_checks():
    zero = np.zeros(SPEC.buckets)
    one = sketch.sketch_array(np.ones(100), SPEC)
    out = estimate.from_sketches(np.stack([zero, zero, one]), np.stack([zero, one, zero]))
    assert out["rel_l2"].tolist() == [0.0, np.inf, 1.0]
    assert out["cosine"].tolist() == [0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="shapes differ"):
        estimate.from_sketches(np.zeros((2, 8)), np.zeros((2, 16)))


def test_estimates_are_vectorised_over_records():
    rng = _rng()
    pairs = [(rng.normal(size=3000), rng.normal(size=3000)) for _ in range(4)]
    sa = np.stack([sketch.sketch_array(a, SPEC) for a, _ in pairs])
    sb = np.stack([sketch.sketch_array(b, SPEC) for _, b in pairs])
    together = estimate.from_sketches(sa, sb)
    for i in range(4):
        alone = estimate.from_sketches(sa[i], sb[i])
        assert together["rel_l2"][i] == alone["rel_l2"][0]
        assert together["cosine"][i] == alone["cosine"][0]


def test_non_finite_buckets_are_left_out():
    rng = _rng()
    a = rng.normal(size=50_000)
    b = a + 0.01 * rng.normal(size=50_000)
    exact = from_tensors(a, b)
    sa, sb = sketch.sketch_array(a, SPEC), sketch.sketch_array(b, SPEC)
    sb[[3, 100]] = [np.nan, np.inf]
    out = estimate.from_sketches(sa, sb, [np.dot(a, a)], [np.dot(b, b)])
    assert out["buckets"][0] == SPEC.buckets - 2
    assert out["rel_l2"][0] == pytest.approx(exact["rel_l2"], rel=5 * estimate.relative_std("rel_l2", 254))
    nothing = estimate.from_sketches(np.full(16, np.nan), np.zeros(16))
    assert nothing["buckets"][0] == 0 and np.isnan(nothing["rel_l2"][0])
    assert not estimate.significantly_above("rel_l2", nothing["rel_l2"], 1e-4, nothing["buckets"])[0]


@pytest.mark.parametrize("metric", ["rel_l2", "cosine"])
def test_significance_verdicts_have_the_promised_error_rates(metric):
    rng = _rng()
    a = rng.normal(size=(64, 96))
    b = a + 1e-3 * rng.normal(size=(64, 96))
    exact = from_tensors(a, b)[metric]
    rel, cos = _estimates(a, b, range(400), 256)
    est = rel if metric == "rel_l2" else cos
    # The truth sits exactly at the tolerance: "above" must be rare (nominal 0.13%).
    assert estimate.significantly_above(metric, est, exact, 256).mean() < 0.01
    # 30% above / below the tolerance: resolved nearly always at 256 buckets.
    margin = 1.3 if metric == "rel_l2" else 1.3**2
    assert estimate.significantly_above(metric, est, exact / margin, 256).mean() > 0.97
    assert estimate.significantly_below(metric, est, exact * margin, 256).mean() > 0.97
    assert estimate.significantly_below(metric, est, exact, 256).mean() < 0.01
    with pytest.raises(ValueError, match="no error model"):
        estimate.threshold("max_abs", 1.0, 256)


def test_sketch_only_norms_double_the_variance():
    assert estimate.relative_std("rel_l2", 256, exact_norms=False) == pytest.approx(
        np.sqrt(2) * estimate.relative_std("rel_l2", 256))
    assert estimate.threshold("rel_l2", 1.0, 256, exact_norms=False) > estimate.threshold("rel_l2", 1.0, 256)


def test_estimate_of_a_real_gelu_difference_between_torch_and_paddle():
    """Exact GELU in torch vs its tanh approximation in paddle, on the same activations."""
    x = _rng().normal(size=(8, 128, 512)).astype(np.float32)
    base = torch.nn.functional.gelu(torch.from_numpy(x))
    cand = paddle.nn.functional.gelu(paddle.to_tensor(x), approximate=True)
    exact = from_tensors(base.numpy(), cand.numpy())
    torch_sk, paddle_sk = TorchSketcher(SPEC), PaddleSketcher(SPEC)
    sa = torch_sk.to_host([torch_sk.sketch(base)]).astype(np.float32)  # float32, as on the wire
    sb = paddle_sk.to_host([paddle_sk.sketch(cand)]).astype(np.float32)
    b64, c64 = base.numpy().astype(np.float64).ravel(), cand.numpy().astype(np.float64).ravel()
    out = estimate.from_sketches(sa, sb, [np.dot(b64, b64)], [np.dot(c64, c64)])
    assert exact["rel_l2"] > 1e-4  # a real, small difference
    assert out["rel_l2"][0] == pytest.approx(exact["rel_l2"], rel=4 * estimate.relative_std("rel_l2", SPEC.buckets))
    assert out["cosine"][0] == pytest.approx(exact["cosine"], rel=4 * estimate.relative_std("cosine", SPEC.buckets))
