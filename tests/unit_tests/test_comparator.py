"""server/ingest/decode.decode_step + comparator.compare_step on hand-built StepRecords."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from twinstep.wire import codec, stats
from twinstep.server.compare.comparator import CompareContext, compare_step
from twinstep.server.compare.mapping import NameMapping
from twinstep.server.ingest.decode import decode_step
from twinstep.server.ingest.manifest import Manifest
from twinstep.server.ingest.pieces import PieceCollector
from twinstep.server.compare.tolerance import ToleranceConfig
from twinstep.server.errors import InputError
from twinstep.v1 import twinstep_pb2 as pb

PHASE = {"forward": pb.FORWARD, "loss": pb.LOSS, "backward": pb.BACKWARD, "grad": pb.GRAD, "param": pb.PARAM,
         "input": pb.INPUT}


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
        if r.phase in ("forward", "backward", "input"):
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
    """A step's records and its manifest (records without full tensors: see build_with_pieces)."""
    msg, manifest, pieces = build_with_pieces(records, step, rank)
    assert not pieces, "records with payload=True travel as pieces: use build_with_pieces"
    return msg, manifest


def build_with_pieces(records: list[Rec], step: int = 3, rank: int = 0
                      ) -> tuple[pb.StepRecords, Manifest, list[pb.TensorPiece]]:
    """A step as a tensor-mode client sends it: its records, the manifest, and one piece per full tensor."""
    message, ids = _manifest_message(records)
    manifest = Manifest()
    manifest.add(message)
    msg = pb.StepRecords(rank=rank, step=step)
    pieces = []
    for i, r in enumerate(records):
        msg.phase.append(PHASE[r.phase])
        if r.phase in ("forward", "backward", "input"):
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
        for name in ("sum", "sum_sq", "min", "max", "abs_max", "m2"):
            getattr(msg.stats, name).append(float(t[name][0]))
        msg.stats.nan_count.append(int(t["nan_count"][0]))
        msg.stats.inf_count.append(int(t["inf_count"][0]))
        if r.payload:
            kind, data, n = codec.encode(np.asarray(r.value, dtype=codec.storage_dtype(r.dtype)))
            pieces.append(pb.TensorPiece(step=step, record=i, offset=0, numel=r.value.size, codec=kind, raw_nbytes=n,
                                         data=data))
    msg.tensor_pieces = len(pieces)
    return msg, manifest, pieces


def collected(pieces: list[pb.TensorPiece]) -> PieceCollector:
    """A stream's collector holding ``pieces``, as the server has it when their step's records arrive."""
    collector = PieceCollector(1 << 30)
    for piece in pieces:
        collector.add(piece)
    return collector


def decoded(records: list[Rec], **kw):
    msg, manifest, pieces = build_with_pieces(records, **kw)
    return decode_step(msg, manifest, collected(pieces))


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


def _error(msg, manifest, code=grpc.StatusCode.INVALID_ARGUMENT, pieces=()) -> str:
    with pytest.raises(InputError) as info:
        decode_step(msg, manifest, collected(list(pieces)))
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
    msg.tensor_pieces = 1
    beyond = pb.TensorPiece(step=msg.step, record=len(msg.phase), codec=pb.RAW)
    assert f"tensor piece for record {len(msg.phase)}, only" in _error(msg, manifest, pieces=[beyond])


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


