"""server/compare/tolerance.py: defaults, dtype scaling, overrides, YAML validation."""

from __future__ import annotations

import math

import pytest
import yaml

from twinstep.wire.phases import STEP_ORDER as PHASES
from twinstep.server.compare.tolerance import DTYPE_SCALE, METRICS, Override, ToleranceConfig, effective_dtype

STAT_METRICS = ("rms", "mean", "extrema", "rel_l2", "cosine")


def test_every_phase_has_finite_positive_defaults():
    config = ToleranceConfig()
    assert tuple(config.defaults) == (*PHASES, "record")  # named records (Monitor.record) have their own
    for phase in config.defaults:
        limits = config.for_record(phase, "layers.0.fc", "float32")
        assert set(limits) == set(METRICS)
        for metric in STAT_METRICS:
            assert 0 < limits[metric] < 1e-2, (phase, metric)
        assert limits["shape"] == 0.0
        assert limits["nonfinite"] == 0.0
        assert limits["max_abs"] == math.inf  # not checked unless configured


def test_loss_is_tighter_than_forward_rms():
    config = ToleranceConfig()
    assert config.for_record("loss", "loss", "float32")["rms"] <= config.for_record("forward", "x", "float32")["rms"]


def test_unknown_phase_checks_only_shape_and_nonfinite():
    limits = ToleranceConfig().for_record("nonsense", "x", "float32")
    assert limits["shape"] == 0.0 and limits["nonfinite"] == 0.0
    assert all(limits[m] == math.inf for m in STAT_METRICS)


def test_low_precision_tables_are_looser_and_cover_every_measured_metric():
    config = ToleranceConfig()
    for dtype in ("tf32", "float16", "bfloat16"):
        for phase in PHASES:
            fp32 = config.for_record(phase, "a", "float32")
            low = config.for_record(phase, "a", dtype)
            for metric in ("rms", "mean", "extrema", "rel_l2"):
                assert low[metric] >= 4 * fp32[metric], (dtype, phase, metric)
            # never scaled: exact checks stay exact
            assert low["shape"] == 0.0 and low["nonfinite"] == 0.0
    for phase in PHASES:
        fp32 = config.for_record(phase, "a", "float32")
        assert config.for_record(phase, "a", "float64") == fp32 == config.for_record(phase, "a", "int64")
    # tf32 rounds matrix-product inputs like float16 and keeps float32 outputs: float16 bounds it.
    assert DTYPE_SCALE["tf32"] == DTYPE_SCALE["float16"]


def test_low_precision_tolerances_follow_a_changed_float32_default():
    config = ToleranceConfig.from_dict({"forward": {"rms": 1e-3}})
    factor = DTYPE_SCALE["bfloat16"]["forward"]["rms"]
    assert config.for_record("forward", "x", "bfloat16")["rms"] == pytest.approx(1e-3 * factor)


@pytest.mark.parametrize(
    ("dtypes", "expected"),
    [
        (("float32", "bfloat16"), "bfloat16"),
        (("bfloat16", "float32"), "bfloat16"),
        (("float32", "float32", "tf32"), "tf32"),
        (("float16", "tf32"), "float16"),
        (("int64", "float32"), "float32"),
        (("int64", "bool"), "float32"),
        (("float64", "float64"), "float64"),
    ],
)
def test_effective_dtype_is_the_least_precise_float(dtypes, expected):
    assert effective_dtype(*dtypes) == expected


def test_defaults_are_per_instance():
    a = ToleranceConfig()
    before = ToleranceConfig().for_record("forward", "x", "float32")["rms"]
    a.defaults["forward"]["rms"] = 123.0
    assert a.for_record("forward", "x", "float32")["rms"] == 123.0
    assert ToleranceConfig().for_record("forward", "x", "float32")["rms"] == before
    b = ToleranceConfig.from_dict({"forward": {"rms": 7.0}})
    assert ToleranceConfig().for_record("forward", "x", "float32")["rms"] == before
    assert b.for_record("forward", "x", "float32")["rms"] == 7.0


def test_override_by_pattern():
    config = ToleranceConfig(overrides=[Override(pattern="layers.*.mlp", metrics={"rms": 0.5})])
    default = ToleranceConfig().for_record("forward", "x", "float32")
    assert config.for_record("forward", "layers.3.mlp", "float32")["rms"] == 0.5
    assert config.for_record("grad", "layers.3.mlp", "float32")["rms"] == 0.5  # phase "*"
    assert config.for_record("forward", "layers.3.attn", "float32")["rms"] == default["rms"]
    # fnmatch over the whole name, case-sensitive
    assert config.for_record("forward", "layers.3.mlp.weight", "float32")["rms"] == default["rms"]
    assert config.for_record("forward", "Layers.3.mlp", "float32")["rms"] == default["rms"]
    # other metrics keep their defaults
    assert config.for_record("forward", "layers.3.mlp", "float32")["mean"] == default["mean"]


def test_override_value_is_absolute_not_dtype_scaled():
    config = ToleranceConfig(overrides=[Override(pattern="*", metrics={"rms": 0.25})])
    assert config.for_record("forward", "x", "bfloat16")["rms"] == 0.25


