"""Server policies over real streams: renamed modules, bounded windows, late joiners."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import last_step, wait_for
from tests.integration.rawclient import RawStream, hello, manifest, step
from twinstep.server.config import config_from_dict
from twinstep.v1 import twinstep_pb2 as pb

X = np.linspace(-2.0, 2.0, 32, dtype=np.float32).reshape(4, 8)

MAPPING = config_from_dict({"mapping": {"prefix": [{"candidate": "model.", "baseline": ""}], "exact": {"mlp.up": "mlp.fc1"}}})


def open_run(address, session, run, baseline, modules):
    stream = RawStream(address).send(hello(session, run, baseline=baseline))
    assert stream.next().WhichOneof("body") == "welcome"
    return stream.send(manifest(*modules))


def finish(stream, last):
    stream.send(pb.ClientMessage(close=pb.Close(reason="finished", last_step=last)))
    stream.close()
    stream.wait_end()


@pytest.mark.parametrize("server", [{"config": MAPPING}], indirect=True)
def test_mapping_file_matches_renamed_modules(server):
    base = open_run(server.address, "renamed", "base", True, [(0, "fc", "Linear"), (1, "mlp.fc1", "Linear")])
    cand = open_run(server.address, "renamed", "cand", False, [(0, "model.fc", "Linear"), (1, "model.mlp.up", "Linear")])
    base.send(step(0, [(0, X), (1, X * 3)]))
    cand.send(step(0, [(0, X), (1, X * 3 + 0.5)]))  # the renamed fc1 differs
    finish(base, 0)
    finish(cand, 0)
    report = server.report_proto("renamed")
    first = report.first_divergence
    assert (first.module, first.candidate_module) == ("mlp.fc1", "model.mlp.up")
    assert list(report.unmatched_baseline) == [] and list(report.unmatched_candidate) == []


def test_unmatched_modules_are_listed_not_passed(server):
    # Nothing alike (class, shape, values): automatic matching must not pair them either.
    base = open_run(server.address, "unmatched", "base", True, [(0, "fc", "Linear"), (1, "extra", "ReLU")])
    cand = open_run(server.address, "unmatched", "cand", False, [(0, "fc", "Linear"), (1, "other", "Softmax")])
    base.send(step(0, [(0, X), (1, X)]))
    cand.send(step(0, [(0, X), (1, np.ones((3, 5), dtype=np.float32))]))
    finish(base, 0)
    finish(cand, 0)
    report = server.report_proto("unmatched")
    assert list(report.unmatched_baseline) == ["forward:extra"]
    assert list(report.unmatched_candidate) == ["forward:other"]


@pytest.mark.parametrize("server", [{"config": config_from_dict({"window": {"steps": 5}})}], indirect=True)
def test_window_bounds_a_run_that_is_far_ahead_and_the_report_says_so(server):
    base = open_run(server.address, "window", "base", True, [(0, "fc", "Linear")])
    for s in range(20):  # a raw client ignores credit; the server must still bound memory
        base.send(step(s, [(0, X)]))
    wait_for(lambda: last_step(server, "window", "base") == 19)
    session = server.registry.get("window")
    assert session.core.pipeline.aligners[0].pending_steps("base") == 5
    cand = open_run(server.address, "window", "cand", False, [(0, "fc", "Linear")])
    for s in range(20):
        cand.send(step(s, [(0, X)]))
    finish(base, 19)
    finish(cand, 19)
    report = server.report("window")
    runs = {r["name"]: r for r in report["runs"]}
    assert runs["base"]["dropped"] == 15 and runs["base"]["dropped_by_reason"] == {"server_window": 15}
    # Only 5 steps were compared: the verdict says so instead of "aligned".
    assert report["steps_compared"] == 5 and report["status"] == "incomplete"
    assert report["status_reasons"] == ["run 'cand': not compared: steps 0 to 14 (run 'base': dropped by the "
                                        "server: its window overflowed while the other run lagged)"], report


def test_credit_tells_a_lone_lockstep_run_to_wait(server):
    stream = RawStream(server.address)
    msg = hello("credit", "base", baseline=True)
    msg.hello.max_lead = 2
    stream.send(msg)
    assert stream.next().WhichOneof("body") == "welcome"
    credit = stream.next()
    assert credit.credit.max_step == 1  # two steps (0, 1) before the other run must show up
    other = open_run(server.address, "credit", "cand", False, [(0, "fc", "Linear")])
    other.send(step(0, [(0, X)]))
    credit = wait_for(lambda: (m := stream.next()).WhichOneof("body") == "credit" and m.credit.max_step == 2 and m)
    assert credit.credit.max_step == 2


def test_a_slow_rank_cannot_hide_an_earlier_divergence(server):
    """Rank 0 diverges at step 3 and arrives first; rank 1 diverged at step 1 but is slow."""
    def open_rank(run, baseline, rank):
        stream = RawStream(server.address).send(hello("slow", run, baseline=baseline, rank=rank, world_size=2))
        assert stream.next().WhichOneof("body") == "welcome"
        return stream.send(manifest((0, "fc", "Linear")))

    streams = {(run, rank): open_rank(run, run == "base", rank) for run in ("base", "cand") for rank in (0, 1)}
    for s in range(5):
        streams["base", 0].send(step(s, [(0, X)], rank=0))
        streams["cand", 0].send(step(s, [(0, X + 1.0 if s == 3 else X)], rank=0))
    for s in range(2):
        streams["base", 1].send(step(s, [(0, X)], rank=1))
    wait_for(lambda: last_step(server, "slow", "cand") == 4)
    assert server.report("slow")["first_divergence"] is None  # rank 1 has not delivered step 1..3 yet
    for s in range(5):
        streams["cand", 1].send(step(s, [(0, X * 2 if s == 1 else X)], rank=1))
    for s in range(2, 5):
        streams["base", 1].send(step(s, [(0, X)], rank=1))
    first = wait_for(lambda: server.report("slow")["first_divergence"])
    assert (first["step"], first["rank"]) == (1, 1)
    for (run, rank), stream in streams.items():
        finish(stream, 4)
    assert server.report("slow")["status"] == "diverged"


FUSED = config_from_dict({"mapping": {"fused": [
    {"candidate": r"layers\.(\d+)\.qkv_proj", "baseline": [r"layers.\1.q_proj", r"layers.\1.k_proj", r"layers.\1.v_proj"]},
]}})


@pytest.mark.parametrize("server", [{"config": FUSED}], indirect=True)
@pytest.mark.parametrize("perturb", [False, True])
def test_fused_module_compared_with_its_parts(server, perturb):
    session = f"fused-{perturb}"
    q, k, v = X, X * 2, X - 1
    base = open_run(server.address, session, "base", True, [(0, "layers.0.q_proj", "Linear"), (1, "layers.0.k_proj", "Linear"), (2, "layers.0.v_proj", "Linear")])
    cand = open_run(server.address, session, "cand", False, [(0, "layers.0.qkv_proj", "Linear")])
    base.send(step(0, [(0, q), (1, k), (2, v)]))
    # Heads interleaved on the candidate side: merged statistics do not care.
    fused = np.stack([q, k + (0.01 if perturb else 0.0), v], axis=-1).reshape(4, 24)
    cand.send(step(0, [(0, fused)]))
    finish(base, 0)
    finish(cand, 0)
    report = server.report_proto(session)
    assert list(report.unmatched_baseline) == [] and list(report.unmatched_candidate) == []
    if not perturb:
        assert report.status == "aligned"
    else:
        d = report.first_divergence
        assert (d.module, d.candidate_module) == ("layers.0.{q_proj,k_proj,v_proj}", "layers.0.qkv_proj")


LAYER_MAPPING = """
TopLayer:
  0.module: module