def test_rows_are_made_on_demand_and_detectors_see_the_same_values_as_from_a_list():
    """compare_step's rows are arrays until read; a row read twice is one object, and the detectors'
    array paths (first divergence, parameter headroom, headroom) agree with their per-row paths."""
    import dataclasses

    from twinstep.server.compare.comparator import Rows, StepComparison
    from twinstep.server.detect.first_divergence import FirstDivergenceTracker
    from twinstep.server.detect.headroom import HeadroomTracker

    base = decoded(model_records())
    steps = []
    for step, size in enumerate((1e-7, 3e-6, 1e-2)):
        cand = decoded(model_records(perturb={"forward:layers.1": size, "param:layers.0.weight": size}), step=step)
        steps.append(compare_step(dataclasses.replace(base, step=step), cand, ctx()))
    fast_tracker, slow_tracker = FirstDivergenceTracker(), FirstDivergenceTracker()
    fast_headroom, slow_headroom = HeadroomTracker(), HeadroomTracker()
    for result in steps:
        assert isinstance(result.rows, Rows)
        first = result.first
        if first is not None:
            assert result.rows[result.rows.index(first)] is first
        fast_tracker.add(result)
        fast_headroom.add(result)
        as_list = StepComparison(step=result.step, rank=result.rank, candidate_run=result.candidate_run,
                                 rows=list(result.rows), values=result.values, tolerance=result.tolerance,
                                 keys=result.keys)
        assert list(result.rows) == as_list.rows and (first is None or first in as_list.rows)
        assert [result.rows[k] for k in range(len(result.rows))] == as_list.rows
        assert as_list.first == first
        slow_tracker.add(as_list)
        slow_headroom.add(as_list)
    assert fast_tracker._param_headroom == slow_tracker._param_headroom
    assert fast_tracker._best["cand"].key == slow_tracker._best["cand"].key
    assert fast_headroom.to_proto("cand") == slow_headroom.to_proto("cand")
    assert steps[-1].first.name == "layers.1"


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


def test_a_bfloat16_candidate_of_a_float32_baseline_is_judged_as_bfloat16():
    x = _rng(3).normal(size=(4, 8))
    shifted = x + 1e-4 * np.sqrt(np.mean(x**2))
    base = decoded([Rec("forward", "fc", x, dtype="float32")])
    cand = decoded([Rec("forward", "fc", shifted, dtype="bfloat16")])
    row = compare_step(base, cand, ctx()).rows[0]
    assert (row.divergent, row.dtype) == (False, "bfloat16")


def test_float32_records_of_a_mixed_precision_step_are_judged_as_its_low_precision():
    """A float32 norm output downstream of bfloat16 products carries their rounding."""
    x = _rng(4).normal(size=(4, 8))
    shifted = x + 1e-4 * np.sqrt(np.mean(x**2))
    matmul = _rng(5).normal(size=(4, 8))
    base = decoded([Rec("forward", "fc", matmul, dtype="bfloat16"), Rec("forward", "norm", x)])
    cand = decoded([Rec("forward", "fc", matmul, dtype="bfloat16"), Rec("forward", "norm", shifted)])
    norm = compare_step(base, cand, ctx()).rows[1]
    assert (norm.name, norm.divergent, norm.dtype) == ("norm", False, "bfloat16")
    # The same records in an all-float32 step are held to float32 tolerances.
    base32 = decoded([Rec("forward", "fc", matmul), Rec("forward", "norm", x)])
    cand32 = decoded([Rec("forward", "fc", matmul), Rec("forward", "norm", shifted)])
    assert compare_step(base32, cand32, ctx()).rows[1].divergent


def test_tf32_runs_loosen_float32_records_but_never_integer_ones():
    x = _rng(6).normal(size=(4, 8))
    shifted = x + 1e-4 * np.sqrt(np.mean(x**2))
    ids = np.arange(8).reshape(2, 4)
    base = decoded([Rec("input", "embed", ids, dtype="int64"), Rec("forward", "fc", x)])
    cand = decoded([Rec("input", "embed", ids + 1, dtype="int64"), Rec("forward", "fc", shifted)])
    context = ctx()
    context.tf32 = True
    rows = {r.name: r for r in compare_step(base, cand, context).rows}
    assert (rows["fc"].divergent, rows["fc"].dtype) == (False, "tf32")
    assert (rows["embed"].divergent, rows["embed"].dtype) == (True, "int64")


