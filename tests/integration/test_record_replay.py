"""Record and replay with real jobs: a torch baseline and a paddle port with a bug, recorded by `twinstep serve
--record`; a week later (here: a new server process) the paddle port alone against the recorded baseline gives the
live pair's report, and `twinstep compare-recordings` of the two recorded runs finds the same first divergence.
A truncated or damaged copy of the recording is compared up to the damage, with an error saying where.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from tests.conftest import ROOT, Job, serve_process, wait_for
from twinstep.server.report.render import report_to_dict
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc

STEPS = 8
SESSION = "port"
# Field-for-field equal reports need bit-reproducible statistics in the jobs (as test_durable_sessions.py does):
# numpy's passes throughout, one thread per job.
DETERMINISTIC = {"TWINSTEP_JIT": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CPU_NUM": "1"}


def comparable(report: pb.Report) -> dict:
    """Everything but timings (the wall time capture waited at step boundaries: the candidate ran twice) and
    auto_ops' capture of a module's operations after the divergence: a live baseline can be asked for it, a
    recording holds only what was captured (docs/recording.md), so only the live pair asks."""
    data = report_to_dict(report)
    for run in data["runs"]:
        if run.get("capture_cost"):
            run["capture_cost"].pop("boundary_seconds")
    data["zooms"] = [z for z in data.get("zooms", []) if z.get("origin") != "auto-ops"]
    data.pop("operations", None)
    return data


def get_report(address: str, session: str) -> pb.Report | None:
    try:
        with grpc.insecure_channel(address) as channel:
            return pb_grpc.TwinstepStub(channel).GetReport(pb.ReportRequest(session=session), timeout=10)
    except grpc.RpcError:
        return None


def ended(report: pb.Report | None) -> bool:
    return report is not None and len(report.runs) == 2 and all(r.state != "streaming" for r in report.runs)


def stop(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGTERM)  # a clean stop: every recording ends with its END frame
    assert server.wait(timeout=20) == 0


def paddle_port(tmp: Path, address: str) -> Job:
    return Job(tmp, "paddle", server=address, session=SESSION, steps=STEPS, bug="gelu_tanh", env=DETERMINISTIC)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> SimpleNamespace:
    """The live pair on a recording server: its report, and the recording it left."""
    tmp = tmp_path_factory.mktemp("record")
    directory = tmp / "recordings"
    server, address = serve_process("--record", str(directory))
    try:
        base = Job(tmp, "torch", server=address, session=SESSION, baseline=True, steps=STEPS, env=DETERMINISTIC)
        cand = paddle_port(tmp, address)
        assert base.wait().returncode == 0 and cand.wait().returncode == 0
        live = wait_for(lambda: (r := get_report(address, SESSION)) is not None and ended(r) and r, timeout=30)
    finally:
        stop(server)
    files = sorted(directory.glob("*.twrec"))
    assert len(files) == 1, files
    return SimpleNamespace(tmp=tmp, directory=directory, file=files[0], live=live)


def test_the_live_pair_diverged_where_the_bug_is(recorded):
    live = recorded.live
    assert live.status == "diverged" and live.steps_compared == STEPS
    assert (live.first_divergence.step, live.first_divergence.phase,
            live.first_divergence.module) == (0, "forward", "layers.1.mlp.act")


def test_a_candidate_against_the_recorded_baseline_gets_the_live_pairs_report(recorded):
    server, address = serve_process("--replay", f"{SESSION}={recorded.directory}:torch")
    try:
        assert paddle_port(recorded.tmp, address).wait().returncode == 0
        replayed = wait_for(lambda: (r := get_report(address, SESSION)) is not None and ended(r) and r, timeout=30)
    finally:
        stop(server)
    got, want = comparable(replayed), comparable(recorded.live)
    assert set(got) == set(want)
    for key in want:  # field by field, so a failure names the field
        assert got[key] == want[key], key


def compare_recordings(*args: str) -> tuple[int, dict, str]:
    out = subprocess.run([sys.executable, "-m", "twinstep", "compare-recordings", *args, "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    return out.returncode, json.loads(out.stdout) if out.stdout.strip() else {}, out.stderr


def test_compare_recordings_finds_the_live_first_divergence(recorded):
    code, report, _ = compare_recordings(f"{recorded.file}:torch", f"{recorded.file}:paddle")
    live = report_to_dict(recorded.live)
    assert code == 1 and report["status"] == "diverged"
    assert report["first_divergence"] == live["first_divergence"]
    assert report["steps_compared"] == live["steps_compared"]


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_recording_is_compared_up_to_the_damage(recorded, tmp_path, damage):
    data = bytearray(recorded.file.read_bytes())
    copy = tmp_path / f"{damage}.twrec"
    cut = len(data) * 2 // 3
    if damage == "truncated":
        copy.write_bytes(data[:cut])
    else:
        data[cut] ^= 0x5A
        copy.write_bytes(data)
    code, report, stderr = compare_recordings(str(copy))
    assert code == 2
    said = "truncated at byte" if damage == "truncated" else "corrupt at byte"
    assert said in stderr and any(said in error for error in report["errors"]), stderr
    assert "Traceback" not in stderr
    # The partial report: what was read before the damage, judged; the bug at step 0 is still found.
    assert report["status"] == "diverged" and report["first_divergence"]["step"] == 0
    assert 0 < report["steps_compared"] < STEPS
    assert "lost" in {run["state"] for run in report["runs"]}
