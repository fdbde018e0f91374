"""server/compare/mapping.py: candidate -> baseline name mapping."""

from __future__ import annotations

import re

import pytest
import yaml

from twinstep.server.compare.mapping import NameMapping


def test_empty_mapping_is_identity():
    m = NameMapping()
    assert m.empty
    for name in ("", "layers.0.mlp", "layers.0.mlp.weight"):
        assert m.to_baseline(name) == name
    assert NameMapping.from_dict(None).empty
    assert NameMapping.from_dict({}).empty


def test_exact_maps_module_and_everything_under_it():
    m = NameMapping(exact={"mlp.linear_fc1": "mlp.up_proj"})
    assert not m.empty
    assert m.to_baseline("mlp.linear_fc1") == "mlp.up_proj"
    assert m.to_baseline("mlp.linear_fc1.weight") == "mlp.up_proj.weight"
    assert m.to_baseline("mlp.linear_fc1.inner.bias") == "mlp.up_proj.inner.bias"
    # only whole path components: a longer sibling name is not "under" it
    assert m.to_baseline("mlp.linear_fc10.weight") == "mlp.linear_fc10.weight"
    assert m.to_baseline("x.mlp.linear_fc1") == "x.mlp.linear_fc1"
    assert m.to_baseline("mlp") == "mlp"


def test_exact_longest_module_path_wins():
    m = NameMapping(exact={"decoder": "model", "decoder.final_layernorm": "norm"})
    assert m.to_baseline("decoder.final_layernorm.weight") == "norm.weight"
    assert m.to_baseline("decoder.layers.0") == "model.layers.0"
    # regardless of insertion order
    m2 = NameMapping(exact={"decoder.final_layernorm": "norm", "decoder": "model"})
    assert m2.to_baseline("decoder.final_layernorm.weight") == "norm.weight"
    assert m2.to_baseline("decoder.embed") == "model.embed"


def test_exact_to_empty_name_strips_the_module():
    m = NameMapping(exact={"wrapper": ""})
    assert m.to_baseline("wrapper.fc.weight") == "fc.weight"
    assert m.to_baseline("wrapper") == ""


def test_prefix_strip_and_swap():
    m = NameMapping(prefix=[("model.", "")])
    assert m.to_baseline("model.layers.0.fc") == "layers.0.fc"
    assert m.to_baseline("other.model.x") == "other.model.x"
    m = NameMapping(prefix=[("gpt.h.", "transformer.layers.")])
    assert m.to_baseline("gpt.h.3.attn") == "transformer.layers.3.attn"


def test_every_prefix_rule_applies_in_turn():
    m = NameMapping(prefix=[("a.", "b."), ("b.", "c.")])
    assert m.to_baseline("a.x") == "c.x"
    # reversed list: the second rule sees the output of the first only
    m = NameMapping(prefix=[("b.", "c."), ("a.", "b.")])
    assert m.to_baseline("a.x") == "b.x"


def test_regex_with_groups():
    m = NameMapping(regex=[(re.compile(r"^decoder\.layers\.(\d+)"), r"layers.\1")])
    assert m.to_baseline("decoder.layers.12.mlp.weight") == "layers.12.mlp.weight"
    assert m.to_baseline("x.decoder.layers.1") == "x.decoder.layers.1"


def test_exact_on_candidate_name_wins_over_prefix_and_regex():
    m = NameMapping(
        exact={"net.block": "layer"},
        prefix=[("net.", "model.")],
        regex=[(re.compile(r"layer"), "WRONG")],
    )
    assert m.to_baseline("net.block.fc") == "layer.fc"
    # names without an exact rule go through prefix and regex
    assert m.to_baseline("net.other") == "model.other"


def test_prefix_then_regex_then_exact_on_the_result():
    m = NameMapping(
        exact={"model.layers.0": "first"},
        prefix=[("net.", "model.")],
        regex=[(re.compile(r"^model\.h\."), "model.layers.")],
    )
    # net.h.0.w -prefix-> model.h.0.w -regex-> model.layers.0.w -exact-> first.w
    assert m.to_baseline("net.h.0.w") == "first.w"
    assert m.to_baseline("net.h.1.w") == "model.layers.1.w"
    # the regex sees the prefix rule's output, not the candidate name
    m = NameMapping(prefix=[("a.", "b.")], regex=[(re.compile(r"^a\."), "WRONG."), (re.compile(r"^b\."), "c.")])
    assert m.to_baseline("a.x") == "c.x"
    # every regex rule applies in turn
    m = NameMapping(regex=[(re.compile("x"), "y"), (re.compile("y"), "z")])
    assert m.to_baseline("x.y") == "z.z"


def test_cached_result_is_stable():
    m = NameMapping(regex=[(re.compile("a"), "b")])
    assert m.to_baseline("aaa") == "bbb"
    assert m.to_baseline("aaa") == "bbb"