def test_renamed_candidate_matches_through_mapping():
    base = decoded(model_records())
    cand_records = model_records(prefix="model.")
    # ... and one module renamed outright (its parameters follow through the module path)
    for r in cand_records:
        r.name = r.name.replace("model.layers.1", "model.blocks.one")
    cand = decoded(cand_records)
    without = compare_step(base, cand, ctx())
    assert without.rows == [] or all(row.phase == "loss" for row in without.rows)
    assert "forward:embed" in map(str, without.unmatched_baseline)
    assert "forward:model.embed" in map(str, without.unmatched_candidate)
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
    assert list(map(str, result.unmatched_baseline)) == ["forward:head", "backward:head", "forward:extra"]
    assert [(label.phase, label.name) for label in result.unmatched_candidate] == [("forward", "bonus")]
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
    msg, manifest, pieces = build_with_pieces([Rec("forward", "m", x, payload=True)])
    pieces[0].data = b"garbage"
    cand = decode_step(msg, manifest, collected(pieces))
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


# -- fused groups: full tensors ----------------------------------------------------
# paddleformers' qkv_proj groups its output columns by KV head (models.fuse_qkv):
# [q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1]; 4 query heads, 2 KV heads.

from tests.ports import models  # noqa: E402  (numpy only: the real ports' fused layouts)

D = 3
HID = models.HEADS * D  # q_proj is square: its shape cannot tell [in, out] from [out, in]
QKV = {"candidate": r"attn\.qkv_proj", "baseline": ["attn.q_proj", "attn.k_proj", "attn.v_proj"]}


