"""The preflight diff (twinstep.server.preflight): two set-ups, through the candidate's mapping."""

from __future__ import annotations

import pytest

from twinstep.server.compare.mapping import NameMapping
from twinstep.server.errors import InputError
from twinstep.server.preflight import PreflightTracker, check_setup, diff_setups
from twinstep.runtime.setup import setup_value
from twinstep.v1 import twinstep_pb2 as pb

QKV = ["layers.0.attn.q_proj", "layers.0.attn.k_proj", "layers.0.attn.v_proj"]
MAPPING = NameMapping.from_dict({
    "exact": {"decoder": "layers"},
    "fused": [{"candidate": r"layers\.(\d+)\.attn\.qkv_proj",
               "baseline": [r"layers.\1.attn.q_proj", r"layers.\1.attn.k_proj", r"layers.\1.attn.v_proj"]}],
})


def _group(parameters: list[str], **values: float) -> pb.ParameterGroup:
    return pb.ParameterGroup(values=[setup_value(k if k != "wd" else "weight_decay", k if k != "wd" else "weight_decay",
                                                 v) for k, v in values.items()], parameters=parameters)


def _baseline() -> pb.Setup:
    return pb.Setup(
        framework="torch",
        values=[setup_value("version", "torch", "2.4"), setup_value("clipping", "clipping", "none"),
                setup_value("seed", "seed", 1)],
        groups=[_group([p + ".weight" for p in QKV] + ["layers.0.mlp.fc.weight"], lr=1e-3, wd=0.01),
                _group(["layers.0.norm.weight"], lr=1e-3, wd=0.0)],
        modules=[pb.ModuleSetup(name="layers.0.norm", values=[setup_value("norm_eps", "eps", 1e-6)]),
                 pb.ModuleSetup(name="layers.0.mlp.activation_fn", values=[setup_value("activation", "activation", "silu")]),
                 pb.ModuleSetup(name="rotary", values=[setup_value("rope_base", "rope_base", 9999.9993, derived=True)])],
    )


def _candidate(**over) -> pb.Setup:
    cand = pb.Setup(
        framework="paddle",
        values=[setup_value("version", "paddle", "3.3"), setup_value("clipping", "clipping", over.get("clip", "none")),
                setup_value("seed", "seed", over.get("seed", 1))],
        groups=[_group(["layers.0.attn.qkv_proj.weight", "decoder.0.mlp.fc.weight"], lr=over.get("lr", 1e-3), wd=0.01),
                _group(["decoder.0.norm.weight"], lr=over.get("lr", 1e-3), wd=over.get("norm_wd", 0.0))],
        modules=[pb.ModuleSetup(name="decoder.0.norm", values=[setup_value("norm_eps", "eps", over.get("eps", 1e-6))]),
                 pb.ModuleSetup(name="decoder.0.mlp.act_fn", values=[setup_value("activation", "activation",
                                                                                 over.get("act", "silu"))]),
                 pb.ModuleSetup(name="rotary", values=[setup_value("rope_base", "rope_base", over.get("rope", 10000.0))])],
    )
    return cand


def _warnings(cand: pb.Setup) -> list[pb.PreflightFinding]:
    return [f for f in diff_setups(_baseline(), cand, MAPPING, "paddle") if f.severity == "warning"]


def test_a_faithful_setup_differs_in_nothing_that_matters():
    # Other frameworks' versions are context; a derived rotary base within float32 rounding is equal.
    assert diff_setups(_baseline(), _candidate(), MAPPING, "paddle") == []


def test_a_fused_parameter_stands_for_its_parts_and_renamed_ones_map():
    (finding,) = _warnings(_candidate(lr=1.1e-3))
    assert (finding.category, finding.baseline, finding.candidate) == ("lr", "0.001", "0.0011")
    assert list(finding.affects) == [p + ".weight" for p in QKV] + ["layers.0.mlp.fc.weight", "layers.0.norm.weight"]
    assert "learning rate differs: baseline 0.001, candidate 'paddle' 0.0011 for 5 parameters" in finding.message


