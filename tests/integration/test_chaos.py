"""Network and process faults between real training jobs and a real server change no verdict and lose no record.

Each scenario runs the seeded demo pair (torch baseline, paddle candidate) in
their own processes, each pointed at its own TCP proxy (tcp_proxy.py) in front
of an in-process server, and injects faults: links cut, delayed, one run's
bytes held back so the other's later steps arrive first, a process killed or
stopped.  The same pair run once without faults is the reference: the report
must say the same about the steps both runs delivered (status, steps compared,
first divergence, per-run last step and records received), no training may
crash, and the server's held memory stays bounded.
"""

from __future__ import annotations

import math
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator

import pytest

from tests.conftest import Job, JobResult, last_step, run_status, wait_for
from tests.integration.tcp_proxy import TcpProxy
from tests.integration.test_capture_health import Watcher
from twinstep.server import ServerConfig, serve
from twinstep.server.config import WindowConfig

pytestmark = pytest.mark.timeout(240)  # a hung scenario fails here, not at the suite's timeout

STEPS = 50
STEP_DELAY = "0.08"  # seconds per step: the runs last long enough for faults to land mid-run
CUT_STEP_DELAY = "0.2"  # slower still where each fault waits for a reconnection (0.5 s backoff and more)
CUT_MARGIN = 15
BASE, CAND = "torch", "paddle"
LEAD = 12
"""Where faults must strike mid-run (links held or cut), the pair trains in lockstep: neither leads the other by
more than this many steps while both are connected.  Whichever job starts or trains faster on a busy machine,
neither reaches its end while the other is held or still early, and a held run can catch up and overtake."""
STEP_ON_THE_WIRE = 4096
"""Bytes that mean a step is on the wire: one step of the demo's statistics takes about 9.3 KB, HTTP/2's own
frames (window updates, pings) tens of bytes."""
RECORD_BYTES = 128
"""Bound on what one statistics record takes in the server's window (about 61 bytes measured: 9.3 KB a step)."""
MAX_LEAD = 30
"""Steps one run may hold in the server waiting for the other with the default window: no scenario lets a run
lead by more than about 20, while steps never freed would reach 2 * STEPS = 100."""

DEFAULT_GRACE = {"config": ServerConfig()}
"""The server's defaults, reconnect_grace (30 s) included: a run whose link is cut is lost for a moment, then
resumes; the shared fixture's 0.5 s grace is for tests whose runs never come back."""


class UncomparedSteps(AssertionError):
    """Steps both runs delivered were not compared (the report's coverage differs from the fault-free one)."""


@dataclass
class Reference:
    """The fault-free pair's report (JSON) and per-run records received."""

    report: dict[str, Any]
    records: dict[str, int]

    @property
    def records_per_step(self) -> int:
        per_step = self.records[CAND] // STEPS
        assert per_step * STEPS == self.records[CAND] and per_step > 0, self.records
        return per_step

    def held_bound(self, steps: int = MAX_LEAD) -> int:
        """Bytes of ``steps`` held statistics steps, generously."""
        return steps * RECORD_BYTES * self.records_per_step


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str | None], Reference]]:
    """The fault-free reports, by the candidate's --bug: one run of the pair each, on a server of their own."""
    handle = serve(port=0, config=ServerConfig())
    cache: dict[str | None, Reference] = {}

    def get(bug: str | None) -> Reference:
        if bug not in cache:
            session = f"reference-{bug or 'none'}"
            tmp = tmp_path_factory.mktemp(session)
            base = Job(tmp, "torch", server=handle.address, session=session, run=BASE, baseline=True, steps=STEPS)
            cand = Job(tmp, "paddle", server=handle.address, session=session, run=CAND, steps=STEPS, bug=bug)
            for result in (base.wait(), cand.wait()):
                assert result.returncode == 0, result.output
            runs = {r.name: r for r in handle.report_proto(session).runs}
            assert {r.state for r in runs.values()} == {"finished"}, runs
            cache[bug] = Reference(handle.report(session), {name: r.records_received for name, r in runs.items()})
        return cache[bug]

    yield get
    handle.stop(grace=0.5)