def fused_out(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """paddleformers' qkv_proj output [..., out] from the q/k/v outputs (via the ports' weight fusion)."""
    lead = q.shape[:-1]
    flat = [a.reshape(-1, a.shape[-1]).T for a in (q, k, v)]
    return models.fuse_qkv(*flat).reshape(*lead, -1)


def qkv_tensors(seed: int = 11) -> dict[str, np.ndarray]:
    """torch-side q/k/v outputs, output gradients, weights [out, in], biases, weight gradients."""
    rng = _rng(seed)
    out = {"q": HID, "k": models.KV_HEADS * D, "v": models.KV_HEADS * D}
    t = {}
    for x, n in out.items():
        t[f"y{x}"] = rng.normal(size=(2, 5, n)).astype(np.float32)
        t[f"dy{x}"] = (rng.normal(size=(2, 5, n)) * 1e-3).astype(np.float32)
        t[f"w{x}"] = rng.normal(size=(n, HID)).astype(np.float32)
        t[f"gw{x}"] = (rng.normal(size=(n, HID)) * 1e-2).astype(np.float32)
        t[f"b{x}"] = rng.normal(size=n).astype(np.float32)
    return t


def torch_parts(t: dict[str, np.ndarray], prefix: str = "attn") -> list[Rec]:
    recs = []
    for x in "qkv":
        name = f"{prefix}.{x}_proj"
        recs += [Rec("forward", name, t[f"y{x}"], payload=True), Rec("backward", name, t[f"dy{x}"], payload=True),
                 Rec("grad", f"{name}.weight", t[f"gw{x}"], payload=True),
                 Rec("param", f"{name}.weight", t[f"w{x}"], payload=True),
                 Rec("param", f"{name}.bias", t[f"b{x}"], payload=True)]
    return recs


def paddle_fused(t: dict[str, np.ndarray], prefix: str = "attn") -> list[Rec]:
    """The same numbers as paddleformers holds them: one qkv_proj, weights [in, out]."""
    name = f"{prefix}.qkv_proj"
    return [
        Rec("forward", name, fused_out(t["yq"], t["yk"], t["yv"]), payload=True),
        Rec("backward", name, fused_out(t["dyq"], t["dyk"], t["dyv"]), payload=True),
        Rec("grad", f"{name}.weight", models.fuse_qkv(t["gwq"], t["gwk"], t["gwv"]), payload=True),
        Rec("param", f"{name}.weight", models.fuse_qkv(t["wq"], t["wk"], t["wv"]), payload=True),
        Rec("param", f"{name}.bias", models.fuse_qkv(t["bq"][:, None], t["bk"][:, None], t["bv"][:, None])[0],
            payload=True),
    ]


def fused_mapping(rule: dict, **options) -> NameMapping:
    return NameMapping.from_dict({"fused": [{**rule, **options}]})


def metric_of(result, phase: str, name: str, metric: str = "rel_l2") -> float:
    """A row's value of ``metric`` (full-tensor metrics are only in ``values``); name on either side."""
    [k] = [k for k, row in enumerate(result.rows) if row.phase == phase and name in (row.name, row.candidate_name)]
    return float(result.values[metric][k])


FUSED_ROWS = [("forward", "attn.qkv_proj"), ("backward", "attn.qkv_proj"), ("grad", "attn.qkv_proj.weight"),
              ("param", "attn.qkv_proj.weight"), ("param", "attn.qkv_proj.bias")]


def test_fused_qkv_with_kv_head_groups_compares_full_tensors():
    t = qkv_tensors()
    base, cand = decoded(torch_parts(t)), decoded(paddle_fused(t))
    result = compare_step(base, cand, ctx("torch", "paddle", fused_mapping(QKV, groups=models.KV_HEADS)))
    assert result.unmatched_baseline == [] and result.unmatched_candidate == [] and result.errors == []
    assert len(result.rows) == len(FUSED_ROWS)
    assert result.first is None, result.rows
    for phase, name in FUSED_ROWS:
        assert metric_of(result, phase, name) == 0.0, (phase, name)
        assert metric_of(result, phase, name, "cosine") < 1e-12
        assert metric_of(result, phase, name, "shape") == 0.0
    # A plain [q | k | v] reading of the same tensors: statistics cannot tell, full tensors can.
    plain = compare_step(base, cand, ctx("torch", "paddle", fused_mapping(QKV)))
    for phase, name in FUSED_ROWS[:4]:  # the bias is per feature too, but check the big ones
        assert metric_of(plain, phase, name) > 0.5, (phase, name)
        assert metric_of(plain, phase, name, "rms") < 1e-6
    assert plain.first is not None and plain.first.metric in ("rel_l2", "cosine", "max_abs")


def test_fused_part_perturbed_gives_its_rel_l2():
    t = qkv_tensors()
    dk = (_rng(12).normal(size=t["yk"].shape) * 1e-2).astype(np.float32)
    cand_t = dict(t, yk=t["yk"] + dk)
    result = compare_step(decoded(torch_parts(t)), decoded(paddle_fused(cand_t)),
                          ctx("torch", "paddle", fused_mapping(QKV, groups=2)))
    norm = np.sqrt(sum(np.sum(t[f"y{x}"].astype(np.float64) ** 2) for x in "qkv"))
    diff = (t["yk"] + dk).astype(np.float64) - t["yk"]  # what float32 really holds
    assert metric_of(result, "forward", "attn.qkv_proj") == pytest.approx(np.linalg.norm(diff) / norm, rel=1e-6)
    assert metric_of(result, "forward", "attn.qkv_proj", "max_abs") == pytest.approx(np.abs(diff).max(), rel=1e-6)
    assert result.first is not None and result.first.phase == "forward"
    assert metric_of(result, "param", "attn.qkv_proj.weight") == 0.0


def test_fused_chunks_in_another_order_give_the_right_rel_l2():
    rng = _rng(13)
    gate, up = rng.normal(size=(2, 4, 16)).astype(np.float32), rng.normal(size=(2, 4, 16)).astype(np.float32)
    rule = {"candidate": r"mlp\.up_gate_proj", "baseline": ["mlp.gate_proj", "mlp.up_proj"]}
    base = decoded([Rec("forward", "mlp.gate_proj", gate, payload=True),
                    Rec("forward", "mlp.up_proj", up, payload=True)])
    swapped = decoded([Rec("forward", "mlp.up_gate_proj", np.concatenate([up, gate], -1), payload=True)])
    g, u = gate.astype(np.float64), up.astype(np.float64)
    expected = np.sqrt(2 * np.sum((g - u) ** 2)) / np.sqrt(np.sum(g**2) + np.sum(u**2))
    result = compare_step(base, swapped, ctx(mapping=fused_mapping(rule)))
    assert metric_of(result, "forward", "mlp.up_gate_proj") == pytest.approx(expected, rel=1e-9)
    assert result.first is not None
    # Listed in the fused tensor's order, the same tensors agree.
    listed = fused_mapping({**rule, "baseline": ["mlp.up_proj", "mlp.gate_proj"]})
    assert compare_step(base, swapped, ctx(mapping=listed)).first is None
    # groups = 2 interleaves halves: [g_0, u_0, g_1, u_1] is not [g | u]
    halves = np.concatenate([gate[..., :8], up[..., :8], gate[..., 8:], up[..., 8:]], -1)
    grouped = decoded([Rec("forward", "mlp.up_gate_proj", halves, payload=True)])
    assert metric_of(compare_step(base, grouped, ctx(mapping=fused_mapping(rule, groups=2))),
                     "forward", "mlp.up_gate_proj") == 0.0
    h = halves.astype(np.float64)
    concat = np.concatenate([g, u], -1)
    assert metric_of(compare_step(base, grouped, ctx(mapping=fused_mapping(rule))), "forward", "mlp.up_gate_proj") == (
        pytest.approx(np.linalg.norm(concat - h) / np.linalg.norm(concat), rel=1e-9)
    )


def _gate_up_weights(cand_framework: str, fused: np.ndarray, fused_type: str = "Linear"):
    rng = _rng(14)
    gate, up = rng.normal(size=(8, 8)).astype(np.float32), rng.normal(size=(8, 8)).astype(np.float32)  # square
    base = decoded([Rec("param", "mlp.gate_proj.weight", gate, payload=True),
                    Rec("param", "mlp.up_proj.weight", up, payload=True)])
    cand = decoded([Rec("param", "mlp.up_gate_proj.weight", fused(gate, up), type=fused_type, payload=True)])
    rule = {"candidate": r"mlp\.up_gate_proj", "baseline": ["mlp.gate_proj", "mlp.up_proj"]}
    result = compare_step(base, cand, ctx("torch", cand_framework, fused_mapping(rule)))
    return metric_of(result, "param", "mlp.up_gate_proj.weight"), result


def test_fused_square_weights_follow_each_sides_layout():
    # paddle Linear [in, out]: parts transposed, concatenated along the last axis (models.fuse_gate_up)
    value, result = _gate_up_weights("paddle", models.fuse_gate_up)
    assert value == 0.0 and result.first is None and result.errors == []
    # torch Linear [out, in]: concatenated along axis 0, no transpose
    value, result = _gate_up_weights("torch", lambda g, u: np.concatenate([g, u], 0))
    assert value == 0.0 and result.first is None
    # paddle weight that holds the parts untransposed: same shape [8, 16], other numbers
    value, result = _gate_up_weights("paddle", lambda g, u: np.concatenate([g, u], 1))
    assert value > 0.5 and result.first is not None and result.first.metric in ("rel_l2", "cosine", "max_abs")
    # a paddle module type not stored [in, out] is combined along axis 0: [8, 16] is then a shape divergence
    value, result = _gate_up_weights("paddle", models.fuse_gate_up, fused_type="Embedding")
    assert result.first is not None and result.first.metric == "shape"


def test_fused_side_on_the_baseline():
    t = qkv_tensors()
    rule = {"baseline": r"attn\.qkv_proj", "candidate": ["attn.q_proj", "attn.k_proj", "attn.v_proj"], "groups": 2}
    base = decoded(paddle_fused(t))
    mapping = NameMapping.from_dict({"fused": [rule]})
    result = compare_step(base, decoded(torch_parts(t)), ctx("paddle", "torch", mapping))
    assert result.unmatched_baseline == [] and result.unmatched_candidate == []
    assert result.first is None, result.rows
    assert [(r.phase, r.name, r.candidate_name) for r in result.rows][0] == (
        "forward", "attn.qkv_proj", "attn.{q_proj,k_proj,v_proj}")
    for phase, name in FUSED_ROWS:
        assert metric_of(result, phase, name) == 0.0, (phase, name)
    # k doubled in the candidate: rel_l2 is relative to the baseline, ||k|| / ||qkv||, not ||k|| / ||q, 2k, v||.
    doubled = decoded(torch_parts(dict(t, yk=t["yk"] * 2, wk=t["wk"] * 2)))
    result = compare_step(base, doubled, ctx("paddle", "torch", mapping))
    for phase, prefix in (("forward", "y"), ("param", "w")):
        name = "attn.qkv_proj" + (".weight" if phase == "param" else "")
        parts = [t[prefix + x].astype(np.float64) for x in "qkv"]
        expected = np.linalg.norm(parts[1]) / np.sqrt(sum(np.sum(p**2) for p in parts))
        assert metric_of(result, phase, name) == pytest.approx(expected, rel=1e-6), phase


@pytest.mark.parametrize("options", [{"groups": 4}, {"axis": 3}, {"axis": 0}])
@pytest.mark.parametrize("payload", [True, False])
def test_fused_parts_that_cannot_make_the_fused_tensor_are_a_shape_divergence(options, payload):
    # k and v have 6 features: 4 groups do not divide them; axis 3 does not exist; along axis 0 the rest differs.
    t = qkv_tensors()
    base = [r for r in torch_parts(t) if r.phase == "forward"]
    cand = [r for r in paddle_fused(t) if r.phase == "forward"]
    for r in base + cand:
        r.payload = payload
    result = compare_step(decoded(base), decoded(cand), ctx("torch", "paddle", fused_mapping(QKV, **options)))
    assert result.errors == []
    row = result.first
    assert row is not None and row.metric == "shape" and row.candidate_name == "attn.qkv_proj"


def test_fused_rule_axis_combines_outputs_along_another_axis():
    rng = _rng(15)
    a, b = rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=(5, 4)).astype(np.float32)
    rule = {"candidate": "cat", "baseline": ["a", "b"]}
    base = decoded([Rec("forward", "a", a, payload=True), Rec("forward", "b", b, payload=True)])
    cand = decoded([Rec("forward", "cat", np.concatenate([a, b], 0), payload=True)])
    assert compare_step(base, cand, ctx(mapping=fused_mapping(rule, axis=0))).first is None
    assert compare_step(base, cand, ctx(mapping=fused_mapping(rule, axis=-2))).first is None
    assert compare_step(base, cand, ctx(mapping=fused_mapping(rule))).first.metric == "shape"
    flipped = decoded([Rec("forward", "cat", np.concatenate([b, a], 0), payload=True)])
    assert metric_of(compare_step(base, flipped, ctx(mapping=fused_mapping(rule, axis=0))), "forward", "cat") > 0.5