Float16Module:
  module: model
GPTModel:
  decoder.layers: layers
TransformerLayer:
  self_attention: self_attn
SelfAttention:
  linear_proj: o_proj
"""


def test_msprobe_layer_mapping_file(tmp_path):
    from twinstep.server import load_config, serve

    (tmp_path / "layer_mapping.yaml").write_text(LAYER_MAPPING)
    (tmp_path / "server.yaml").write_text("layer_mapping_file: layer_mapping.yaml\n")
    handle = serve(port=0, config=load_config(tmp_path / "server.yaml"))
    try:
        base = open_run(handle.address, "msprobe", "base", True, [(0, "module.model.layers.0.self_attn.o_proj", "Linear")])
        cand_modules = [
            (0, "0.module.module.decoder.layers.0.self_attention.linear_proj", "RowParallelLinear"),
            (1, "0.module.module.decoder.layers.0.self_attention", "SelfAttention"),
            (2, "0.module.module.decoder.layers.0", "TransformerLayer"),
            (3, "0.module.module", "GPTModel"),
            (4, "0.module", "Float16Module"),
        ]
        cand = open_run(handle.address, "msprobe", "cand", False, cand_modules)
        base.send(step(0, [(0, X)]))
        cand.send(step(0, [(0, X + 1.0)]))
        finish(base, 0)
        finish(cand, 0)
        report = handle.report_proto("msprobe")
        assert report.first_divergence.module == "module.model.layers.0.self_attn.o_proj"
        assert report.first_divergence.candidate_module == "0.module.module.decoder.layers.0.self_attention.linear_proj"
    finally:
        handle.stop(grace=0.1)


@pytest.mark.parametrize(
    ("reference_error", "candidate_error", "diverges"),
    [
        (1e-4, 2e-4, False),  # noisy baseline: 2e-4 is inside 3x its own band (the default 5e-5 would flag it)
        (1e-6, 2e-5, True),   # quiet baseline: 2e-5 is far outside its band (the default 5e-5 would pass it)
    ],
)
def test_reference_rerun_sets_noise_bands(server, reference_error, candidate_error, diverges):
    modules = [(0, "fc", "Linear")]
    # Without a reference the defaults decide, the other way round.
    session = f"noise-{reference_error}"
    base = open_run(server.address, session, "base", True, modules)
    cand = open_run(server.address, session, "cand", False, modules)
    for s in range(3):
        base.send(step(s, [(0, X)]))
        cand.send(step(s, [(0, X * (1 + candidate_error))]))
    finish(base, 2)
    finish(cand, 2)
    assert server.report_proto(session).HasField("first_divergence") is not diverges

    session = f"noise-ref-{reference_error}"
    base = open_run(server.address, session, "base", True, modules)
    message = hello(session, "rerun")
    message.hello.reference = True
    ref = RawStream(server.address).send(message)
    assert ref.next().WhichOneof("body") == "welcome"
    ref.send(manifest(*modules))
    cand = open_run(server.address, session, "cand", False, modules)
    for s in range(3):
        cand.send(step(s, [(0, X * (1 + candidate_error))]))  # the candidate runs ahead of the reference
        base.send(step(s, [(0, X)]))
    for s in range(3):
        ref.send(step(s, [(0, X * (1 + reference_error))]))
    for stream, last in ((base, 2), (cand, 2), (ref, 2)):
        finish(stream, last)
    report = server.report_proto(session)
    assert report.HasField("first_divergence") is diverges
    noisy = [row for row in report.tree if row.name == "fc"][0]
    assert noisy.noise > 0  # the report shows each module's noise band
    assert {r.name for r in report.runs} == {"base", "rerun", "cand"}


@pytest.mark.parametrize(("error", "passes"), [(0.004, True), (0.05, False)])
def test_long_run_criteria(server, error, passes):
    session = f"long-{error}"
    base = open_run(server.address, session, "base", True, [(0, "fc", "Linear")])
    cand = open_run(server.address, session, "cand", False, [(0, "fc", "Linear")])
    rng = np.random.default_rng(0)
    for s in range(40):
        loss = 5.0 - 0.05 * s
        base.send(step(s, [(0, np.array(loss))], phase=pb.LOSS))
        cand.send(step(s, [(0, np.array(loss + error * rng.choice([-1, 1])))], phase=pb.LOSS))
    finish(base, 39)
    finish(cand, 39)
    summary = server.report_proto(session).long_run[0]
    assert summary.steps == 40 and summary.candidate_run == "cand"
    assert summary.loss_mean_abs == pytest.approx(error, rel=1e-3)
    verdicts = "\n".join(summary.verdicts)
    expected = "PASS" if passes else "FAIL"
    assert f"{expected} first loss" in verdicts and f"{expected} mean loss error" in verdicts, verdicts
    assert "global grad norm" not in verdicts  # no gradients were sent: no verdict rather than a made-up one
    assert "oscillates around 0" in verdicts


def test_renamed_modules_are_matched_automatically_and_the_mapping_can_be_pinned(server, tmp_path):
    import subprocess
    import sys

    h = X.reshape(2, 16)
    base_modules = [(0, "embed", "Embedding"), (1, "layers.0.fc", "Linear"), (2, "layers.0.act", "GELU"), (3, "head", "Linear"), (4, "", "LM")]
    cand_modules = [(0, "model.embed_tokens", "Embedding"), (1, "model.blocks.0.dense", "ColumnParallelLinear"),
                    (2, "model.blocks.0.gelu", "GELU"), (3, "lm_head", "Linear"), (4, "", "LMForCausal")]
    outputs = [h, np.tile(h, 2), np.tile(h, 2) * 0.5, h[:, :4], h[:, :4]]
    base = open_run(server.address, "auto", "base", True, base_modules)
    cand = open_run(server.address, "auto", "cand", False, cand_modules)
    for s in range(2):
        base.send(step(s, list(enumerate(outputs))))
        cand.send(step(s, list(enumerate(o + (0.5 if s == 1 and i == 2 else 0.0) for i, o in enumerate(outputs)))))
    finish(base, 1)
    finish(cand, 1)
    report = server.report_proto("auto")
    assert list(report.unmatched_baseline) == [] and list(report.unmatched_candidate) == []
    first = report.first_divergence
    assert (first.step, first.module, first.candidate_module) == (1, "layers.0.act", "model.blocks.0.gelu")
    pinned = tmp_path / "mapping.yaml"
    out = subprocess.run([sys.executable, "-m", "twinstep", "mapping", "auto", "--server", server.address, "--write", str(pinned)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    from twinstep.server.compare.mapping import NameMapping
    import yaml

    mapping = NameMapping.from_dict(yaml.safe_load(pinned.read_text()))
    assert mapping.to_baseline("model.blocks.0.dense") == "layers.0.fc"
    assert mapping.to_baseline("lm_head") == "head"
