"""server/compare/records.decode_step + comparator.compare_step on hand-built StepRecords."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from twinstep import codec, stats
from twinstep.server.compare.comparator import CompareContext, compare_step
from twinstep.server.compare.mapping import NameMapping
from twinstep.server.compare.records import Manifest, decode_step
from twinstep.server.compare.tolerance import ToleranceConfig
from twinstep.server.errors import InputError
from twinstep.v1 import twinstep_pb2 as pb

PHASE = {"forward": pb.FORWARD, "loss": pb.LOSS, "backward": pb.BACKWARD, "grad": pb.GRAD, "param": pb.PARAM}


@dataclass
class Rec:
    phase: str
    name: str  # module or parameter name ("loss" for the loss)
    value: np.ndarray
    type: str = "Linear"
    call: int = 0
    slot: int = 0
    dtype: str = "float32"
    payload: bool = False


def _manifest_message(records: list[Rec]) -> tuple[pb.Manifest, dict[tuple[str, str], int]]:
    """Manifest ids for the names used; modules in order of first appearance."""
    message = pb.Manifest()
    ids: dict[tuple[str, str], int] = {}
    for r in records:
        if r.phase in ("forward", "backward"):
            key = ("module", r.name)
            if key not in ids:
                ids[key] = len([k for k in ids if k[0] == "module"]) + 10  # ids need not start at 0
                message.modules.add(id=ids[key], name=r.name, type=r.type)
        elif r.phase in ("grad", "param"):
            key = ("param", r.name)
            if key not in ids:
                ids[key] = len([k for k in ids if k[0] == "param"]) + 100
                module = r.name.rsplit(".", 1)[0]
                message.parameters.add(
                    id=ids[key], name=r.name, module=module, module_type=r.type, shape=list(r.value.shape),
                    dtype=codec.DTYPE_TO_WIRE[r.dtype],
                )
    return message, ids


def build(records: list[Rec], step: int = 3, rank: int = 0) -> tuple[pb.StepRecords, Manifest]:
    message, ids = _manifest_message(records)
    manifest = Manifest()
    manifest.add(message)
    msg = pb.StepRecords(rank=rank, step=step)
    for i, r in enumerate(records):
        msg.phase.append(PHASE[r.phase])
        if r.phase in ("forward", "backward"):
            msg.target.append(ids[("module", r.name)])
        elif r.phase in ("grad", "param"):
            msg.target.append(ids[("param", r.name)])
        else:
            msg.target.append(0)
        msg.call_index.append(r.call)
        msg.slot.append(r.slot)
        msg.dtype.append(codec.DTYPE_TO_WIRE[r.dtype])
        msg.ndim.append(r.value.ndim)
        msg.dims.extend(r.value.shape)
        t = stats.of_array(r.value)
        msg.stats.count.append(int(t["count"][0]))
        for name in ("sum", "sum_sq", "min", "max", "abs_max"):
            getattr(msg.stats, name).append(float(t[name][0]))
        msg.stats.nan_count.append(int(t["nan_count"][0]))
        msg.stats.inf_count.append(int(t["inf_count"][0]))
        if r.payload:
            kind, data, n = codec.encode(np.asarray(r.value, dtype=codec.storage_dtype(r.dtype)))
            msg.tensors.add(record=i, codec=kind, data=data, raw_nbytes=n)
    return msg, manifest


def decoded(records: list[Rec], **kw):
    msg, manifest = build(records, **kw)
    return decode_step(msg, manifest)


def ctx(base="torch", cand="torch", mapping: NameMapping | None = None, tolerances: ToleranceConfig | None = None):
    return CompareContext(
        base_framework=base,
        cand_framework=cand,
        candidate_run="cand",
        tolerances=tolerances or ToleranceConfig(),
        mapping=mapping or NameMapping(),
    )


def _rng(seed=0):
    return np.random.default_rng(seed)


def model_records(seed=0, perturb: dict[str, float] | None = None, prefix: str = "") -> list[Rec]:
    """A small model's step: forward outputs, loss, backward, grads, params; grouped by phase."""
    rng = _rng(seed)
    perturb = perturb or {}
    values = {
        ("forward", "embed"): rng.normal(size=(2, 4, 8)),
        ("forward", "layers.0"): rng.normal(size=(2, 4, 8)),
        ("forward", "layers.1"): rng.normal(size=(2, 4, 8)),
        ("forward", "head"): rng.normal(size=(2, 4, 5)),
        ("loss", "loss"): np.array(2.5),
        ("backward", "head"): rng.normal(size=(2, 4, 5)) * 1e-3,
        ("backward", "layers.1"): rng.normal(size=(2, 4, 8)) * 1e-3,
        ("grad", "layers.1.weight"): rng.normal(size=(8, 8)) * 1e-2,
        ("grad", "layers.0.weight"): rng.normal(size=(8, 8)) * 1e-2,
        ("param", "layers.0.weight"): rng.normal(size=(8, 8)),
        ("param", "layers.1.weight"): rng.normal(size=(8, 8)),
    }
    records = []
    for (phase, name), value in values.items():
        key = f"{phase}:{name}"
        if key in perturb:
            value = value + perturb[key] * np.sqrt(np.mean(value**2))
        shown = name if phase == "loss" else prefix + name
        records.append(Rec(phase, shown, value.astype(np.float32), type="Embedding" if "embed" in name else "Linear"))
    return records