def test_fused_corrupt_payload_is_reported_not_raised():
    t = qkv_tensors()
    msg, manifest, pieces = build_with_pieces(paddle_fused(t)[:1])
    pieces[0].data = b"garbage"
    result = compare_step(decoded(torch_parts(t)[:1] + torch_parts(t)[5:6] + torch_parts(t)[10:11]),
                          decode_step(msg, manifest, collected(pieces)), ctx("torch", "paddle", fused_mapping(QKV, groups=2)))
    assert len(result.errors) == 1 and "attn.{q_proj,k_proj,v_proj}" in result.errors[0]
    assert result.first is None  # statistics still agree


def test_fused_module_input_is_each_parts_input():
    x = _rng(16).normal(size=(2, 5, HID)).astype(np.float32)
    base = decoded([Rec("input", f"attn.{p}_proj", x) for p in "qkv"])
    result = compare_step(base, decoded([Rec("input", "attn.qkv_proj", x)]), ctx("torch", "paddle", fused_mapping(QKV)))
    assert [(r.phase, r.divergent) for r in result.rows] == [("input", False)]
    other = decoded([Rec("input", "attn.qkv_proj", x[:, :4])])  # another input: a shape divergence
    assert compare_step(base, other, ctx("torch", "paddle", fused_mapping(QKV))).rows[0].metric == "shape"


