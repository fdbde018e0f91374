"""Weight sync's conversion plan (server/weights/convert.py), checked against the ports' own converters.

tests/ports/models.py converts torch state dicts to paddleformers' layouts by hand
(read from paddleformers' source): an oracle written independently of twinstep's rules.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.ports import models
from tests.ports.corpus import FUSED_MAPPING
from twinstep.server.compare import layout
from twinstep.server.compare.mapping import NameMapping
from twinstep.server.weights.convert import Param, build_plan

H, KV, D = models.HEADS, models.KV_HEADS, models.HEAD_DIM
HIDDEN, INTER = models.HIDDEN, models.INTERMEDIATE
ERNIE = models.SPECS["ernie4_5"]

#: The reverse of the ports' mapping: the baseline (paddle) holds the fused modules.
SPLIT_MAPPING = {"fused": [
    {"baseline": r"model\.layers\.(\d+)\.self_attn\.qkv_proj",
     "candidate": [r"model.layers.\1.self_attn.q_proj", r"model.layers.\1.self_attn.k_proj",
                   r"model.layers.\1.self_attn.v_proj"], "groups": KV},
    {"baseline": r"model\.layers\.(\d+)\.mlp\.up_gate_proj",
     "candidate": [r"model.layers.\1.mlp.gate_proj", r"model.layers.\1.mlp.up_proj"]},
]}


def torch_layer() -> dict[str, tuple[tuple[int, ...], str]]:
    """One Ernie4_5 decoder layer as transformers names it: name -> (shape, owning module type)."""
    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": ((models.VOCAB, HIDDEN), "Embedding"),
        p + "input_layernorm.weight": ((HIDDEN,), "Ernie4_5RMSNorm"),
        p + "self_attn.q_proj.weight": ((H * D, HIDDEN), "Linear"),  # 64 x 64: square
        p + "self_attn.k_proj.weight": ((KV * D, HIDDEN), "Linear"),
        p + "self_attn.v_proj.weight": ((KV * D, HIDDEN), "Linear"),
        p + "self_attn.o_proj.weight": ((HIDDEN, H * D), "Linear"),  # square
        p + "mlp.gate_proj.weight": ((INTER, HIDDEN), "Linear"),
        p + "mlp.up_proj.weight": ((INTER, HIDDEN), "Linear"),
        p + "mlp.down_proj.weight": ((HIDDEN, INTER), "Linear"),
        "lm_head.weight": ((models.VOCAB, HIDDEN), "Linear"),
    }


def paddle_types(name: str) -> str:
    """paddleformers' module types: Linear projections, its own LMHead (which keeps [vocab, hidden])."""
    if name == "lm_head.weight":
        return "LMHead"
    if name.endswith("_proj.weight"):
        return "Linear"
    return "Embedding" if "embed" in name else "Ernie4_5RMSNorm"


def params(shapes: dict[str, tuple[int, ...]], types, dtype: str = "float32") -> list[Param]:
    return [Param(k, name, name.rsplit(".", 1)[0], types(name), tuple(shape), dtype)
            for k, (name, shape) in enumerate(shapes.items())]