# -- helpers ---------------------------------------------------------------------------------------


def start_pair(jobs: Callable[..., Job], base_address: str, cand_address: str, session: str, *,
               bug: str | None = None, delay: str = STEP_DELAY, lockstep: int = 0) -> tuple[Job, Job]:
    """The demo pair, each job sending to its own address (a proxy), slowed to ``delay`` s a step;
    ``lockstep``: neither leads the other by more than that many steps (0: free)."""
    extra = ["--step-delay", delay, *(["--lockstep", str(lockstep)] if lockstep else [])]
    base = jobs("torch", server=base_address, session=session, run=BASE, baseline=True, steps=STEPS, extra=extra)
    cand = jobs("paddle", server=cand_address, session=session, run=CAND, steps=STEPS, bug=bug, extra=extra)
    return base, cand


def finished(job: Job, timeout: float = 150) -> JobResult:
    """The job's result, which must be a training that ran every step and exited 0."""
    result = job.wait(timeout=timeout)
    assert result.returncode == 0, result.output
    assert result.result["steps_completed"] == STEPS and not result.halted, result.result
    return result


def records(server, session: str) -> dict[str, int]:
    return {r.name: r.records_received for r in server.report_proto(session).runs}


def wait_ended(server, session: str, timeout: float = 60) -> None:
    """Until the server knows every run ended (a job's exit can precede the server reading its goodbye)."""
    wait_for(lambda: (runs := server.report_proto(session).runs) and all(r.state != "streaming" for r in runs),
             timeout=timeout)


def cut_mid_run(server, session: str, links: dict[str, TcpProxy], times: int,
                refuse_for: Callable[[int, str], float]) -> int:
    """Cut every run's link ``times`` times, each once every run is connected again and has delivered two more
    steps, and only while each has CUT_MARGIN steps to go (a training that ends while its server is away is
    another story: its last steps are dropped at close).  ``refuse_for(cut, run)``: seconds that run's new
    connections are refused after that cut.  Returns the cuts made."""
    mark = {run: 1 for run in links}
    for cut in range(times):
        wait_for(partial(back_on_line, server, session, links, mark))
        now = {run: last_step(server, session, run) for run in links}
        if max(now.values()) >= STEPS - CUT_MARGIN:
            return cut
        for run, link in links.items():
            assert link.cut(refuse_for=refuse_for(cut, run)) == 1, run
        mark = {run: step + 1 for run, step in now.items()}
    wait_for(partial(back_on_line, server, session, links, mark))  # well before the end
    return times


def back_on_line(server, session: str, links: dict[str, TcpProxy], mark: dict[str, int]) -> bool:
    """Every run connected through its link, and delivering again: past its step in ``mark``."""
    return (all(link.connections == 1 for link in links.values())
            and all(last_step(server, session, run) > mark[run] for run in links))


def check_same_report(report: dict[str, Any], ref: Reference, records_received: dict[str, int]) -> None:
    """The report says what the fault-free one says about the same steps; raises UncomparedSteps when only
    its coverage differs (steps delivered by both but not compared)."""
    runs = {r["name"]: r for r in report["runs"]}
    ref_runs = {r["name"]: r for r in ref.report["runs"]}
    assert {name: r["last_step"] for name, r in runs.items()} == {name: r["last_step"] for name, r in ref_runs.items()}
    assert records_received == ref.records, "a record was lost or counted twice"
    found, expected = report["first_divergence"], ref.report["first_divergence"]
    if expected is None:
        assert found is None, found
    else:
        assert found is not None, report["status_reasons"]
        keys = ("step", "phase", "module", "metric", "candidate_run")
        assert {k: found[k] for k in keys} == {k: expected[k] for k in keys}
        assert math.isclose(found["value"], expected["value"], rel_tol=1e-6), (found["value"], expected["value"])
    if (report["status"], report["steps_compared"]) != (ref.report["status"], ref.report["steps_compared"]):
        raise UncomparedSteps(f"status {report['status']!r} over {report['steps_compared']} step(s), fault-free "
                              f"{ref.report['status']!r} over {ref.report['steps_compared']}: "
                              f"{report['status_reasons']}")


