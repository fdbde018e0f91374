"""Sessions survive the server: a journal on disk, replayed on restart; finished sessions leave memory and stay
readable; `twinstep sessions` lists them.

The restart that matters is a crash (SIGKILL of a server process while real torch and paddle jobs stream to it):
the jobs reconnect, resend what was not acknowledged, and the report equals the report of the same jobs on a
server that never went down, with every record counted once.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from tests.conftest import ROOT, serve_process, wait_for
from tests.integration.rawclient import RawStream, hello, manifest, step
from twinstep.server import ServerConfig, serve
from twinstep.server.config import JournalConfig, SessionsConfig
from twinstep.server.journal.store import JournalError
from twinstep.server.report.render import report_to_dict
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc

STEPS = 30
LEAD = 5
# The reports are compared field for field with a run that never saw the fault, so the jobs' statistics must
# be bit-reproducible: numpy's passes throughout (the compiled kernel takes over whenever its background load
# ends, and sums in another order), one thread per job (threaded CPU kernels round differently run to run).
DETERMINISTIC = {"TWINSTEP_JIT": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CPU_NUM": "1"}


def comparable(report: pb.Report) -> dict:
    """What must not change across a restart: the verdict, what was compared, what was found, every count.

    Left out: attach-time environment and warnings, ``steps_resent`` (how many resends a reconnect caused,
    which depends on when the fault struck; exactly-once is checked on ``records_received``), and the
    wall time capture waited at step boundaries (its byte counts stay: each step is counted once).
    """
    data = report_to_dict(report)
    for run in data.get("runs", []):
        for key in ("environment", "warnings", "steps_resent", "health"):
            run.pop(key, None)
        if run.get("capture_cost"):
            run["capture_cost"].pop("boundary_seconds")
    return data


def get_report(address: str, session: str) -> pb.Report:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.TwinstepStub(channel).GetReport(pb.ReportRequest(session=session), timeout=10)


def list_sessions(address: str) -> pb.SessionList:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.TwinstepStub(channel).ListSessions(pb.ListSessionsRequest(), timeout=10)


def try_report(address: str, session: str) -> pb.Report | None:
    try:
        return get_report(address, session)
    except grpc.RpcError:
        return None


def ended(report: pb.Report | None) -> bool:
    return report is not None and len(report.runs) == 2 and all(r.state != "streaming" for r in report.runs)


def start_pair(jobs, address: str, session: str, *, bug: str = "none", delay: float = 0.0):
    """The pair; ``delay``: seconds a step, in lockstep (neither leads by more than LEAD steps), so the server is
    killed mid-run however much sooner one job starts training on a busy machine."""
    extra = ["--step-delay", str(delay), "--lockstep", str(LEAD)] if delay else []
    base = jobs("torch", server=address, session=session, baseline=True, steps=STEPS, extra=extra, env=DETERMINISTIC)
    cand = jobs("paddle", server=address, session=session, steps=STEPS, bug=bug, extra=extra, env=DETERMINISTIC)
    return base, cand


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory) -> dict[str, pb.Report]:
    """The reports of the same jobs on a server that never went down (faithful port, and the lr bug)."""
    from tests.conftest import Job

    handle = serve(port=0, config=ServerConfig())
    tmp = tmp_path_factory.mktemp("fault-free")
    try:
        started = []
        for bug in ("none", "lr"):
            started += [Job(tmp, "torch", server=handle.address, session=f"ref-{bug}", baseline=True, steps=STEPS,
                            env=DETERMINISTIC),
                        Job(tmp, "paddle", server=handle.address, session=f"ref-{bug}", steps=STEPS, bug=bug,
                            env=DETERMINISTIC)]
        for job in started:
            assert job.wait().returncode == 0
        wait_for(lambda: all(ended(try_report(handle.address, f"ref-{bug}")) for bug in ("none", "lr")), timeout=30)
        return {bug: handle.report_proto(f"ref-{bug}") for bug in ("none", "lr")}
    finally:
        handle.stop(grace=0.5)


@pytest.mark.parametrize("bug", ["none", "lr"])
def test_server_killed_mid_run_and_restarted_on_its_journal(jobs, tmp_path: Path, fault_free, bug: str):
    journal = tmp_path / "journal"
    server, address = serve_process("--journal", str(journal))
    port = address.rsplit(":", 1)[1]
    session = f"ref-{bug}"  # the same name as the fault-free run: reports must match field for field
    base, cand = start_pair(jobs, address, session, bug=bug, delay=0.2)
    try:
        # Kill it once both runs are well into the run, with steps compared and steps in flight.
        before = wait_for(lambda: (r := try_report(address, session)) is not None and r.steps_compared >= 5 and r,
                          timeout=120)
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=10)
        time.sleep(1.0)  # the jobs train on meanwhile, queueing their steps
        server, again = serve_process("--journal", str(journal), "--port", port)
        assert again.endswith(f":{port}")
        assert base.wait().returncode == 0 and cand.wait().returncode == 0
        wait_for(lambda: ended(try_report(address, session)), timeout=60)
        report = get_report(address, session)
    finally:
        server.kill()
        server.wait(timeout=10)
    assert max(r.last_step for r in before.runs) < STEPS - 5, "the server was killed too late to test a restart"
    expected = fault_free[bug]
    assert comparable(report) == comparable(expected)
    for run, reference in zip(report.runs, expected.runs):
        # Exactly once: every record of every step counted once, though the clients resent after the crash.
        assert run.records_received == reference.records_received > 0
        assert run.last_step == STEPS - 1 and run.dropped == 0
    assert report.status == ("aligned" if bug == "none" else "diverged")


def _stream(address: str, session: str, run: str, steps, *, baseline: bool = False, close: bool = True,
            values=np.linspace(-1, 1, 16)) -> RawStream:
    stream = RawStream(address).send(hello(session, run, baseline=baseline)).send(manifest((0, "fc", "Linear")))
    assert stream.next().WhichOneof("body") == "welcome"
    for number in steps:
        stream.send(step(number, [(0, values)]))
    if close:
        stream.send(pb.ClientMessage(close=pb.Close(reason="finished", last_step=list(steps)[-1])))
        stream.close()
        stream.wait_end()
    return stream


def test_a_graceful_restart_resumes_a_session_and_a_client_resumes_where_the_journal_ends(tmp_path: Path):
    config = ServerConfig(journal=JournalConfig(directory=str(tmp_path)))
    first = serve(port=0, config=config)
    try:
        _stream(first.address, "s", "torch", range(5), baseline=True)
        cand = _stream(first.address, "s", "paddle", range(3), close=False)
        wait_for(lambda: first.report_proto("s").steps_compared == 3)
        before = first.report_proto("s")
    finally:
        first.stop(grace=0.5)  # the candidate's stream is open: it ends UNAVAILABLE, no loss
    cand.channel.close()
    second = serve(port=0, config=ServerConfig(journal=JournalConfig(directory=str(tmp_path))))
    try:
        restored = second.report_proto("s")
        assert comparable(restored) == comparable(before)
        assert {r.name: r.records_received for r in restored.runs} == {"torch": 5, "paddle": 3}
        # The candidate comes back: its Welcome says which steps the journal holds; it sends the rest.
        stream = RawStream(second.address).send(hello("s", "paddle")).send(manifest((0, "fc", "Linear")))
        welcome = stream.next()
        assert welcome.welcome.last_step_received == 2
        stream.send(step(2, [(0, np.linspace(-1, 1, 16))]))  # one resend the server already holds
        for number in (3, 4):
            stream.send(step(number, [(0, np.linspace(-1, 1, 16))]))
        stream.send(pb.ClientMessage(close=pb.Close(reason="finished", last_step=4)))
        stream.close()
        stream.wait_end()
        report = wait_for(lambda: (r := second.report_proto("s")).status == "aligned" and r)
        assert report.steps_compared == 5
        paddle = next(r for r in report.runs if r.name == "paddle")
        assert (paddle.records_received, paddle.steps_resent) == (5, 1)
    finally:
        second.stop(grace=0.5)


def test_finished_sessions_leave_memory_and_stay_listed_and_readable(tmp_path: Path):
    config = ServerConfig(journal=JournalConfig(directory=str(tmp_path)), sessions=SessionsConfig(ttl=0.3))
    handle = serve(port=0, config=config)
    try:
        _stream(handle.address, "done", "torch", range(4), baseline=True)
        _stream(handle.address, "done", "paddle", range(4))
        final = wait_for(lambda: (r := handle.report_proto("done")).status == "aligned" and r)
        wait_for(lambda: handle.registry.get("done") is None)  # out of memory
        assert comparable(get_report(handle.address, "done")) == comparable(final)  # read from the journal
        (row,) = list_sessions(handle.address).sessions
        assert (row.name, row.status, row.in_memory, row.steps_compared) == ("done", "aligned", False, 4)
        assert list(row.runs) == ["torch", "paddle"] and row.ended_unix > 0
    finally:
        handle.stop(grace=0.5)
    again = serve(port=0, config=ServerConfig(journal=JournalConfig(directory=str(tmp_path))))
    try:
        assert again.registry.get("done") is None  # archived sessions are not replayed
        assert comparable(again.report_proto("done")) == comparable(final)
        listed = subprocess.run([sys.executable, "-m", "twinstep", "sessions", "--server", again.address],
                                cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert "done" in listed.stdout and "journal" in listed.stdout and "aligned" in listed.stdout
    finally:
        again.stop(grace=0.5)


def test_without_a_journal_finished_sessions_keep_their_report_in_memory():
    handle = serve(port=0, config=ServerConfig(sessions=SessionsConfig(ttl=0.2)))
    try:
        _stream(handle.address, "mem", "torch", range(2), baseline=True)
        _stream(handle.address, "mem", "paddle", range(2))
        wait_for(lambda: handle.registry.get("mem") is None)
        assert get_report(handle.address, "mem").status == "aligned"
        (row,) = list_sessions(handle.address).sessions
        assert not row.in_memory and row.status == "aligned"
    finally:
        handle.stop(grace=0.5)


def test_a_stream_that_never_returns_after_a_restart_is_lost(tmp_path: Path):
    first = serve(port=0, config=ServerConfig(journal=JournalConfig(directory=str(tmp_path))))
    try:
        _stream(first.address, "gone", "torch", range(3), baseline=True)
        _stream(first.address, "gone", "paddle", range(2), close=False)
        wait_for(lambda: first.report_proto("gone").steps_compared == 2)
    finally:
        first.stop(grace=0.5)
    second = serve(port=0, config=ServerConfig(journal=JournalConfig(directory=str(tmp_path)), sessions=SessionsConfig(resume_grace=0.5)))
    try:
        assert next(r for r in second.report_proto("gone").runs if r.name == "paddle").state == "streaming"
        report = wait_for(lambda: (r := second.report_proto("gone")).status != "running" and r)
        paddle = next(r for r in report.runs if r.name == "paddle")
        assert paddle.state == "lost" and report.status == "incomplete"
        history = [e.alert.message for e in second.registry.get("gone").events.history if e.HasField("alert")]
        assert any("did not reconnect within" in message for message in history), history
    finally:
        second.stop(grace=0.5)


def test_a_second_server_on_the_same_journal_is_refused(tmp_path: Path):
    handle = serve(port=0, config=ServerConfig(journal=JournalConfig(directory=str(tmp_path))))
    try:
        with pytest.raises(JournalError, match="another twinstep server"):
            serve(port=0, config=ServerConfig(journal=JournalConfig(directory=str(tmp_path))))
    finally:
        handle.stop(grace=0.5)


def test_a_file_that_is_no_journal_is_a_clear_error(tmp_path: Path):
    (tmp_path / "journal.sqlite3").write_bytes(b"not a database, but bytes " * 100)
    result = subprocess.run([sys.executable, "-m", "twinstep", "serve", "--port", "0", "--journal", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "is not a twinstep journal" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def _break_candidate(handle, session: str) -> None:
    """The baseline delivers steps 0 to 3 and closes; the candidate delivers 0 and 1, then its link breaks."""
    _stream(handle.address, session, "torch", range(4), baseline=True)
    stream = _stream(handle.address, session, "paddle", range(2), close=False)
    wait_for(lambda: handle.report_proto(session).steps_compared == 2)
    stream.channel.close()


def test_a_grace_that_ran_out_before_a_restart_stays_run_out(tmp_path: Path):
    first = serve(port=0, config=ServerConfig(journal=JournalConfig(directory=str(tmp_path)), sessions=SessionsConfig(reconnect_grace=0.3)))
    try:
        _break_candidate(first, "expired")
        before = wait_for(lambda: (r := first.report_proto("expired")).status == "incomplete" and r)
    finally:
        first.stop(grace=0.5)
    # The end of the grace is journaled: the replay releases the run at the same point, with no new grace.
    second = serve(port=0, config=ServerConfig(journal=JournalConfig(directory=str(tmp_path)), sessions=SessionsConfig(reconnect_grace=30)))
    try:
        assert comparable(second.report_proto("expired")) == comparable(before)
    finally:
        second.stop(grace=0.5)


def test_a_grace_running_at_a_restart_runs_again_after_it(tmp_path: Path):
    first = serve(port=0, config=ServerConfig(journal=JournalConfig(directory=str(tmp_path)), sessions=SessionsConfig(reconnect_grace=30)))
    try:
        _break_candidate(first, "pending")
        wait_for(lambda: first.report_proto("pending").runs[-1].state == "lost")
        assert first.report_proto("pending").status == "running"  # within its grace
    finally:
        first.stop(grace=0.5)
    second = serve(port=0, config=ServerConfig(journal=JournalConfig(directory=str(tmp_path)), sessions=SessionsConfig(reconnect_grace=0.5)))
    try:
        assert second.report_proto("pending").status == "running"  # still free to come back
        report = wait_for(lambda: (r := second.report_proto("pending")).status != "running" and r)
        assert report.status == "incomplete" and report.steps_compared == 2
    finally:
        second.stop(grace=0.5)