# -- decode_step -------------------------------------------------------------------


def test_decode_step_names_shapes_and_stats():
    records = model_records()
    data = decoded(records, step=7, rank=2)
    assert data.step == 7 and data.rank == 2
    assert len(data) == len(records)
    assert data.names == [r.name for r in records]
    assert data.shapes == [r.value.shape for r in records]
    assert data.dtypes == ["float32"] * len(records)
    assert data.types[0] == "Embedding" and data.types[1] == "Linear"
    for i, r in enumerate(records):
        ref = stats.of_array(r.value)
        for name in stats.FIELDS:
            assert data.table[name][i] == ref[name][0], (i, name)
    assert data.table["count"].dtype == np.int64
    assert data.nbytes > 0


def _error(msg, manifest, code=grpc.StatusCode.INVALID_ARGUMENT) -> str:
    with pytest.raises(InputError) as info:
        decode_step(msg, manifest)
    assert info.value.code == code
    return info.value.message


def test_decode_step_module_absent_from_manifest():
    msg, manifest = build(model_records())
    msg.target[2] = 999
    assert "record 2 names module id 999, absent from the manifest" in _error(msg, manifest)


def test_decode_step_parameter_absent_from_manifest():
    msg, manifest = build(model_records())
    i = list(msg.phase).index(pb.GRAD)
    msg.target[i] = 5
    assert f"record {i} names parameter id 5, absent from the manifest" in _error(msg, manifest)


@pytest.mark.parametrize("column", ["target", "call_index", "slot", "dtype", "ndim"])
def test_decode_step_column_length_mismatch(column):
    msg, manifest = build(model_records())
    getattr(msg, column).append(0)
    assert f"column {column} has" in _error(msg, manifest)


@pytest.mark.parametrize("column", ["count", "sum", "max", "nan_count"])
def test_decode_step_stats_column_length_mismatch(column):
    msg, manifest = build(model_records())
    del getattr(msg.stats, column)[-1]
    assert f"column stats.{column} has" in _error(msg, manifest)


def test_decode_step_count_disagrees_with_shape():
    msg, manifest = build(model_records())
    msg.stats.count[1] += 1
    text = _error(msg, manifest)
    assert "record 1 ('layers.0') counts 65 elements, shape [2, 4, 8]" in text


def test_decode_step_dims_do_not_add_up():
    msg, manifest = build(model_records())
    msg.dims.append(3)
    assert "ndim adds up to" in _error(msg, manifest)


def test_decode_step_negative_dim_unknown_dtype_phase_payload():
    msg, manifest = build(model_records())
    msg.dims[0] = -2
    assert "negative dimension" in _error(msg, manifest)
    msg, manifest = build(model_records())
    msg.dtype[0] = 77
    assert "unknown dtype 77" in _error(msg, manifest)
    msg, manifest = build(model_records())
    msg.phase[0] = pb.PHASE_UNSPECIFIED
    assert "unknown phase" in _error(msg, manifest)
    msg, manifest = build(model_records())
    msg.tensors.add(record=len(msg.phase), codec=pb.RAW, data=b"", raw_nbytes=0)
    assert "tensor payload for record" in _error(msg, manifest)


def test_manifest_redefinition_refused():
    manifest = Manifest()
    manifest.add(pb.Manifest(modules=[pb.ModuleInfo(id=1, name="a", type="Linear")]))
    manifest.add(pb.Manifest(modules=[pb.ModuleInfo(id=1, name="a", type="Linear")]))  # resend: fine
    assert manifest.module_order == ["a"]
    with pytest.raises(InputError, match="redefines module id 1"):
        manifest.add(pb.Manifest(modules=[pb.ModuleInfo(id=1, name="b", type="Linear")]))


# -- compare_step ------------------------------------------------------------------


def test_identical_steps_have_no_divergent_rows():
    base = decoded(model_records())
    cand = decoded(model_records())
    result = compare_step(base, cand, ctx())
    assert len(result.rows) == len(base)
    assert not any(row.divergent for row in result.rows)
    assert result.first is None
    assert result.unmatched_baseline == [] and result.unmatched_candidate == []
    assert result.errors == []
    for row in result.rows:
        assert row.value == 0.0
        assert row.tolerance >= 0