def random_state(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def run_plan(plan, base: list[Param], state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    arrays = {p.id: state[p.name].reshape(-1) for p in base}
    return {load.target.name: load.convert(arrays) for load in plan.loads}


def test_torch_to_paddle_matches_the_ports_converter_fused_qkv_groups_up_gate_and_square_transposes():
    torch_shapes = {n: s for n, (s, _) in torch_layer().items()}
    torch_types = {n: t for n, (_, t) in torch_layer().items()}
    state = random_state(torch_shapes)
    expected = models.torch_to_paddle(ERNIE, state)  # the ports' hand-written conversion
    base = params(torch_shapes, torch_types.__getitem__)
    cand = params({n: v.shape for n, v in expected.items()}, paddle_types)
    plan = build_plan("torch", base, "paddle", cand, NameMapping.from_dict(FUSED_MAPPING))
    assert plan.problems == [] and plan.no_counterpart == [] and plan.unused == []
    got = run_plan(plan, base, state)
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    loads = {load.target.name: load for load in plan.loads}
    qkv = loads["model.layers.0.self_attn.qkv_proj.weight"]
    assert (qkv.groups, qkv.axis, qkv.transposed) == (KV, -1, (True, True, True))
    assert [s.name.split(".")[-2] for s in qkv.sources] == ["q_proj", "k_proj", "v_proj"]
    # Square weights transpose by their layout, not their shape; lm_head does not (LMHead keeps [vocab, hidden]).
    assert loads["model.layers.0.self_attn.o_proj.weight"].transposed == (True,)
    assert loads["lm_head.weight"].transposed == (False,)


def test_paddle_to_torch_splits_the_fused_parameters_as_the_ports_inverse_does():
    torch_shapes = {n: s for n, (s, _) in torch_layer().items()}
    torch_types = {n: t for n, (_, t) in torch_layer().items()}
    paddle_state = models.torch_to_paddle(ERNIE, random_state(torch_shapes, seed=1))
    expected = models.paddle_to_torch(ERNIE, paddle_state)
    base = params({n: v.shape for n, v in paddle_state.items()}, paddle_types)
    cand = params(torch_shapes, torch_types.__getitem__)
    plan = build_plan("paddle", base, "torch", cand, NameMapping.from_dict(SPLIT_MAPPING))
    assert plan.problems == [] and plan.no_counterpart == [] and plan.unused == []
    got = run_plan(plan, base, paddle_state)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    k = next(load for load in plan.loads if load.target.name.endswith("k_proj.weight"))
    assert (k.part, k.groups, k.part_sizes, k.transposed) == (1, KV, (H * D, KV * D, KV * D), (True,))


def test_a_square_weight_is_transposed_by_layout_and_an_equal_layout_is_copied():
    w = np.arange(16, dtype=np.float32).reshape(4, 4)  # not symmetric: a missing transpose shows
    base = [Param(0, "fc.weight", "fc", "Linear", (4, 4), "float32"), Param(1, "fc.bias", "fc", "Linear", (4,), "float32")]
    cand = [Param(0, "fc.weight", "fc", "Linear", (4, 4), "float32"), Param(1, "fc.bias", "fc", "Linear", (4,), "float32")]
    bias = np.arange(4, dtype=np.float32)
    to_paddle = build_plan("torch", base, "paddle", cand, NameMapping())
    got = run_plan(to_paddle, base, {"fc.weight": w, "fc.bias": bias})
    np.testing.assert_array_equal(got["fc.weight"], w.T)
    np.testing.assert_array_equal(got["fc.bias"], bias)
    same = build_plan("torch", base, "torch", cand, NameMapping())
    np.testing.assert_array_equal(run_plan(same, base, {"fc.weight": w, "fc.bias": bias})["fc.weight"], w)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sixteen_bit_values_move_bit_for_bit(dtype):
    """bfloat16 travels as its bit pattern (no numpy dtype): every pattern, NaNs included, arrives unchanged."""
    bits = np.arange(1 << 16, dtype=np.uint16).reshape(256, 256)
    storage = bits if dtype == "bfloat16" else bits.view(np.float16)
    base = [Param(0, "fc.weight", "fc", "Linear", (256, 256), dtype)]
    cand = [Param(0, "fc.weight", "fc", "Linear", (256, 256), dtype)]
    plan = build_plan("torch", base, "paddle", cand, NameMapping())
    (load,) = plan.loads
    out = load.convert({0: storage.reshape(-1)})
    assert out.dtype == storage.dtype and out.flags.c_contiguous
    assert np.array_equal(out.view(np.uint16), bits.T)


def test_a_float_cast_is_planned_and_an_integer_one_is_a_problem():
    base = [Param(0, "w", "", "M", (3,), "float32"), Param(1, "n", "", "M", (3,), "int64")]
    cand = [Param(0, "w", "", "M", (3,), "bfloat16"), Param(1, "n", "", "M", (3,), "float32")]
    plan = build_plan("torch", base, "torch", cand, NameMapping())
    assert [load.target.name for load in plan.loads] == ["w"]
    assert plan.problems == ["n: a float32 parameter cannot take the baseline's int64 values"]


def test_a_shape_no_rule_reconciles_is_a_problem_naming_both_sides():
    base = [Param(0, "fc.weight", "fc", "Linear", (4, 3), "float32"), Param(1, "fc.bias", "fc", "Linear", (4,), "float32")]
    cand = [Param(0, "fc.weight", "fc", "Linear", (4, 3), "float32"), Param(1, "fc.bias", "fc", "Linear", (4,), "float32")]
    plan = build_plan("torch", base, "paddle", cand, NameMapping())  # paddle stores [in, out]: expects [3, 4]
    assert len(plan.problems) == 1
    assert "fc.weight [4, 3]" in plan.problems[0] and "[3, 4]" in plan.problems[0] and "transposed" in plan.problems[0]


def test_fused_parts_that_do_not_make_up_the_fused_parameter_are_a_problem():
    torch_shapes = {n: s for n, (s, _) in torch_layer().items()}
    torch_types = {n: t for n, (_, t) in torch_layer().items()}
    paddle_shapes = {n: v.shape for n, v in models.torch_to_paddle(ERNIE, random_state(torch_shapes)).items()}
    paddle_shapes["model.layers.0.self_attn.qkv_proj.weight"] = (HIDDEN, 120)  # 8 columns short
    plan = build_plan("torch", params(torch_shapes, torch_types.__getitem__), "paddle",
                      params(paddle_shapes, paddle_types), NameMapping.from_dict(FUSED_MAPPING))
    assert len(plan.problems) == 1 and "qkv_proj.weight [64, 120]" in plan.problems[0], plan.problems
    assert "do not make it up" in plan.problems[0]


def test_a_fused_rule_whose_part_is_missing_is_a_problem_and_unmatched_names_are_listed():
    base = [Param(0, "attn.q.weight", "attn.q", "Linear", (4, 4), "float32"),
            Param(1, "attn.k.weight", "attn.k", "Linear", (4, 4), "float32"),
            Param(2, "extra.weight", "extra", "Linear", (4, 4), "float32")]
    cand = [Param(0, "attn.qkv.weight", "attn.qkv", "Linear", (4, 12), "float32"),
            Param(1, "own.weight", "own", "Linear", (4, 4), "float32")]
    mapping = NameMapping.from_dict({"fused": [{"candidate": r"attn\.qkv", "baseline": ["attn.q", "attn.k", "attn.v"]}]})
    plan = build_plan("torch", base, "paddle", cand, mapping)
    assert plan.problems == ["attn.qkv.weight: its fused rule makes it of attn.q.weight, attn.k.weight, "
                             "attn.v.weight, and the baseline has no attn.v.weight"]
    assert plan.no_counterpart == ["own.weight"]


def test_names_map_through_the_sessions_mapping_and_nothing_in_common_is_a_problem():
    base = [Param(0, "decoder.fc.weight", "decoder.fc", "Linear", (2, 2), "float32")]
    cand = [Param(0, "model.fc.weight", "model.fc", "Linear", (2, 2), "float32")]
    nothing = build_plan("torch", base, "torch", cand, NameMapping())
    assert len(nothing.problems) == 1 and "no candidate parameter has a counterpart" in nothing.problems[0]
    mapped = build_plan("torch", base, "torch", cand,
                        NameMapping.from_dict({"prefix": [{"candidate": "model.", "baseline": "decoder."}]}))
    assert mapped.problems == [] and [s.name for s in mapped.loads[0].sources] == ["decoder.fc.weight"]


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_unfuse_inverts_fuse(groups):
    rng = np.random.default_rng(groups)
    parts = [rng.standard_normal((8, n)) for n in (16, 8, 8)]
    fused = layout.fuse(parts, -1, groups)
    for got, want in zip(layout.unfuse(fused, -1, groups, [16, 8, 8]), parts):
        np.testing.assert_array_equal(got, want)


def mindspore_block() -> list[Param]:
    """A MindSpore block as its cells name it: Dense [out, in], LayerNorm gamma/beta, Embedding's table."""
    return [Param(0, "embed.embedding_table", "embed", "Embedding", (10, 4), "float32"),
            Param(1, "ln.gamma", "ln", "LayerNorm", (4,), "float32"), Param(2, "ln.beta", "ln", "LayerNorm", (4,), "float32"),
            Param(3, "fc.weight", "fc", "Dense", (4, 4), "float32"), Param(4, "fc.bias", "fc", "Dense", (4,), "float32")]


def torch_block(module_type: str = "Linear") -> list[Param]:
    return [Param(0, "embed.weight", "embed", "Embedding", (10, 4), "float32"),
            Param(1, "ln.weight", "ln", "LayerNorm", (4,), "float32"), Param(2, "ln.bias", "ln", "LayerNorm", (4,), "float32"),
            Param(3, "fc.weight", "fc", module_type, (4, 4), "float32"), Param(4, "fc.bias", "fc", module_type, (4,), "float32")]


@pytest.mark.parametrize(("base_framework", "cand_framework"), [("torch", "mindspore"), ("mindspore", "torch"),
                                                                ("paddle", "mindspore"), ("mindspore", "paddle")])
def test_mindspore_names_match_torchs_with_no_rule_and_only_paddles_linear_is_transposed(base_framework, cand_framework):
    """gamma/beta/embedding_table are weight/bias/weight (twinstep.wire.layouts), in either direction, as the join has it."""
    sides = {"torch": torch_block(), "paddle": torch_block("Linear"), "mindspore": mindspore_block()}
    base, cand = sides[base_framework], sides[cand_framework]
    rng = np.random.default_rng(0)
    state = {p.name: rng.standard_normal(p.shape).astype(np.float32) for p in base}
    plan = build_plan(base_framework, base, cand_framework, cand, NameMapping())
    assert plan.problems == [] and plan.no_counterpart == [] and plan.unused == []
    got = run_plan(plan, base, state)
    flip = "paddle" in (base_framework, cand_framework)  # a Dense is [out, in] like torch's Linear
    for b, c in zip(base, cand):  # both blocks list their parameters in the same order
        want = state[b.name].T if flip and c.name == "fc.weight" else state[b.name]
        np.testing.assert_array_equal(got[c.name], want, err_msg=c.name)
    assert {load.target.name: [s.name for s in load.sources] for load in plan.loads} == {
        c.name: [b.name] for b, c in zip(base, cand)}