class Sampler:
    """Samples, every 50 ms in a thread, the largest bytes the server holds for a session and a proxy buffers."""

    def __init__(self, server, session: str, proxy: TcpProxy | None = None) -> None:
        self.held = 0
        self.buffered = 0
        self._server, self._session, self._proxy = server, session, proxy
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            session = self._server.registry.get(self._session)
            if session is not None:
                self.held = max(self.held, session.held_bytes())
            if self._proxy is not None:
                self.buffered = max(self.buffered, self._proxy.buffered_bytes())

    def __enter__(self) -> "Sampler":
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)


# -- scenarios -------------------------------------------------------------------------------------


@pytest.mark.parametrize("server", [DEFAULT_GRACE], indirect=True)
def test_cut_links_reconnect_and_lose_no_record(server, jobs, reference):
    """Both runs' links are cut three times mid-run (once with new connections refused for a while): every
    record reaches the server once, both trainings finish, and the verdict is the fault-free one."""
    ref, session = reference(None), "cuts"
    with TcpProxy(server.address) as base_link, TcpProxy(server.address) as cand_link, \
            Sampler(server, session) as sampler:
        base, cand = start_pair(jobs, base_link.address, cand_link.address, session, delay=CUT_STEP_DELAY,
                                lockstep=LEAD)
        links = {BASE: base_link, CAND: cand_link}
        # The second cut refuses both for a while, the candidate longer: the baseline runs ahead meanwhile.
        refuse = {(1, BASE): 0.7, (1, CAND): 1.5}
        assert cut_mid_run(server, session, links, 3, lambda cut, run: refuse.get((cut, run), 0.0)) == 3
        base_result, cand_result = finished(base), finished(cand)
    wait_ended(server, session)
    for result in (base_result, cand_result):
        assert result.output.count("reconnected to") == 3, result.output  # it came back after each cut
    assert base_link.stats.refused + cand_link.stats.refused > 0  # and was refused while the server looked down
    report = server.report_proto(session)
    assert {r.name: r.state for r in report.runs} == {BASE: "finished", CAND: "finished"}
    assert 0 < sampler.held <= ref.held_bound(), sampler.held
    check_same_report(server.report(session), ref, records(server, session))


def test_a_slow_link_changes_nothing(server, jobs, reference):
    """The candidate's link delays every byte by 50 to 200 ms, both ways (credits and acknowledgements too)."""
    ref, session = reference(None), "delay"
    with TcpProxy(server.address) as base_link, TcpProxy(server.address) as cand_link, \
            Sampler(server, session, cand_link) as sampler:
        cand_link.set_delay(0.15)
        base, cand = start_pair(jobs, base_link.address, cand_link.address, session)
        wait_for(lambda: last_step(server, session, CAND) >= 10)
        cand_link.set_delay(0.05, "up")
        cand_link.set_delay(0.2, "down")
        wait_for(lambda: last_step(server, session, CAND) >= 30)
        cand_link.set_delay(0.2, "up")
        finished(base)
        cand_result = finished(cand)
    wait_ended(server, session)
    assert sampler.buffered > 0 and cand_link.stats.max_wait >= 0.19  # bytes did wait: the delay was on the path
    assert cand_link.stats.cut == 0 and "lost contact" not in cand_result.output
    assert 0 < sampler.held <= ref.held_bound(), sampler.held
    check_same_report(server.report(session), ref, records(server, session))