def test_override_by_phase():
    config = ToleranceConfig(overrides=[Override(pattern="*", phase="grad", metrics={"rel_l2": 0.1})])
    assert config.for_record("grad", "fc.weight", "float32")["rel_l2"] == 0.1
    assert config.for_record("param", "fc.weight", "float32")["rel_l2"] != 0.1
    assert config.for_record("forward", "fc", "float32")["rel_l2"] != 0.1


def test_later_override_wins():
    config = ToleranceConfig.from_dict(
        {
            "overrides": [
                {"pattern": "layers.*", "rms": 0.1, "mean": 0.2},
                {"pattern": "layers.1*", "phase": "forward", "rms": 0.3},
            ]
        }
    )
    assert config.for_record("forward", "layers.1", "float32")["rms"] == 0.3
    assert config.for_record("forward", "layers.1", "float32")["mean"] == 0.2
    assert config.for_record("backward", "layers.1", "float32")["rms"] == 0.1
    assert config.for_record("forward", "layers.2", "float32")["rms"] == 0.1
    reversed_config = ToleranceConfig.from_dict(
        {
            "overrides": [
                {"pattern": "layers.1*", "phase": "forward", "rms": 0.3},
                {"pattern": "layers.*", "rms": 0.1, "mean": 0.2},
            ]
        }
    )
    assert reversed_config.for_record("forward", "layers.1", "float32")["rms"] == 0.1


def test_override_can_add_max_abs():
    config = ToleranceConfig.from_dict({"overrides": [{"pattern": "*", "phase": "param", "max_abs": 1e-3}]})
    assert config.for_record("param", "w", "float32")["max_abs"] == 1e-3
    assert config.for_record("grad", "w", "float32")["max_abs"] == math.inf


def test_from_dict_yaml_phase_defaults():
    data = yaml.safe_load(
        """
forward: {rms: 1e-3, cosine: 0}
param: {rel_l2: 2}
overrides:
  - {pattern: "embed*", phase: param, rel_l2: 0.5}
"""
    )
    config = ToleranceConfig.from_dict(data)
    default = ToleranceConfig()
    assert config.for_record("forward", "x", "float32")["rms"] == 1e-3
    assert config.for_record("forward", "x", "float32")["cosine"] == 0.0
    assert config.for_record("forward", "x", "float32")["mean"] == default.for_record("forward", "x", "float32")["mean"]
    assert config.for_record("forward", "x", "bfloat16")["rms"] == pytest.approx(1e-3 * DTYPE_SCALE["bfloat16"]["forward"]["rms"])
    assert config.for_record("param", "w", "float32")["rel_l2"] == 2.0
    assert config.for_record("param", "embed.weight", "float32")["rel_l2"] == 0.5
    assert ToleranceConfig.from_dict(None).defaults == default.defaults
    assert ToleranceConfig.from_dict({}).defaults == default.defaults


@pytest.mark.parametrize(
    "data,match",
    [
        ([1], r"^tolerances must be a mapping"),
        ({"fwd": {"rms": 1}}, r"^tolerances\.fwd: unknown phase"),
        ({"forward": [1]}, r"^tolerances\.forward must map metric names to numbers"),
        ({"forward": None}, r"^tolerances\.forward must map metric names"),
        ({"forward": {"rmse": 1}}, r"^tolerances\.forward\.rmse: unknown metric"),
        ({"forward": {"shape": 1}}, r"^tolerances\.forward\.shape: unknown metric"),
        ({"loss": {"nonfinite": 1}}, r"^tolerances\.loss\.nonfinite: unknown metric"),
        ({"forward": {"rms": "tight"}}, r"^tolerances\.forward\.rms must be a number, got 'tight'"),
        ({"forward": {"rms": None}}, r"^tolerances\.forward\.rms must be a number"),
        ({"grad": {"mean": -1e-5}}, r"^tolerances\.grad\.mean must be >= 0"),
        ({"overrides": [{"rms": 1}]}, r"^tolerances\.overrides\[0\] needs a pattern"),
        ({"overrides": ["*"]}, r"^tolerances\.overrides\[0\] needs a pattern"),
        ({"overrides": [{"pattern": "*"}, {"pattern": "x", "phase": "fwd"}]},
         r"^tolerances\.overrides\[1\]\.phase: 'fwd' is not one of"),
        ({"overrides": [{"pattern": "*", "bogus": 1}]}, r"^tolerances\.overrides\[0\]\.bogus: unknown metric"),
        ({"overrides": [{"pattern": "*", "rms": -1}]}, r"^tolerances\.overrides\[0\]\.rms must be >= 0"),
    ],
)
def test_from_dict_errors(data, match):
    with pytest.raises(ValueError, match=match):
        ToleranceConfig.from_dict(data)


def test_from_dict_error_names_where():
    with pytest.raises(ValueError, match=r"^cfg\.tolerances\.forward\.rms"):
        ToleranceConfig.from_dict({"forward": {"rms": -1}}, where="cfg.tolerances")


@pytest.mark.parametrize("data", [{"forward": {"rms": float("nan")}}, {"overrides": [{"pattern": "*", "rms": "nan"}]}])
def test_nan_tolerance_rejected(data):
    with pytest.raises(ValueError, match="must be >= 0|must be a number"):
        ToleranceConfig.from_dict(data)
