"""The mapping a candidate is compared with: the user's rules, msprobe layer rules and automatic matches together."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import wait_for
from tests.integration.rawclient import RawStream, hello, manifest, step
from twinstep.server.config import config_from_dict

X = np.linspace(-1, 1, 12)
Y = np.linspace(0, 3, 12)


@pytest.fixture
def layer_rules(tmp_path):
    path = tmp_path / "layers.yaml"
    path.write_text("Block:\n  attention: attn\n")
    return config_from_dict({"layer_mapping_file": str(path)})


def _run(address, session, run, baseline, modules):
    stream = RawStream(address).send(hello(session, run, baseline=baseline)).send(manifest(*modules))
    assert stream.next().WhichOneof("body") == "welcome"
    return stream


@pytest.mark.parametrize("auto_mapping", [True, False])
def test_layer_rules_keep_applying_once_automatic_matching_fires(tmp_path, auto_mapping, layer_rules):
    """msprobe layer_mapping + automatic matching (the default): both apply, on every step."""
    from twinstep.server import serve

    layer_rules.comparison.auto_mapping = auto_mapping
    handle = serve(port=0, config=layer_rules)
    try:
        base = _run(handle.address, "layers", "torch", True,
                    [(0, "block", "Block"), (1, "block.attn", "Attention"), (2, "fc", "Linear")])
        # block.attention is renamed by the layer rule; fc -> proj only automatic matching can find.
        cand = _run(handle.address, "layers", "paddle", False,
                    [(0, "block", "Block"), (1, "block.attention", "Attention"), (2, "proj", "Linear")])
        for number in range(3):
            base.send(step(number, [(0, X), (1, Y), (2, X * 2)]))
            cand.send(step(number, [(0, X), (1, Y), (2, X * 2)]))
        wait_for(lambda: handle.report_proto("layers").steps_compared == 3)
        report = handle.report_proto("layers")
        assert "forward:block.attn" not in report.unmatched_baseline, list(report.unmatched_baseline)
        assert "forward:block.attention" not in report.unmatched_candidate, list(report.unmatched_candidate)
        if auto_mapping:
            assert not report.unmatched_baseline and not report.unmatched_candidate
            assert "proj: fc" in report.proposed_mapping
        last = handle.last_comparison("layers")
        compared = {(r.name, r.candidate_name) for r in last.rows if r.phase == "forward"}
        assert ("block.attn", "block.attention") in compared
    finally:
        handle.stop(grace=0.5)