def test_one_runs_steps_held_back_arrive_after_the_others_later_steps(server, jobs, reference):
    """The candidate's bytes are held while the baseline runs ahead, then the baseline's while the candidate
    catches up and overtakes it: each side's steps wait in the server's window for the other's, and all are
    compared."""
    ref, session = reference(None), "reorder"
    with TcpProxy(server.address) as base_link, TcpProxy(server.address) as cand_link, \
            Sampler(server, session) as sampler:
        base, cand = start_pair(jobs, base_link.address, cand_link.address, session, lockstep=LEAD)
        wait_for(lambda: min(last_step(server, session, BASE), last_step(server, session, CAND)) >= 3)
        cand_link.hold()
        cand_frozen = last_step(server, session, CAND)
        assert cand_frozen + LEAD + 8 < STEPS, f"the candidate was at step {cand_frozen} before it was held"
        # The baseline's later steps reach the server first, and wait there for the candidate's.
        wait_for(lambda: last_step(server, session, BASE) >= cand_frozen + 8)
        # Now the baseline's turn: held before the candidate's steps go, so the candidate overtakes it.
        base_link.hold()
        base_frozen = last_step(server, session, BASE)
        assert base_frozen <= cand_frozen + LEAD + 1, (base_frozen, cand_frozen)  # lockstep bounded its lead
        held_a_step(cand_link)  # the held run kept training: its steps are in the proxy
        assert last_step(server, session, CAND) <= cand_frozen + 1  # at most the step already on its way
        cand_link.release()
        wait_for(lambda: last_step(server, session, CAND) >= base_frozen + 8)
        held_a_step(base_link)
        assert last_step(server, session, BASE) <= base_frozen + 1
        base_link.release()
        wait_for(lambda: last_step(server, session, BASE) >= base_frozen + 8)
        base_result, cand_result = finished(base), finished(cand)
    wait_ended(server, session)
    assert "lost contact" not in base_result.output + cand_result.output  # held, never cut
    assert 0 < sampler.held <= ref.held_bound(), sampler.held
    check_same_report(server.report(session), ref, records(server, session))


def held_a_step(link: TcpProxy) -> None:
    """Until the bytes ``link`` holds back include a step (the candidate's run may train slowly on a busy
    machine): more than HTTP/2's own frames, which keep flowing while nothing is sent."""
    wait_for(lambda: link.buffered_bytes("up") >= STEP_ON_THE_WIRE)


@pytest.mark.parametrize("server", [DEFAULT_GRACE], indirect=True)
def test_a_cut_while_held_makes_the_run_resend_and_nothing_counts_twice(server, jobs, reference):
    """The candidate's link is cut while its steps are held in the proxy (lost in flight): it reconnects and
    sends them again; the server counts each record once."""
    ref, session = reference(None), "held-cut"
    with TcpProxy(server.address) as base_link, TcpProxy(server.address) as cand_link, \
            Sampler(server, session) as sampler:
        base, cand = start_pair(jobs, base_link.address, cand_link.address, session, lockstep=LEAD)
        wait_for(lambda: min(last_step(server, session, BASE), last_step(server, session, CAND)) >= 3)
        cand_link.hold()
        frozen = last_step(server, session, CAND)
        assert frozen + 6 < STEPS, f"the candidate was at step {frozen} before it was held"
        wait_for(lambda: last_step(server, session, BASE) >= frozen + 6)  # the baseline keeps going
        held_a_step(cand_link)
        assert cand_link.cut() == 1  # the held steps are gone with the connection
        # Its reconnection is held too (the baseline keeps going) until it is back through the link.
        wait_for(lambda: cand_link.connections == 1 and cand_link.buffered_bytes("up") > 0)
        cand_link.release()
        finished(base)
        cand_result = finished(cand)
    wait_ended(server, session)
    assert cand_result.result["steps_sent"] > STEPS, cand_result.result  # steps went on the wire twice
    # The reconnection's Welcome says which steps the server holds, so it is sent only those it lacks: of the
    # steps sent twice, the server can have had to skip at most all (it skips each one it holds, uncounted).
    resent = {r.name: r.steps_resent for r in server.report_proto(session).runs}
    assert resent[CAND] <= cand_result.result["steps_sent"] - STEPS and resent[BASE] == 0, resent
    assert cand_result.output.count("reconnected to") >= 1, cand_result.output
    assert 0 < sampler.held <= ref.held_bound(), sampler.held
    check_same_report(server.report(session), ref, records(server, session))