def test_perturbed_module_is_the_first_divergence():
    records = model_records()
    base = decoded(records)
    perturbed = model_records(perturb={"forward:layers.1": 1e-2, "grad:layers.0.weight": 1e-2})
    # The candidate produced its records in another order: rows follow the baseline.
    cand = decoded(list(reversed(perturbed)))
    result = compare_step(base, cand, ctx())
    assert [(row.phase, row.name) for row in result.rows] == [(r.phase, r.name) for r in records]
    divergent = [(row.phase, row.name) for row in result.rows if row.divergent]
    assert divergent == [("forward", "layers.1"), ("grad", "layers.0.weight")]
    first = result.first
    assert (first.phase, first.name, first.candidate_name) == ("forward", "layers.1", "layers.1")
    assert first.value > first.tolerance
    assert first.metric in ("mean", "rms", "extrema")
    assert first.type == "Linear"


def test_small_noise_below_tolerance_is_not_divergent():
    records = model_records()
    noisy = model_records(perturb={"forward:layers.1": 1e-7})
    result = compare_step(decoded(records), decoded(noisy), ctx())
    assert result.first is None


def test_bfloat16_records_get_looser_tolerance():
    x = _rng(3).normal(size=(4, 8))
    shifted = x + 1e-4 * np.sqrt(np.mean(x**2))  # mean metric ~1e-4: > fp32 forward 1e-5, < bf16's
    for dtype, expect in (("float32", True), ("bfloat16", False)):
        base = decoded([Rec("forward", "fc", x, dtype=dtype)])
        cand = decoded([Rec("forward", "fc", shifted, dtype=dtype)])
        assert compare_step(base, cand, ctx()).rows[0].divergent is expect, dtype


def test_renamed_candidate_matches_through_mapping():
    base = decoded(model_records())
    cand_records = model_records(prefix="model.")
    # ... and one module renamed outright (its parameters follow through the module path)
    for r in cand_records:
        r.name = r.name.replace("model.layers.1", "model.blocks.one")
    cand = decoded(cand_records)
    without = compare_step(base, cand, ctx())
    assert without.rows == [] or all(row.phase == "loss" for row in without.rows)
    assert "forward:embed" in without.unmatched_baseline
    assert "forward:model.embed" in without.unmatched_candidate
    mapping = NameMapping.from_dict(
        {"exact": {"model.blocks.one": "layers.1"}, "prefix": [{"candidate": "model.", "baseline": ""}]}
    )
    result = compare_step(base, cand, ctx(mapping=mapping))
    assert len(result.rows) == len(base)
    assert result.unmatched_baseline == [] and result.unmatched_candidate == []
    assert result.first is None
    by_name = {(row.phase, row.name): row.candidate_name for row in result.rows}
    assert by_name[("forward", "layers.1")] == "model.blocks.one"
    assert by_name[("param", "layers.1.weight")] == "model.blocks.one.weight"
    assert by_name[("forward", "embed")] == "model.embed"


def test_unmatched_names_listed_once():
    base_records = model_records() + [Rec("forward", "extra", np.ones(3, np.float32), call=1)]
    cand_records = model_records()
    cand_records = [r for r in cand_records if r.name != "head"]
    cand_records.append(Rec("forward", "bonus", np.ones(3, np.float32)))
    cand_records.append(Rec("forward", "bonus", np.ones(3, np.float32), call=1))
    result = compare_step(decoded(base_records), decoded(cand_records), ctx())
    assert result.unmatched_baseline == ["forward:head", "backward:head", "forward:extra"]
    assert result.unmatched_candidate == ["forward:bonus"]
    assert len(result.rows) == len(base_records) - 3
    assert result.first is None


def test_call_index_and_slot_join():
    x, y = _rng(1).normal(size=4), _rng(2).normal(size=4)
    base = decoded([Rec("forward", "m", x, call=0), Rec("forward", "m", y, call=1), Rec("forward", "m", y, slot=1)])
    cand = decoded([Rec("forward", "m", y, slot=1), Rec("forward", "m", y, call=1), Rec("forward", "m", x, call=0)])
    result = compare_step(base, cand, ctx())
    assert [(r.call_index, r.slot) for r in result.rows] == [(0, 0), (1, 0), (0, 1)]
    assert result.first is None
    swapped = decoded([Rec("forward", "m", y, call=0), Rec("forward", "m", x, call=1), Rec("forward", "m", y, slot=1)])
    result = compare_step(base, swapped, ctx())
    assert [(r.call_index, r.divergent) for r in result.rows] == [(0, True), (1, True), (0, False)]