def test_weight_decay_on_norms_names_only_the_norms():
    (finding,) = _warnings(_candidate(norm_wd=0.01))
    assert (finding.category, list(finding.affects)) == ("weight_decay", ["layers.0.norm.weight"])


@pytest.mark.parametrize(("over", "category", "affects"), [
    ({"eps": 1e-5}, "norm_eps", ["layers.0.norm"]),
    ({"act": "gelu"}, "activation", ["layers.0.mlp.activation_fn"]),  # the only activation of its parent
    ({"rope": 10001.0}, "rope_base", ["rotary"]),
    ({"clip": "global_norm"}, "clipping", []),
])
def test_module_and_run_wide_differences(over, category, affects):
    (finding,) = _warnings(_candidate(**over))
    assert (finding.category, list(finding.affects)) == (category, affects)


def test_seeds_of_different_frameworks_are_not_compared():
    # torch's and paddle's generators differ: their seeds say nothing about each other.
    assert diff_setups(_baseline(), _candidate(seed=6194615058587119616), MAPPING, "paddle") == []


def test_seeds_of_one_framework_are_context_written_as_integers():
    base = pb.Setup(framework="torch", values=[setup_value("seed", "seed", 4905462089342365696)])
    rerun = pb.Setup(framework="torch", values=[setup_value("seed", "seed", 6194615)])
    (finding,) = diff_setups(base, rerun, NameMapping(), "rerun")
    assert (finding.category, finding.severity) == ("seed", "info")
    assert (finding.baseline, finding.candidate) == ("4905462089342365696", "6194615")
    assert finding.message == "seed differs: baseline 4905462089342365696, candidate 'rerun' 6194615"
    same = pb.Setup(framework="torch", values=[setup_value("seed", "seed", 4905462089342365697)])
    assert diff_setups(base, same, NameMapping(), "rerun")[0].candidate == "4905462089342365697"  # every digit


def test_integer_values_are_written_as_integers():
    base = pb.Setup(framework="torch", values=[setup_value("config", "config.vocab_size", 151936),
                                               setup_value("config", "config.max_position_embeddings", 131072)])
    cand = pb.Setup(framework="paddle", values=[setup_value("config", "config.vocab_size", 151937),
                                                setup_value("config", "config.max_position_embeddings", 32768.0)])
    findings = {f.key: (f.baseline, f.candidate) for f in diff_setups(base, cand, NameMapping(), "paddle")}
    assert findings == {"config.vocab_size": ("151936", "151937"),
                        "config.max_position_embeddings": ("131072", "32768")}


def test_affected_names_are_bounded_and_counted():
    base = pb.Setup(groups=[_group([f"p{i}" for i in range(50)], lr=1.0)])
    cand = pb.Setup(groups=[_group([f"p{i}" for i in range(50)], lr=2.0)])
    (finding,) = diff_setups(base, cand, NameMapping(), "c")
    assert (len(finding.affects), finding.affects_unlisted) == (20, 30)


def test_the_tracker_announces_each_warning_once_and_waits_for_the_baseline():
    tracker = PreflightTracker()
    mapping_for = lambda run, types: MAPPING  # noqa: E731
    tracker.add("paddle", _candidate(lr=2e-3))
    assert tracker.refresh("torch", ["paddle"], mapping_for) == []  # no baseline set-up yet
    tracker.add("torch", _baseline())
    assert [f.category for f in tracker.refresh("torch", ["paddle"], mapping_for)] == ["lr"]
    assert tracker.refresh("torch", ["paddle"], mapping_for) == []  # told already
    assert [f.category for f in tracker.to_proto(["paddle"])] == ["lr"]


def test_an_oversized_setup_is_a_clear_input_error():
    with pytest.raises(InputError, match="setup lists 20001 modules; at most 20000"):
        check_setup(pb.Setup(modules=[pb.ModuleSetup(name=str(i)) for i in range(20_001)]))
    with pytest.raises(InputError, match="longer than 1000 characters"):
        check_setup(pb.Setup(values=[pb.SetupValue(key="k" * 1001)]))