def test_a_killed_training_is_lost_and_the_other_finishes(server, jobs, reference):
    """SIGKILL of the candidate mid-run: the baseline finishes, the report and a watcher name the candidate
    lost with how long it was silent, and what both delivered was compared as without the fault."""
    ref, session = reference(None), "killed"
    watcher = Watcher(server.address, session)
    with TcpProxy(server.address) as base_link, TcpProxy(server.address) as cand_link, \
            Sampler(server, session) as sampler:
        base, cand = start_pair(jobs, base_link.address, cand_link.address, session)
        wait_for(lambda: last_step(server, session, CAND) >= 10)
        cand.process.send_signal(signal.SIGKILL)
        assert cand.process.wait(10) == -signal.SIGKILL
        base_result = finished(base)
    wait_ended(server, session)
    report = server.report_proto(session)
    runs = {r.name: r for r in report.runs}
    assert runs[CAND].state == "lost" and runs[BASE].state == "finished", runs
    killed_at = runs[CAND].last_step
    assert 10 <= killed_at < STEPS - 1
    silence = re.compile(rf"run '{CAND}' lost its connection after step {killed_at}, (\d+\.\d) s after its last")
    assert any(silence.search(reason) for reason in report.status_reasons), report.status_reasons
    wait_for(lambda: any(f"run '{CAND}' rank 0 is lost after step {killed_at}" in line
                         and re.search(r"\d+\.\d s after its last message", line) for line in watcher.lines),
             timeout=30)
    watcher.close()
    assert base_result.result["steps_sent"] == STEPS
    # Every delivered record counted once: all of the baseline's, and the candidate's up to its last step.
    assert records(server, session) == {BASE: ref.records[BASE], CAND: (killed_at + 1) * ref.records_per_step}
    assert report.steps_compared == killed_at + 1 and not report.HasField("first_divergence")
    assert report.status == "incomplete"  # not "aligned" over steps the candidate never reached
    (coverage,) = report.coverage
    assert [(r.first, r.last) for r in coverage.compared] == [(0, killed_at)]
    assert 0 < sampler.held <= ref.held_bound(), sampler.held


@pytest.mark.parametrize("server", [{"config": ServerConfig(window=WindowConfig(steps=4))}], indirect=True)
def test_a_run_stalled_past_the_window_leaves_the_other_running_and_the_gap_named(server, jobs, reference):
    """The candidate is stopped (SIGSTOP) while the baseline runs its remaining steps, far past a 4-step
    window: the baseline finishes without waiting, the server holds at most its window, and the report
    names the steps it could not compare instead of calling the pair aligned."""
    ref, session = reference(None), "stall"
    with TcpProxy(server.address) as base_link, TcpProxy(server.address) as cand_link, \
            Sampler(server, session) as sampler:
        base, cand = start_pair(jobs, base_link.address, cand_link.address, session)
        wait_for(lambda: last_step(server, session, CAND) >= 3)
        os.kill(cand.process.pid, signal.SIGSTOP)
        try:
            stalled_at = last_step(server, session, CAND)
            base_result = finished(base)  # fail-open: it never waits for the stalled run
            wait_for(lambda: (status := run_status(server, session, BASE)) and status.state == "finished")
            assert cand.process.poll() is None and last_step(server, session, CAND) <= stalled_at + 1
        finally:
            os.kill(cand.process.pid, signal.SIGCONT)
        cand_result = finished(cand)
    wait_ended(server, session)
    report = server.report(session)
    runs = {r["name"]: r for r in report["runs"]}
    assert records(server, session) == ref.records  # every record reached the server, once
    assert {name: r["last_step"] for name, r in runs.items()} == {BASE: STEPS - 1, CAND: STEPS - 1}
    assert report["first_divergence"] is None and ref.report["first_divergence"] is None
    # Honest coverage: not "aligned" over steps it dropped, and every step is either compared or a named gap.
    assert report["status"] == "incomplete" and report["status_reasons"], report
    assert 0 < report["steps_compared"] < ref.report["steps_compared"] == STEPS
    (coverage,) = report["coverage"]
    compared = {s for first, last in coverage["compared"] for s in range(first, last + 1)}
    gaps = {s for gap in coverage["gaps"] for s in range(gap["first_step"], gap["last_step"] + 1)}
    assert len(compared) == report["steps_compared"] and not compared & gaps
    assert compared | gaps == set(range(STEPS)), coverage
    assert set(range(stalled_at + 2, STEPS - 8)) <= gaps, coverage  # the stall's steps, but for the window's
    assert all(gap["run"] == BASE and "window overflowed" in gap["reason"] for gap in coverage["gaps"]), coverage
    dropped = runs[BASE]["dropped_by_reason"]
    assert dropped.get("server_window", 0) > 0, runs  # dropped by the window, and said so
    assert "not compared" in coverage["summary"]
    # Bounded: at most the window of each run (plus the step being added), never the whole stall.
    assert 0 < sampler.held <= ref.held_bound(2 * (4 + 1)), sampler.held
    assert base_result.result["dropped"] == {} and cand_result.result["dropped"] == {}