# -- sketches ------------------------------------------------------------------------


def sketched(records: list[Rec], spec=None, transpose: frozenset[str] = frozenset()):
    """A decoded step whose records all carry count-sketches (names in ``transpose`` sketched as their transpose)."""
    from twinstep.wire import sketch

    spec = spec or sketch.SketchSpec()
    msg, manifest = build(records)
    rows = [sketch.sketch_array(np.asarray(r.value, dtype=np.float32), spec, transpose=r.name in transpose)
            for r in records]
    msg.sketches.buckets = spec.buckets
    msg.sketches.seed = spec.seed
    msg.sketches.record.extend(range(len(records)))
    msg.sketches.values = np.asarray(rows, dtype="<f4").tobytes()
    return decode_step(msg, manifest)


def test_sketches_see_a_difference_no_statistic_can():
    """Rows swapped (a batch fed in another order): every statistic is identical, the fingerprint is not."""
    x = _rng(8).normal(size=(8, 64)).astype(np.float32)
    swapped = x[[1, 0, 2, 3, 4, 5, 6, 7]]
    result = compare_step(sketched([Rec("forward", "embed", x)]), sketched([Rec("forward", "embed", swapped)]), ctx())
    row = result.rows[0]
    assert result.values["rms"][0] == 0 and result.values["extrema"][0] == 0
    assert row.divergent and row.metric.startswith("sketch_")
    # A lower confidence bound: below the true value, far above the tolerance.
    exact = np.linalg.norm(x - swapped) / np.linalg.norm(x)
    assert 1e-4 < result.values["sketch_rel_l2"][0] < exact


