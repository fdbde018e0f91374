"""64 streams (2 runs x 32 ranks, 600 records a step) against one server process for a bounded time.

The load is benchmarks/load_streams.py's, imported rather than copied: a
session of a baseline and a candidate with 32 ranks each, every stream on its
own gRPC channel from two client processes, sending as fast as the server's
Credit allows, ranks within two steps of each other, for 2 s of warm-up and
10 s measured.  Every stream is then told one last step, sends up to it, says
Close and waits for its stream to end.  Midway, the candidate's rank 16 sends
one divergent step; three small probe sessions diverge beside the load.

What must hold, and nothing about timing (the benchmark reports the figures):
every stream joined and ended cleanly, none refused or commanded; every step of
every rank was compared; the server received each record the clients put on
the wire, once (RunStatus.records_received), dropped none and took none twice;
the injected divergence is the one declared; every watcher heard its
divergence; the server still answers GetReport; and its peak resident size
stays under RSS_BOUND_MB.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import load_streams  # benchmarks/ is not a package: on sys.path above

RANKS, RECORDS = 32, 600

RSS_BOUND_MB = 512
"""The server's peak VmHWM; measured at 160 to 210 MB with this load: some 70 MB of interpreter, libraries
and 64 streams, plus the steps sent but not yet taken.  Credit lets each stream have at most
max_inflight_steps (16) steps past what the server took, so at most 64 x 16 steps of 37.5 kB (38 MB)
wait in gRPC's receive buffers.  Before that bound they could reach 64 x 256 steps (614 MB: peaks of
400 to 730 MB were measured), and holding compared steps instead of freeing them (about 72 kB of server
memory per step of 600 records, 200 to 300 steps x 64 streams here) would also pass 512 MB."""


def _module_of_injected_record() -> str:
    manifest, layout = load_streams._layout(RECORDS, False)
    record = layout[load_streams._diverge_index(layout)]
    return next(m.name for m in manifest.modules if m.id == record.target)


@pytest.mark.timeout(150)
def test_64_streams_for_a_bounded_time_lose_no_record(tmp_path):
    cfg = load_streams.LoadConfig(ranks=RANKS, records=RECORDS, warmup=2.0, seconds=10.0, clients=2, slack=2,
                                  phases=(load_streams.SATURATION,), probes=3, inject=True,
                                  log=str(tmp_path / "server.log"))
    result = load_streams.run_load(cfg)
    seen = f"{load_streams.describe(result)}\n-- server log, last lines:\n{result.server_log_tail}"
    print(seen)  # the figures, with -s; pytest shows them on a failure anyway

    # Every stream joined, was served to its end, and nobody was refused, failed or told to halt.
    assert len(result.outcomes) == 2 * RANKS, seen
    assert all(o.welcomed and o.welcome_last_step == -1 for o in result.outcomes), seen
    assert result.rejected == [], seen
    assert result.run_ranks == {"base": RANKS, "cand": RANKS}, seen
    assert result.run_states == {"base": "finished", "cand": "finished"}, seen

    # Every stream sent steps 0..final_step, each acknowledged, and every step of every rank was compared.
    assert result.final_step > 0, seen
    assert all(o.last_step == result.final_step and o.acked == o.last_step for o in result.outcomes), seen
    assert result.final_steps_compared == result.final_step + 1, seen

    # Lost records: what the clients put on the wire, per run, against what the server counted in.
    assert result.sent == {run: RANKS * (result.final_step + 1) * RECORDS for run in ("base", "cand")}, seen
    assert result.lost == {"base": 0, "cand": 0}, seen
    assert result.resent == {"base": 0, "cand": 0}, seen
    assert result.dropped == {"base": {}, "cand": {}}, seen

    # The divergence injected under load is the one declared, and every watcher heard of its own.
    assert result.injected is not None, seen
    step, rank, _ = result.injected
    assert result.divergence == (step, rank, "forward", _module_of_injected_record()), seen
    assert result.status == "diverged" and result.alert_ms is not None, seen
    probes = result.phases[0]
    assert len(probes.probe_alert_ms) == cfg.probes and probes.probes_missing == 0, seen

    # The server kept answering, and its memory stayed bounded.
    assert result.server_alive and probes.report_ms, seen
    assert 0 < result.rss_mb["peak (VmHWM)"] < RSS_BOUND_MB, seen