@pytest.mark.parametrize("server", [DEFAULT_GRACE], indirect=True)
def test_a_divergence_is_found_the_same_through_cuts(server, jobs, reference):
    """The candidate carries the tanh-GELU bug; both links refuse at the start (step 0 waits in the outboxes)
    and are cut twice mid-run (the candidate's refused for a second): the first divergence is the fault-free
    one, to its value."""
    ref, session = reference("gelu_tanh"), "diverged-cuts"
    assert ref.report["first_divergence"] is not None
    with TcpProxy(server.address) as base_link, TcpProxy(server.address) as cand_link, \
            Sampler(server, session) as sampler:
        for link in (base_link, cand_link):
            link.cut(refuse_for=60)
        base, cand = start_pair(jobs, base_link.address, cand_link.address, session, bug="gelu_tanh",
                                delay=CUT_STEP_DELAY, lockstep=LEAD)
        wait_for(lambda: base_link.stats.refused and cand_link.stats.refused)
        time.sleep(1.0)  # both train on, their first steps waiting in their outboxes
        assert server.registry.get(session) is None
        for link in (base_link, cand_link):
            link.accept()
        links = {BASE: base_link, CAND: cand_link}
        assert cut_mid_run(server, session, links, 2, lambda cut, run: 1.0 if (cut, run) == (0, CAND) else 0.0) == 2
        base_result, cand_result = finished(base), finished(cand)
    wait_ended(server, session)
    for result in (base_result, cand_result):
        assert result.output.count("reconnected to") >= 2, result.output
    assert 0 < sampler.held <= ref.held_bound(), sampler.held
    check_same_report(server.report(session), ref, records(server, session))


@pytest.mark.parametrize("server", [DEFAULT_GRACE], indirect=True)
def test_a_link_down_as_training_ends_is_waited_for_within_the_close_timeout(server, jobs):
    """The server is unreachable for 2 s just as the training ends with steps queued: close() keeps trying
    within its 10 s flush, so the last steps arrive and the run ends finished, not lost."""
    session = "tail"
    with TcpProxy(server.address) as link:
        job = jobs(BASE, server=link.address, session=session, baseline=True, steps=10,
                   extra=["--step-delay", "0.3"])
        wait_for(lambda: last_step(server, session, BASE) >= 7, timeout=60)
        link.cut(refuse_for=2.0)
        result = job.wait()
    assert result.returncode == 0, result.output
    assert not {k: v for k, v in result.result["dropped"].items() if v}, result.result["dropped"]
    status = wait_for(lambda: (s := run_status(server, session, BASE)) is not None and s.state != "streaming" and s)
    assert (status.state, status.last_step) == ("finished", 9)