def test_from_dict_parsed_yaml():
    data = yaml.safe_load(
        r"""
exact: {decoder.final_layernorm: norm}
prefix: [{candidate: "model.", baseline: ""}]
regex: [{pattern: '^decoder\.layers\.(\d+)', replace: 'layers.\1'}]
"""
    )
    m = NameMapping.from_dict(data)
    assert m.exact == {"decoder.final_layernorm": "norm"}
    assert m.prefix == [("model.", "")]
    assert m.to_baseline("decoder.final_layernorm.weight") == "norm.weight"
    assert m.to_baseline("model.decoder.layers.4.fc") == "layers.4.fc"
    # YAML null baseline prefix means strip
    m = NameMapping.from_dict({"prefix": [{"candidate": "x.", "baseline": None}]})
    assert m.to_baseline("x.y") == "y"


@pytest.mark.parametrize(
    "data,match",
    [
        ([1, 2], r"mapping must be a mapping with keys exact, prefix, regex"),
        ("exact", r"mapping must be a mapping"),
        ({"exakt": {}}, r"unknown keys \['exakt'\]"),
        ({"exact": ["a", "b"]}, r"mapping\.exact must map candidate names"),
        ({"exact": {"a": 1}}, r"mapping\.exact must map candidate names"),
        ({"prefix": [{"candidate": "a."}]}, r"mapping\.prefix\[0\] needs exactly the keys candidate and baseline"),
        ({"prefix": [{"candidate": "a.", "baseline": "", "x": 1}]}, r"mapping\.prefix\[0\]"),
        ({"prefix": [{"candidate": "a.", "baseline": "b."}, "c."]}, r"mapping\.prefix\[1\]"),
        ({"regex": [{"pattern": "a"}]}, r"mapping\.regex\[0\] needs exactly the keys pattern and replace"),
        ({"regex": [{"pattern": "a", "replace": "b"}, {"pattern": "(", "replace": "x"}]},
         r"mapping\.regex\[1\]\.pattern is not a valid regex"),
    ],
)
def test_from_dict_errors(data, match):
    with pytest.raises(ValueError, match=match):
        NameMapping.from_dict(data)


def test_from_dict_error_names_where():
    with pytest.raises(ValueError, match=r"^session\.mapping\.regex\[0\]"):
        NameMapping.from_dict({"regex": [{"pattern": "["}]}, where="session.mapping")


def test_fused_rule_axis_and_groups_parsed_with_defaults():
    data = yaml.safe_load(
        r"""
fused:
  - candidate: 'layers\.(\d+)\.qkv_proj'
    baseline: ['layers.\1.q_proj', 'layers.\1.k_proj', 'layers.\1.v_proj']
    groups: 2
    axis: 0
  - baseline: 'layers\.(\d+)\.up_gate_proj'
    candidate: ['layers.\1.gate_proj', 'layers.\1.up_proj']
"""
    )
    m = NameMapping.from_dict(data)
    qkv, gate_up = m.fused
    assert (qkv.single_side, qkv.groups, qkv.axis) == ("candidate", 2, 0)
    assert (gate_up.single_side, gate_up.groups, gate_up.axis) == ("baseline", 1, -1)
    rule, parts = m.fused_match("candidate", "layers.3.qkv_proj")
    assert rule is qkv and parts == ["layers.3.q_proj", "layers.3.k_proj", "layers.3.v_proj"]
    rule, parts = m.fused_match("baseline", "layers.0.up_gate_proj")
    assert rule is gate_up and parts == ["layers.0.gate_proj", "layers.0.up_proj"]
    assert m.fused_match("baseline", "layers.3.qkv_proj") is None


QKV_RULE = {"candidate": r"qkv", "baseline": ["q", "k", "v"]}


@pytest.mark.parametrize(
    "options,match",
    [
        ({"groups": 0}, r"mapping\.fused\[0\]\.groups must be a positive integer, got 0"),
        ({"groups": -2}, r"mapping\.fused\[0\]\.groups must be a positive integer"),
        ({"groups": "2"}, r"mapping\.fused\[0\]\.groups must be a positive integer, got '2'"),
        ({"groups": 1.5}, r"mapping\.fused\[0\]\.groups must be a positive integer"),
        ({"groups": True}, r"mapping\.fused\[0\]\.groups must be a positive integer"),
        ({"axis": "last"}, r"mapping\.fused\[0\]\.axis must be an integer"),
        ({"axis": 1.0}, r"mapping\.fused\[0\]\.axis must be an integer"),
        ({"axis": False}, r"mapping\.fused\[0\]\.axis must be an integer"),
        ({"group": 2}, r"mapping\.fused\[0\] needs the keys candidate and baseline \(optional: axis, groups\)"),
    ],
)
def test_fused_rule_option_errors(options, match):
    with pytest.raises(ValueError, match=match):
        NameMapping.from_dict({"fused": [{**QKV_RULE, **options}]})
    # the rule is fine without the bad option
    assert NameMapping.from_dict({"fused": [QKV_RULE]}).fused[0].groups == 1
