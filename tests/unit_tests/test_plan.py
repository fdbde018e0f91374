"""Join plans: computed once per pair of record layouts, never reused for another layout."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.unit_tests.test_comparator import Rec, ctx, decoded, model_records
from twinstep.server.compare.comparator import StepComparison, compare_step
from twinstep.server.compare.plan import PlanCache
from twinstep.server.detect.noise import NoiseBands
from twinstep.server.compare.tolerance import METRICS


@pytest.fixture
def plans():
    """An empty plan cache, as a session holds one."""
    return PlanCache()


def _rows(result):
    return [dataclasses.astuple(r) for r in result.rows]


def test_a_warm_plan_gives_the_same_comparison_as_a_cold_one(plans):
    context = dataclasses.replace(ctx(), plans=plans)
    first = compare_step(decoded(model_records(0)), decoded(model_records(1)), context)
    assert (plans.misses, plans.hits) == (1, 0)
    again = compare_step(decoded(model_records(0)), decoded(model_records(1)), context)
    assert (plans.misses, plans.hits) == (1, 1)
    assert _rows(again) == _rows(first)
    plans._plans.clear()
    cold = compare_step(decoded(model_records(0)), decoded(model_records(1)), context)
    assert _rows(cold) == _rows(first) and plans.misses == 2


def test_a_changed_shape_gets_a_new_plan_and_is_seen(plans):
    context = dataclasses.replace(ctx(), plans=plans)
    base = model_records(0)
    assert compare_step(decoded(base), decoded(model_records(0)), context).first is None
    cand = model_records(0)
    cand[1] = Rec("forward", "layers.0", np.zeros((2, 4, 9), np.float32))
    result = compare_step(decoded(base), decoded(cand), context)
    assert plans.misses == 2
    assert (result.first.name, result.first.metric) == ("layers.0", "shape")


def test_a_changed_dtype_gets_a_new_plan_and_its_tolerances(plans):
    context = dataclasses.replace(ctx(), plans=plans)
    base = model_records(0)
    fp32 = compare_step(decoded(base), decoded(model_records(0)), context)
    bf16 = [dataclasses.replace(r, dtype="bfloat16") for r in model_records(0)]
    low = compare_step(decoded(base), decoded(bf16), context)
    assert plans.misses == 2
    assert {r.dtype for r in fp32.rows} == {"float32"} and {r.dtype for r in low.rows} == {"bfloat16"}
    assert all(b.tolerance >= a.tolerance for a, b in zip(fp32.rows, low.rows))


def test_another_mapping_gets_another_plan(plans):
    from twinstep.server.compare.mapping import NameMapping

    base, cand = decoded(model_records(0)), decoded(model_records(0, prefix="model."))
    unmapped = compare_step(base, cand, dataclasses.replace(ctx(), plans=plans))
    mapped = compare_step(base, cand, dataclasses.replace(ctx(mapping=NameMapping(prefix=[("model.", "")])), plans=plans))
    assert unmapped.unmatched_candidate and not mapped.unmatched_candidate
    assert plans.misses == 2


def test_vectorised_noise_bands_follow_the_per_record_rule():
    """Band: the largest finite value seen per key and metric.  Tolerance: multiple x band, at least
    floor x the default; the default for a key never seen.  Checked element by element."""
    rng = np.random.default_rng(3)
    multiple, floor = 5.0, 0.01
    bands = NoiseBands(multiple=multiple, floor_fraction=floor)
    keys = [("forward", f"m{i}", 0, 0) for i in range(40)]
    known = keys[:25]
    steps = []
    for step in range(3):
        comparison = StepComparison(step=step, rank=0, candidate_run="ref", rows=[object()] * len(known),
                                               keys=known)
        comparison.values = {m: np.where(rng.random(len(known)) < 0.2, np.nan, rng.random(len(known)) * 1e-5)
                             for m in METRICS}
        bands.add(comparison)
        steps.append(comparison.values)
    defaults = rng.random((len(METRICS), len(keys))) * 1e-3
    tolerances, band = bands.banded(bands.rows(keys), defaults)
    for k in range(len(keys)):
        for c, metric in enumerate(METRICS):
            if k >= len(known):
                assert (band[c, k], tolerances[c, k]) == (-1.0, defaults[c, k])
                continue
            seen = [values[metric][k] for values in steps if np.isfinite(values[metric][k])]
            expected_band = max(seen, default=0.0)
            assert band[c, k] == expected_band
            assert tolerances[c, k] == max(multiple * expected_band, floor * defaults[c, k])


def test_record_layouts_are_resolved_per_manifest():
    """Two streams may give one module id different names; a manifest that grows resolves what it lacked."""
    from twinstep.server.ingest.decode import decode_step
    from twinstep.server.ingest.manifest import Manifest
    from twinstep.server.errors import InputError
    from twinstep.v1 import twinstep_pb2 as pb
    from tests.unit_tests.test_comparator import build

    message, _ = build([Rec("forward", "fc", np.ones((2, 3), np.float32))])
    target = message.target[0]
    first, second, growing = Manifest(), Manifest(), Manifest()
    first.add(pb.Manifest(modules=[pb.ModuleInfo(id=target, name="fc", type="Linear")]))
    second.add(pb.Manifest(modules=[pb.ModuleInfo(id=target, name="proj", type="Linear")]))
    assert decode_step(message, first).names == ["fc"]
    assert decode_step(message, second).names == ["proj"]
    assert decode_step(message, first).names == ["fc"]  # cached, and still per manifest
    with pytest.raises(InputError, match="absent from the manifest"):
        decode_step(message, growing)
    growing.add(pb.Manifest(modules=[pb.ModuleInfo(id=target, name="late", type="Linear")]))
    assert decode_step(message, growing).names == ["late"]


def test_a_cached_layout_still_checks_each_steps_counts():
    from twinstep.server.ingest.decode import decode_step
    from twinstep.server.errors import InputError
    from tests.unit_tests.test_comparator import build

    message, manifest = build([Rec("forward", "fc", np.ones((2, 3), np.float32))])
    decode_step(message, manifest)
    message.stats.count[0] = 5
    with pytest.raises(InputError, match="counts 5 elements, shape \\[2, 3\\]"):
        decode_step(message, manifest)