def test_shape_mismatch_reports_shape_metric():
    x = _rng(4).normal(size=(4, 6))
    base = decoded([Rec("forward", "fc", x)])
    cand = decoded([Rec("forward", "fc", x.reshape(6, 4))])  # same numbers, other shape
    row = compare_step(base, cand, ctx()).rows[0]
    assert row.divergent and row.metric == "shape" and row.tolerance == 0.0
    assert row.value == 1.0


def _square_linear(cand_framework: str, cand_type: str = "Linear"):
    w = _rng(5).normal(size=(6, 6)).astype(np.float32)  # torch stores [out, in]
    base = decoded([Rec("param", "fc.weight", w, payload=True), Rec("grad", "fc.weight", w * 0.1, payload=True)])
    cand = decoded(
        [Rec("param", "fc.weight", w.T.copy(), type=cand_type, payload=True),
         Rec("grad", "fc.weight", (w * 0.1).T.copy(), type=cand_type, payload=True)]
    )
    return compare_step(base, cand, ctx(base="torch", cand=cand_framework))


def test_paddle_square_linear_weight_transposed_compares_equal():
    result = _square_linear("paddle")
    assert len(result.rows) == 2
    assert result.first is None, result.rows
    assert result.errors == []


def test_square_weight_transposed_without_layout_reason_diverges():
    # Same payloads, but both sides torch: the transposed numbers really differ.
    result = _square_linear("torch")
    assert result.first is not None
    assert result.first.metric in ("rel_l2", "cosine")
    # A paddle module type that is not in [in, out] layout: no transpose either
    assert _square_linear("paddle", cand_type="Embedding").first is not None


def test_broadcast_output_with_payloads_not_divergent():
    x = _rng(6).normal(size=(1, 4, 8)).astype(np.float32)
    big = np.broadcast_to(x, (3, 4, 8)).copy()
    base = decoded([Rec("forward", "rope", x, payload=True)])
    cand = decoded([Rec("forward", "rope", big, payload=True)])
    result = compare_step(base, cand, ctx())
    assert result.first is None, result.rows
    assert result.rows[0].metric != "shape"
    # and the element-wise metrics are really computed on the broadcast tensors
    wrong = big.copy()
    wrong[2] = -wrong[2]  # rms and extrema-preserving change of one batch entry
    result = compare_step(base, decoded([Rec("forward", "rope", wrong, payload=True)]), ctx())
    assert result.first is not None and result.first.metric in ("rel_l2", "cosine", "mean", "extrema")


def test_payload_only_on_one_side_uses_statistics():
    x = _rng(7).normal(size=(4, 4)).astype(np.float32)
    perm = x[::-1].copy()  # same statistics, different elements
    base = decoded([Rec("forward", "m", x, payload=True)])
    cand = decoded([Rec("forward", "m", perm)])
    assert compare_step(base, cand, ctx()).first is None
    both = decoded([Rec("forward", "m", perm, payload=True)])
    assert compare_step(base, both, ctx()).first is not None


def test_corrupt_payload_is_reported_not_raised():
    x = _rng(8).normal(size=(4, 4)).astype(np.float32)
    base = decoded([Rec("forward", "m", x, payload=True)])
    msg, manifest = build([Rec("forward", "m", x, payload=True)])
    msg.tensors[0].data = b"garbage"
    cand = decode_step(msg, manifest)
    result = compare_step(base, cand, ctx())
    assert len(result.errors) == 1 and "'m'" in result.errors[0]
    assert result.first is None  # statistics still agree


def test_nan_in_candidate_diverges_on_nonfinite():
    x = _rng(9).normal(size=16).astype(np.float32)
    y = x.copy()
    y[3] = np.nan
    row = compare_step(decoded([Rec("forward", "m", x)]), decoded([Rec("forward", "m", y)]), ctx()).rows[0]
    assert row.divergent and row.metric == "nonfinite"
    assert row.value == 1.0 and row.tolerance == 0.0


def test_loss_compared_with_loss_tolerance():
    base = decoded([Rec("loss", "loss", np.array(2.0, dtype=np.float32))])
    close = decoded([Rec("loss", "loss", np.array(2.0 * (1 + 1e-7), dtype=np.float32))])
    far = decoded([Rec("loss", "loss", np.array(2.001, dtype=np.float32))])
    assert compare_step(base, close, ctx()).first is None
    row = compare_step(base, far, ctx()).first
    assert row is not None and row.phase == "loss" and row.name == "loss"


def test_transposed_vector_is_a_shape_mismatch_not_a_broadcast():
    x = _rng(10).normal(size=(8, 1)).astype(np.float32)
    base = decoded([Rec("forward", "gate", x, payload=True)])
    cand = decoded([Rec("forward", "gate", x.reshape(1, 8), payload=True)])  # same statistics
    row = compare_step(base, cand, ctx()).rows[0]
    assert row.divergent and row.metric == "shape"