def test_identical_and_transposed_layouts_sketch_alike():
    w = _rng(9).normal(size=(16, 16)).astype(np.float32)  # square: only the layout rule can tell
    base = sketched([Rec("param", "fc.weight", w)])
    cand = sketched([Rec("param", "fc.weight", w.T.copy())], transpose=frozenset({"fc.weight"}))
    result = compare_step(base, cand, ctx(cand="paddle"))
    assert result.values["sketch_rel_l2"][0] == 0 and not result.rows[0].divergent
    # Sketched without the transpose, the same numbers are a different fingerprint.
    wrong = sketched([Rec("param", "fc.weight", w.T.copy())])
    assert compare_step(base, wrong, ctx(cand="paddle")).rows[0].metric.startswith("sketch_")


def test_sketches_of_other_settings_are_not_compared():
    from twinstep.wire import sketch

    x = _rng(10).normal(size=(4, 64)).astype(np.float32)
    other = sketch.SketchSpec(buckets=128)
    result = compare_step(sketched([Rec("forward", "fc", x)]), sketched([Rec("forward", "fc", x[::-1].copy())], other), ctx())
    assert result.values["sketch_rel_l2"][0] == 0
    assert any("sketches use other buckets" in e for e in result.errors)


def test_bad_sketch_payloads_are_refused_with_a_clear_error():
    x = _rng(11).normal(size=(4, 64)).astype(np.float32)
    msg, manifest = build([Rec("forward", "fc", x)])
    msg.sketches.buckets = 256
    msg.sketches.record.append(0)
    msg.sketches.values = b"\0" * 100
    assert "float32 need 1024" in _error(msg, manifest)
    msg.sketches.record[0] = 5
    assert "ascending and below 1" in _error(msg, manifest)
    msg.sketches.buckets = 1 << 20
    assert "buckets" in _error(msg, manifest)
