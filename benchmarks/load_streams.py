"""64-stream load: one session, 2 runs x 32 ranks on one server; records/s held, ack and alert latency, RSS, lost.

    python benchmarks/load_streams.py [--ranks 32] [--records 600] [--seconds 20] [--warmup 3] [--clients 2]
                                      [--slack 2] [--phases saturation,paced] [--rate 0] [--fraction 0.5]
                                      [--probes 15] [--no-inject] [--server-arg=--config=FILE ...]
                                      [--shards 0,1,2,4] [--ray-cpus N] [--shard-arg=--shard-poll=0.1 ...]

A new file rather than a mode of server_load.py: it measures something else
(per-step acknowledgement and alert latency inside one loaded session, and
loss accounting when every stream ends), its streams are pulled by gRPC rather
than fed from a queue, and tests/integration/test_load.py imports its load
generator (run_load).  It reuses server_load.py's synthetic steps, frames,
/proc readers and, for the probe sessions, its Stream.

What it does, and why each part is built the way it is:

* The server runs in its own process (``python -m twinstep serve``), so its CPU
  and memory (``/proc/<pid>``) are its own.  Nothing of it is configured: the
  defaults (window_steps 256, max_workers 256, max_sessions 64, no journal) are
  what is measured; ``--server-arg`` passes flags through.
* One session, a baseline and a candidate of ``--ranks`` ranks each: 2 x ranks
  streams, each on its own gRPC channel (its own TCP connection, as separate
  rank processes have), from ``--clients`` load processes, each holding both
  runs of the ranks it owns.  Steps are pre-serialized StepRecords of
  ``--records`` records (server_load.py's transformer-like layout: 600 records
  are 12 layers, 108 modules and 192 parameters, with forward, loss, backward,
  grad and param records); only the step number is appended per send.
* Each stream's request iterator is pulled by gRPC, as the twinstep client's
  is: a step is "handed to gRPC" when gRPC takes it from the iterator, which is
  when the transport has room for it, and only once the server's Credit allows
  that step.  Ranks stay within ``--slack`` steps of each other, as a
  distributed training's collectives keep them (``--slack -1``: free-running).
* Two phases, each ``--warmup`` s then ``--seconds`` s measured, in one session:
  ``saturation``, every stream as fast as Credit allows (the records/s the
  server holds at most); then ``paced``, every rank on one schedule of
  ``--rate`` steps/s per stream (default: ``--fraction`` of what saturation
  held), as a training below the server's capacity would send.  Between them
  every stream holds until what is in flight is acknowledged.
* Records/s: ``steps_compared`` (steps compared on every rank) from GetReport
  at the window's start and end, x ranks x records per step.  Steps in flight
  (handed, not yet acknowledged, over every stream) are shown at both ends: a
  backlog that grows is a rate not held.  A paced phase is "held" when it
  compared at least 95% of the offered rate and its backlog did not grow.
* Acknowledgement latency: per step handed during a window, from the moment
  gRPC took it from the iterator to the Credit whose ``acked_step`` covers it.
* Alert latency under load, two ways.  In the loaded session: in the middle of
  the last phase's window, the candidate's rank ``ranks // 2`` sends one step
  whose mid-model forward record is 20% off; from that step being handed to
  gRPC to a Watch stream receiving the Divergence event (one sample: a run
  diverges once, and the server declares it only once every rank of both runs
  has reached that step).  And ``--probes`` small sessions per phase beside the
  load (one rank per run, 2 good steps then a divergent one, as server_load.py
  times it unloaded): from the divergent step's send to the Divergence event on
  their Watch stream.  The p99 of n < 100 samples is their maximum.
* Server memory: VmRSS sampled every 0.25 s, and VmHWM (the kernel's peak)
  read before the server stops.
* Lost records: after the last window every stream is told one last step (the
  same for all), sends up to it, says Close and waits for its stream to end.
  Then RunStatus.records_received from GetReport (each record counted once) is
  set against the records the clients put on the wire, per run: lost must be
  0, and with every stream ending at the same step every step is compared.
* Clients are separate processes (spawned: no gRPC state is forked), and
  timestamps are time.perf_counter(), CLOCK_MONOTONIC on Linux, comparable
  across the processes of one machine.

The sharded comparator (``--shards LIST``): the whole measurement runs once per
entry, each with a server of its own, and one table compares them (0: the
embedded single-process server; N: ``twinstep serve --shards N``, a front and N
shard processes as Ray actors of a local Ray instance the server starts).
Every stream, the probe sessions' included, says its hello to the one address;
a front answers with ``Welcome.stream_to`` and ends the stream, and the stream
opens again on that address with the same hello (server_load.Stream and
_LoadStream do this; a stream sends nothing past its hello until the server
answered, which costs the single server one round trip per stream at start).
Reports, Watch and GetReport go to the front, merged over the shards.  Server
CPU is the front's and every shard's (/proc), shards found by the front's log
line ``twinstep shard I: pid P at HOST:PORT``; Ray's own processes (raylet,
gcs_server, its agents and idle workers: what descends from the front and from
the shards' raylet) are counted apart, CPU and memory, and so are the load
generators' CPU.  Memory is per process: peak VmHWM and sampled VmRSS.

tests/integration/test_load.py runs the same load for a bounded time and
asserts what must hold (nothing about timing).  The machine may be small and
shared: the figures are as measured, with their command.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grpc
import numpy as np

from server_load import MAX_REDIRECTS, Answer, redirected_requests
from server_load import Stream as _ProbeStream
from server_load import _frame, _hello, _layout, _proc_cpu, _proc_status, _step_message

from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc

HOST = "127.0.0.1"
SESSION = "load"
BASE, CAND = "base", "cand"
SATURATION, PACED = "saturation", "paced"
_POLL = 0.05
_GATE_POLL = 0.002
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", 256 << 20)]
_START_TIMEOUT = 300.0
"""Seconds a server may take to listen (a sharded one starts Ray and its shards first)."""


@dataclass
class LoadConfig:
    ranks: int = 32
    records: int = 600
    seconds: float = 20.0
    """Length of each phase's measured window."""
    warmup: float = 3.0
    """Load before each window opens (connections made, plans built, pipelines full)."""
    clients: int = 2
    """Load-generating processes; ranks are dealt among them, both runs of a rank in one process."""
    slack: int = 2
    """Ranks stay within this many steps of each other (<0: free-running streams)."""
    phases: tuple[str, ...] = (SATURATION, PACED)
    """saturation: as fast as Credit allows; paced: ``rate`` steps/s per stream."""
    rate: float = 0.0
    """Paced phase: steps/s per stream (0: ``fraction`` of what the saturation phase held)."""
    fraction: float = 0.5
    probes: int = 15
    """Divergence-latency probe sessions run beside the load, per phase."""
    inject: bool = True
    """Inject a divergent candidate step into the loaded session at the middle of the last phase's window."""
    server_args: tuple[str, ...] = ()
    shards: int = 0
    """0: the embedded single-process server; N: ``twinstep serve --shards N`` (a front and N shard processes)."""
    shard_args: tuple[str, ...] = ()
    """Passed to twinstep serve only when ``shards`` > 0 (Ray's CPUs, for instance)."""
    log: str = ""
    """The server's log file (default: a temporary file)."""

    @property
    def streams(self) -> int:
        return 2 * self.ranks


@dataclass
class StreamOutcome:
    index: int
    run: str
    rank: int
    welcomed: bool
    welcome_last_step: int
    records_sent: int
    last_step: int
    acked: int
    code: str
    details: str
    commands: int
    stream_to: str = ""
    """Where a sharded server's front sent the stream ("": it streamed where it was opened)."""


@dataclass
class PhaseResult:
    name: str
    rate: float
    """Offered steps/s per stream (0: as fast as Credit allows)."""
    start: float = 0.0
    """perf_counter() when the phase began (its warm-up included)."""
    window: tuple[float, float] = (0.0, 0.0)
    """perf_counter() at the measured window's start and end."""
    compared_steps: int = 0
    """Steps compared on every rank within the window."""
    records_compared_per_s: float = 0.0
    records_received_per_s: float = 0.0
    cores_busy: float = 0.0
    """CPU of the server's processes (the one server, or the front and every shard) over the window."""
    front_cores_busy: float = 0.0
    """Of ``cores_busy``, the front's (sharded only)."""
    ray_cores_busy: float = 0.0
    """CPU of Ray's own processes (raylet, gcs_server, workers, agents) over the window."""
    load_cores_busy: float = 0.0
    """CPU of the load-generating processes over the window."""
    in_flight: tuple[int, int] = (0, 0)
    """Steps handed to gRPC but not acknowledged, over every stream, at the window's start and end."""
    drain_s: float = 0.0
    """Before a paced phase: seconds for the backlog of the phase before to be acknowledged."""
    ack_ms: list[float] = field(default_factory=list)
    probe_alert_ms: list[float] = field(default_factory=list)
    probes_missing: int = 0
    report_ms: list[float] = field(default_factory=list)
    """GetReport round trips of the loaded session during the window."""
    peak_rss_mb: float = 0.0
    """Largest sampled VmRSS of the server during the phase (sharded: of the front and shards together)."""

    @property
    def seconds(self) -> float:
        return self.window[1] - self.window[0]

    @property
    def steps_per_s(self) -> float:
        """Steps compared per second on every rank (= per stream)."""
        return self.compared_steps / self.seconds if self.seconds > 0 else 0.0


@dataclass
class LoadResult:
    config: LoadConfig
    step_bytes: int
    phases: list[PhaseResult] = field(default_factory=list)
    alert_ms: float | None = None
    """In the loaded session: divergent step handed -> Watch receives Divergence."""
    injected: tuple[int, int, str] | None = None
    """(step, rank, phase name) of the injected divergent step."""
    divergence: tuple[int, int, str, str] | None = None
    """(step, rank, phase, module) of the first divergence the server declared in the loaded session."""
    rss_mb: dict[str, float] = field(default_factory=dict)
    outcomes: list[StreamOutcome] = field(default_factory=list)
    sent: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)
    resent: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, dict[str, int]] = field(default_factory=dict)
    run_ranks: dict[str, int] = field(default_factory=dict)
    run_states: dict[str, str] = field(default_factory=dict)
    final_step: int = -1
    """The last step every stream was told to send."""
    final_steps_compared: int = 0
    status: str = ""
    server_alive: bool = False
    """The server answered GetReport after every stream had closed."""
    server_log_tail: str = ""
    processes: dict[str, dict] = field(default_factory=dict)
    """Per server process and Ray's (_ServerProcesses.memory): pids, MB of peak VmHWM, sampled peak, last."""
    shard_addresses: dict[int, str] = field(default_factory=dict)
    shard_restarts: int = 0
    left_over: list[str] = field(default_factory=list)
    """Processes of the server still running once it stopped (ended by the benchmark, by pid)."""
    start_s: float = 0.0
    """Seconds from starting the server to its listening (Ray and the shards started, when sharded)."""

    @property
    def lost(self) -> dict[str, int]:
        return {run: self.sent.get(run, 0) - self.received.get(run, 0) for run in (BASE, CAND)}

    @property
    def rejected(self) -> list[StreamOutcome]:
        return [o for o in self.outcomes if not o.welcomed or o.code != "OK" or o.commands]

    def phase(self, name: str) -> PhaseResult | None:
        return next((p for p in self.phases if p.name == name), None)


# -- the load generator: one process's streams -----------------------------------------------------


class _Gate:
    """Keeps this process's streams within ``slack`` steps of the slowest stream of every process."""

    def __init__(self, handed, slack: int) -> None:
        self.handed, self.slack = handed, slack
        self.cond = threading.Condition()
        self.low = -1
        self.done = threading.Event()
        if slack >= 0:
            threading.Thread(target=self._watch, name="load-gate", daemon=True).start()

    def _watch(self) -> None:
        while not self.done.is_set():
            low = min(self.handed)
            if low != self.low:
                with self.cond:
                    self.low = low
                    self.cond.notify_all()
            time.sleep(_GATE_POLL)

    def wait(self, step: int, stop: Callable[[], bool]) -> bool:
        if self.slack < 0:
            return True
        with self.cond:
            while step > self.low + 1 + self.slack:
                if stop():
                    return False
                self.cond.wait(_POLL)
        return True


class _LoadStream:
    """One rank of one run: pre-serialized steps pulled by gRPC as Credit allows; acknowledgements timed."""

    def __init__(self, index: int, address: str, run: str, rank: int, cfg: LoadConfig, manifest: bytes, body: bytes,
                 bad_body: bytes | None, shared: dict, gate: _Gate, started: threading.Event, hard_stop: float) -> None:
        self.index, self.run, self.rank, self.cfg = index, run, rank, cfg
        self._hello = _hello(SESSION, run, run == BASE, rank, cfg.ranks)
        self._manifest, self._body, self._bad_body = manifest, body, bad_body
        self._shared, self._gate, self._started, self._hard_stop = shared, gate, started, hard_stop
        self._cond = threading.Condition()
        self.max_step = -1
        self.acked = -1
        self.welcomed = threading.Event()
        self.welcome_last_step = -2
        self.handed: dict[int, float] = {}
        self.samples: list[tuple[float, float]] = []  # (handed at, seconds to its acknowledgement)
        self.records_sent = 0
        self.last_step = -1
        self.commands = 0
        self.code, self.details = "", ""
        self.ended = threading.Event()
        self.stream_to = ""
        """The address a sharded server's front sent this stream to ("": the one it was opened on)."""
        self._rest = self._requests()  # consumed by the one call that is not redirected
        self.channel, self.call, self._answer = self._open(address)
        self._reader = threading.Thread(target=self._read, name=f"load-read-{index}", daemon=True)
        self._reader.start()

    def _open(self, address: str):
        """A channel and a call on ``address``: the hello, then (unless redirected) everything else."""
        channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        method = channel.stream_stream("/twinstep.v1.Twinstep/Stream", request_serializer=lambda b: b,
                                       response_deserializer=pb.ServerMessage.FromString)
        answer = Answer()
        return channel, method(redirected_requests(self._hello, answer, self._rest)), answer

    # -- requests, pulled by gRPC's own thread ----------------------------------------------------

    def _gone(self) -> bool:
        return self.ended.is_set() or time.perf_counter() > self._hard_stop

    def _stop_step(self) -> int:
        return self._shared["stop_step"].value

    def _past_stop(self, step: int) -> bool:
        stop = self._stop_step()
        return stop >= 0 and step > stop

    def _wait_turn(self, step: int) -> bool:
        """Wait until ``step`` may go: the load started and is not held, its time (paced), the slowest rank, Credit."""
        while not self._started.wait(_POLL):
            if self._gone():
                return False
        while self._shared["hold"].value:  # between phases: the backlog drains
            if self._gone() or self._past_stop(step):
                return False
            time.sleep(0.01)
        rate = self._shared["rate"].value
        if rate > 0:  # one schedule for every rank, as a training's collectives keep them in phase
            due = self._shared["epoch"].value + (step - self._shared["epoch_step"].value) / rate
            while (wait := due - time.perf_counter()) > 0:
                if self._gone() or self._past_stop(step):
                    return False
                time.sleep(min(wait, _POLL))
        if not self._gate.wait(step, lambda: self._gone() or self._past_stop(step)):
            return False
        with self._cond:
            while self.max_step < step:
                if self._gone() or self._past_stop(step):
                    return False
                self._cond.wait(_POLL)
        return True

    def _requests(self):
        """Everything after the hello (sent by redirected_requests, once per call)."""
        yield self._manifest
        step = 0
        while not self._past_stop(step) and self._wait_turn(step) and not self._past_stop(step):
            body = self._body
            bad = (self._bad_body is not None and self._shared["injected_step"].value < 0
                   and time.perf_counter() >= self._shared["inject_at"].value)
            if bad:
                body = self._bad_body
            frame = _frame(body, step)
            now = time.perf_counter()
            with self._cond:
                self.handed[step] = now
            if bad:
                self._shared["injected_at"].value = now
                self._shared["injected_step"].value = step
            self._shared["handed"][self.index] = step
            self.records_sent += self.cfg.records
            self.last_step = step
            yield frame
            step += 1
        yield pb.ClientMessage(close=pb.Close(reason="finished", last_step=self.last_step)).SerializeToString()

    # -- responses -----------------------------------------------------------------------------------

    def _read(self) -> None:
        try:
            for _ in range(MAX_REDIRECTS + 1):
                try:
                    self._read_call()
                except grpc.RpcError:
                    if not self._answer.stream_to:  # a front may end a redirected stream as it likes
                        raise
                finally:
                    self._answer.event.set()
                if not self._answer.stream_to:
                    break
                self.stream_to = self._answer.stream_to
                self.channel.close()
                self.channel, self.call, self._answer = self._open(self.stream_to)
            self.code = "OK"
        except grpc.RpcError as error:
            self.code, self.details = error.code().name, error.details() or ""
        finally:
            self.ended.set()
            with self._cond:
                self._cond.notify_all()

    def _read_call(self) -> None:
        for message in self.call:
            kind = message.WhichOneof("body")
            if kind == "welcome" and message.welcome.stream_to:
                self._answer.stream_to = message.welcome.stream_to  # the front ends this call
                self._answer.event.set()
                continue
            self._answer.event.set()
            if kind == "credit":
                now = time.perf_counter()
                with self._cond:
                    acked = message.credit.acked_step
                    for step in range(self.acked + 1, acked + 1):
                        at = self.handed.pop(step, None)
                        if at is not None:
                            self.samples.append((at, now - at))
                    self.acked = max(self.acked, acked)
                    self.max_step = message.credit.max_step
                    self._cond.notify_all()
                self._shared["acked"][self.index] = self.acked
            elif kind == "welcome":
                self.welcome_last_step = message.welcome.last_step_received
                self.welcomed.set()
            elif kind == "command":  # no halt is asked for: anything here is a finding
                self.commands += 1

    def outcome(self) -> StreamOutcome:
        return StreamOutcome(self.index, self.run, self.rank, self.welcomed.is_set(), self.welcome_last_step,
                             self.records_sent, self.last_step, self.acked, self.code or "NOT_ENDED", self.details,
                             self.commands, self.stream_to)


def _bodies(cfg: LoadConfig, rank: int, run: str) -> tuple[bytes, bytes | None]:
    """(the step body of this rank and run, and its divergent twin for the injected stream or None)."""
    _, layout = _layout(cfg.records, False)
    noise = 1e-9 if run == CAND else 0.0
    body = _step_message(layout, rank, noise=noise, seed=rank).SerializeToString()
    bad = None
    if cfg.inject and run == CAND and rank == cfg.ranks // 2:
        bad = _step_message(layout, rank, noise=noise, seed=rank, diverge=_diverge_index(layout)).SerializeToString()
    return body, bad


def _diverge_index(layout) -> int:
    forwards = [i for i, r in enumerate(layout) if r.phase == pb.FORWARD]
    return forwards[len(forwards) // 2]  # mid-model: the first divergence, not the loss


def _client_main(address: str, cfg: LoadConfig, ranks: list[int], offset_of: dict, shared: dict, barrier,
                 go, results) -> None:
    """One load process: every stream of ``ranks`` (both runs), from connect to a reported outcome."""
    manifest, _ = _layout(cfg.records, False)
    manifest_bytes = pb.ClientMessage(manifest=manifest).SerializeToString()
    gate = _Gate(shared["handed"], cfg.slack)
    started = threading.Event()
    # Only if the coordinator is gone: every phase, and time to drain.
    hard_stop = time.perf_counter() + len(cfg.phases) * (cfg.warmup + cfg.seconds) + 300
    streams: list[_LoadStream] = []
    error = ""
    try:
        for rank in ranks:
            for run in (BASE, CAND):
                body, bad = _bodies(cfg, rank, run)
                streams.append(_LoadStream(offset_of[(run, rank)], address, run, rank, cfg, manifest_bytes, body,
                                           bad, shared, gate, started, hard_stop))
        for s in streams:  # joined (or refused) before the load starts
            while not s.welcomed.wait(0.1) and not s.ended.is_set() and time.perf_counter() < hard_stop:
                pass
    except Exception as exc:  # reported, never a hang of the coordinator
        error = f"{type(exc).__name__}: {exc}"
    try:
        barrier.wait(120)
        go.wait(120)
    except Exception as exc:
        error = error or f"start: {type(exc).__name__}: {exc}"
    started.set()
    for s in streams:
        s.ended.wait(max(0.0, hard_stop - time.perf_counter()))
    gate.done.set()
    results.put({
        "error": error,
        "outcomes": [s.outcome() for s in streams],
        "samples": [sample for s in streams for sample in s.samples],
    })
    for s in streams:
        s.channel.close()


# -- observers in the coordinator --------------------------------------------------------------------


class _Watcher:
    """A Watch stream on one session: subscribed once its first event arrives; the first Divergence timed."""

    def __init__(self, stub: pb_grpc.TwinstepStub, session: str) -> None:
        self.subscribed = threading.Event()
        self.diverged = threading.Event()
        self.divergence_at: float | None = None
        self.divergence: pb.Divergence | None = None
        self.call = stub.Watch(pb.WatchRequest(session=session))
        threading.Thread(target=self._read, name=f"watch-{session}", daemon=True).start()

    def _read(self) -> None:
        try:
            for event in self.call:
                now = time.perf_counter()
                self.subscribed.set()
                if event.WhichOneof("body") == "divergence" and self.divergence_at is None:
                    self.divergence_at, self.divergence = now, event.divergence
                    self.diverged.set()
        except grpc.RpcError:
            pass
        finally:
            self.subscribed.set()

    def stop(self) -> None:
        self.call.cancel()


def _probe(channel: grpc.Channel, stub: pb_grpc.TwinstepStub, name: str, manifest: pb.Manifest,
           bodies: tuple[bytes, bytes, bytes], step_k: int = 2) -> float | None:
    """A small session beside the load: step ``step_k`` of its candidate diverges; seconds to the Watch event."""
    base_body, cand_body, bad_body = bodies
    watcher = _Watcher(stub, name)
    watcher.subscribed.wait(10)
    base = _ProbeStream(channel, _hello(name, BASE, True, 0, 1), manifest)
    cand = _ProbeStream(channel, _hello(name, CAND, False, 0, 1), manifest)
    deadline = time.perf_counter() + 30
    try:
        for s in range(step_k + 1):
            base.wait_credit(s, deadline)
            base.send(_frame(base_body, s), s)
        base.wait_acked(step_k, 30)
        for s in range(step_k):
            cand.wait_credit(s, deadline)
            cand.send(_frame(cand_body, s), s)
        cand.wait_acked(step_k - 1, 30)
        cand.wait_credit(step_k, deadline)
        t0 = time.perf_counter()
        cand.send(_frame(bad_body, step_k), step_k)
        if not watcher.diverged.wait(30):
            return None
        return watcher.divergence_at - t0
    finally:
        base.close()
        cand.close()
        base.ended.wait(10)
        cand.ended.wait(10)
        watcher.stop()


_SHARD_LINE = re.compile(r"twinstep shard (\d+): pid (\d+) at (\S+)")
FRONT, SHARD, RAY, LOAD = "front", "shard", "ray", "load"
"""Process groups: the one server (or a sharded server's front), its shards, what Ray runs beside them
(raylet, gcs_server, idle workers, agents), and the load generators."""


def _stat(pid: int) -> tuple[int, str, int]:
    """(parent pid, command name, start time in clock ticks since boot) from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    name = text[text.index("(") + 1:text.rindex(")")]
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), name, int(fields[19])


class _ServerProcesses:
    """Every process of the server, found while it runs, with its memory sampled every 0.25 s.

    The front (or the one server) is the process started; each shard is named by the front's log line
    ``twinstep shard I: pid P at HOST:PORT`` (the latest one per shard: a restarted shard prints it again).
    Ray's own processes are what descends from the front and from each shard's parent (the raylet) and is
    no shard: raylet, gcs_server, workers and agents; found by process tree, not by name, so another
    Ray instance on the machine is not counted.  Labels: "front" (or "server"), "shard I", "raylet",
    "gcs_server", "ray: NAME" (command name), "load I"."""

    def __init__(self, proc: subprocess.Popen, log: str, sharded: bool) -> None:
        self.front = proc.pid
        self.label: dict[int, str] = {proc.pid: "front" if sharded else "server"}
        self.group: dict[int, str] = {proc.pid: FRONT}
        self.shards: dict[int, tuple[int, str]] = {}
        """Shard index -> (pid, address) as the log last named it."""
        self.restarts = 0
        """Shard lines naming a new pid for a shard already seen."""
        self.hwm: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.started: dict[int, int] = {}
        """Start time of each process found (clock ticks since boot): a pid reused later is not it."""
        self.samples: list[tuple[float, dict[int, int]]] = []  # (perf_counter, pid -> VmRSS kB)
        self._log, self._log_at, self._stdout = log, 0, getattr(proc, "lines", [])
        self._stdout_at = 0
        self._lock = threading.Lock()
        self.done = threading.Event()
        self._scan()
        threading.Thread(target=self._run, name="server-processes", daemon=True).start()

    def add(self, pid: int, label: str, group: str) -> None:
        with self._lock:
            self.label[pid], self.group[pid] = label, group

    # -- finding them --------------------------------------------------------------------------------

    def _lines(self) -> list[str]:
        lines = []
        try:
            with open(self._log, errors="replace") as f:
                f.seek(self._log_at)
                text = f.read()
            cut = text.rfind("\n") + 1  # whole lines only
            self._log_at += len(text[:cut].encode(errors="replace"))
            lines += text[:cut].splitlines()
        except OSError:
            pass
        new = self._stdout[self._stdout_at:]
        self._stdout_at += len(new)
        return lines + new

    def _scan(self) -> None:
        for line in self._lines():
            found = _SHARD_LINE.search(line)
            if found:
                index, pid, address = int(found.group(1)), int(found.group(2)), found.group(3)
                try:
                    started = _stat(pid)[2]
                except (OSError, ValueError, IndexError):
                    started = -1
                with self._lock:
                    if index in self.shards and self.shards[index][0] != pid:
                        self.restarts += 1
                    self.shards[index] = (pid, address)
                    self.label[pid], self.group[pid] = f"shard {index}", SHARD
                    self.started[pid] = started
        if not self.shards and len(self.label) == 1:
            return
        try:
            tree: dict[int, list[int]] = {}
            names: dict[int, tuple[str, int]] = {}
            for entry in os.listdir("/proc"):
                if entry.isdigit():
                    try:
                        parent, name, started = _stat(int(entry))
                    except (OSError, ValueError, IndexError):
                        continue
                    tree.setdefault(parent, []).append(int(entry))
                    names[int(entry)] = (name, started)
        except OSError:
            return
        with self._lock:
            roots = {self.front}
            for pid, _ in self.shards.values():
                try:
                    parent = _stat(pid)[0]
                    if _stat(parent)[1] == "raylet":  # the raylet that started the shard's worker
                        roots.add(parent)
                except (OSError, ValueError, IndexError):
                    pass
            seen, todo = set(), list(roots)
            while todo:
                pid = todo.pop()
                if pid in seen:
                    continue
                seen.add(pid)
                todo += tree.get(pid, [])
            for pid in seen - set(self.label) - {os.getpid()}:
                name, started = names.get(pid, ("?", -1))
                self.label[pid] = name if name in ("raylet", "gcs_server") else f"ray: {name}"
                self.group[pid] = RAY
                self.started[pid] = started

    def _run(self) -> None:
        n = 0
        while not self.done.is_set():
            if n % 8 == 0:  # the tree every 2 s; memory every 0.25 s
                self._scan()
            self.sample()
            n += 1
            self.done.wait(0.25)

    def sample(self) -> None:
        with self._lock:
            pids = list(self.label)
        rss = {}
        for pid in pids:
            try:
                status = _proc_status(pid)
            except (OSError, KeyError):
                continue
            rss[pid] = status.get("VmRSS", 0)
            self.last[pid] = rss[pid]
            self.hwm[pid] = max(self.hwm.get(pid, 0), status.get("VmHWM", 0))
        self.samples.append((time.perf_counter(), rss))

    # -- reading them ---------------------------------------------------------------------------------

    def cpu(self) -> dict[int, float]:
        """CPU seconds (user + system, every thread) of each process found, now."""
        with self._lock:
            pids = list(self.label)
        out = {}
        for pid in pids:
            try:
                out[pid] = _proc_cpu(pid)
            except (OSError, ValueError, IndexError):
                pass
        return out

    def cores(self, a: dict[int, float], b: dict[int, float], seconds: float, group: str) -> float:
        """Cores busy in ``group`` between two cpu() readings (a process that appeared counts from 0)."""
        with self._lock:
            pids = [pid for pid, g in self.group.items() if g == group]
        return sum(b[pid] - a.get(pid, 0.0) for pid in pids if pid in b) / seconds if seconds > 0 else 0.0

    def server_pids(self) -> list[int]:
        with self._lock:
            return [pid for pid, g in self.group.items() if g in (FRONT, SHARD)]

    def peak_mb(self, since: float = 0.0, until: float = float("inf"), groups=(FRONT, SHARD)) -> float:
        """Largest sampled sum of VmRSS over the processes of ``groups`` (the server's, by default)."""
        with self._lock:
            pids = {pid for pid, g in self.group.items() if g in groups}
        return max((sum(kb for pid, kb in rss.items() if pid in pids)
                    for t, rss in list(self.samples) if since <= t <= until), default=0) / 1024

    def memory(self) -> dict[str, dict]:
        """Per server and Ray process (Ray's processes of one command name summed): pids, peak VmHWM, largest
        sampled VmRSS, last VmRSS, in MB.  Sums of resident sizes count shared pages (libraries) once per
        process: an upper bound of what they take together."""
        with self._lock:
            labels, groups = dict(self.label), dict(self.group)
        out: dict[str, dict] = {}
        for pid, label in labels.items():
            if groups[pid] == LOAD:
                continue
            peak = max((rss.get(pid, 0) for _, rss in self.samples), default=0)
            row = {"pids": [pid], "hwm": self.hwm.get(pid, 0) / 1024, "peak": peak / 1024,
                   "end": self.last.get(pid, 0) / 1024, "group": groups[pid]}
            if label in out:  # summed: processes of one kind (or a shard that restarted)
                for key in ("hwm", "peak", "end"):
                    out[label][key] += row[key]
                out[label]["pids"].append(pid)
            else:
                out[label] = row
        return out

    def stop_left_over(self) -> list[str]:
        """After the server stopped: end (by pid) what it started and left running; say what that was."""
        left = []
        with self._lock:
            pids = [(pid, self.label[pid]) for pid, g in self.group.items() if g in (SHARD, RAY)]
        for pid, label in pids:
            try:
                _, _, started = _stat(pid)
            except (OSError, ValueError, IndexError):
                continue  # gone
            if started == self.started.get(pid):
                left.append(f"{label} (pid {pid})")
                try:
                    os.kill(pid, 15)
                except OSError:
                    pass
        return left


# -- the server --------------------------------------------------------------------------------------


def start_server(args: tuple[str, ...], log: str) -> tuple[subprocess.Popen, str]:
    """``twinstep serve`` in its own process on a port it binds itself; returns (process, address).

    Without a --config of the caller's, auto_ops is off: after the injected divergence it would ask every
    stream for a module's operations, which these synthetic streams (no model) cannot capture; the load
    measured is the comparison's."""
    if not any(a.startswith("--config") for a in args):
        config = os.path.join(os.path.dirname(log) or ".", "load_streams.server.yaml")
        with open(config, "w") as f:
            f.write("auto_ops: false\n")
        args = (*args, f"--config={config}")
    with open(log, "w") as err:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", "twinstep", "serve", "--host", HOST, "--port", "0", *args],
                                stdout=subprocess.PIPE, stderr=err, text=True)
    proc.lines = []  # its stdout, kept for the shard lines (_ServerProcesses)
    timer = threading.Timer(_START_TIMEOUT, proc.kill)  # a server that never listens is not waited for forever
    timer.start()
    try:
        for line in proc.stdout:
            proc.lines.append(line)
            found = re.search(r"listening on (\S+)", line)
            if found:
                threading.Thread(target=lambda: proc.lines.extend(proc.stdout), daemon=True).start()
                return proc, found.group(1)
    finally:
        timer.cancel()
    proc.wait(10)
    raise RuntimeError(f"twinstep serve exited with {proc.returncode} before listening; see {log}")


def stop_server(proc: subprocess.Popen, grace: float = 10.0) -> None:
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _report(stub: pb_grpc.TwinstepStub, timings: list[float] | None = None) -> pb.Report | None:
    t = time.perf_counter()
    try:
        report = stub.GetReport(pb.ReportRequest(session=SESSION), timeout=30)
    except grpc.RpcError:
        return None
    if timings is not None:
        timings.append(1e3 * (time.perf_counter() - t))
    return report


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


# -- the coordinator -----------------------------------------------------------------------------------


def run_load(cfg: LoadConfig) -> LoadResult:
    """Start a server, run each phase's load, stop every stream at one step, account for every record."""
    if cfg.ranks < 1 or cfg.records < 1 or cfg.seconds <= 0 or cfg.clients < 1 or cfg.warmup < 0:
        raise ValueError("ranks, records, seconds and clients must be positive")
    if cfg.slack == 0:
        raise ValueError("slack must be at least 1 (or negative: no lockstep)")
    if not cfg.phases or set(cfg.phases) - {SATURATION, PACED}:
        raise ValueError(f"phases are {SATURATION!r} and {PACED!r}")
    if cfg.phases[0] == PACED and cfg.rate <= 0:
        raise ValueError("a paced phase without a saturation phase before it needs a rate")
    if cfg.probes * len(cfg.phases) > 60:
        raise ValueError("at most 60 probes: each is a session, and a server holds 64 by default (max_sessions)")
    log = cfg.log or os.path.join(tempfile.gettempdir(), f"twinstep_load_streams_{os.getpid()}.log")
    manifest, layout = _layout(cfg.records, False)
    step_bytes = len(_frame(_step_message(layout, 0).SerializeToString(), 1000))
    result = LoadResult(config=cfg, step_bytes=step_bytes)

    ctx = mp.get_context("spawn")  # no gRPC state of this process is forked into the load
    streams = [(run, rank) for rank in range(cfg.ranks) for run in (BASE, CAND)]
    offset_of = {spec: i for i, spec in enumerate(streams)}
    shared = {
        "handed": ctx.Array("q", [-1] * len(streams), lock=False),
        "acked": ctx.Array("q", [-1] * len(streams), lock=False),
        "stop_step": ctx.Value("q", -1, lock=False),
        "hold": ctx.Value("q", 0, lock=False),
        "rate": ctx.Value("d", 0.0, lock=False),
        "epoch": ctx.Value("d", 0.0, lock=False),
        "epoch_step": ctx.Value("q", 0, lock=False),
        "inject_at": ctx.Value("d", float("inf"), lock=False),
        "injected_at": ctx.Value("d", 0.0, lock=False),
        "injected_step": ctx.Value("q", -1, lock=False),
    }
    clients = min(cfg.clients, cfg.ranks)
    deal = [list(range(cfg.ranks))[i::clients] for i in range(clients)]
    barrier = ctx.Barrier(clients + 1)
    go = ctx.Event()
    results = ctx.Queue()
    probe_bodies = (_step_message(layout, 0).SerializeToString(),
                    _step_message(layout, 0, noise=1e-9).SerializeToString(),
                    _step_message(layout, 0, noise=1e-9, diverge=_diverge_index(layout)).SerializeToString())

    args = cfg.server_args
    if cfg.shards > 0:
        args = ("--shards", str(cfg.shards), *cfg.shard_args, *args)
    t_start = time.perf_counter()
    proc, address = start_server(args, log)
    result.start_s = time.perf_counter() - t_start
    rss = _ServerProcesses(proc, log, cfg.shards > 0)
    if cfg.shards > 0:  # every shard named by the front's log before the load starts
        deadline = time.perf_counter() + 60
        while len(rss.shards) < cfg.shards and time.perf_counter() < deadline:
            time.sleep(0.1)
            rss._scan()
        if len(rss.shards) < cfg.shards:
            print(f"(the server's log named {len(rss.shards)} of {cfg.shards} shards: their CPU and memory are "
                  "missing from the figures)", flush=True)

    def server_rss_mb() -> float:
        return sum(_proc_status(pid)["VmRSS"] for pid in rss.server_pids()) / 1024

    procs = []
    channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
    stub = pb_grpc.TwinstepStub(channel)
    outcomes, samples, probe_sessions = [], [], 0
    watcher = None
    try:
        result.rss_mb["start"] = server_rss_mb()
        watcher = _Watcher(stub, SESSION)
        watcher.subscribed.wait(10)
        for ranks in deal:
            p = ctx.Process(target=_client_main, args=(address, cfg, ranks, offset_of, shared, barrier, go, results),
                            daemon=True)
            p.start()
            procs.append(p)
            rss.add(p.pid, f"load {len(procs)}", LOAD)
        barrier.wait(180)  # every stream has joined (or been refused)
        result.rss_mb["joined"] = server_rss_mb()

        def in_flight() -> tuple[int, int]:
            return sum(x + 1 for x in shared["handed"]), sum(x + 1 for x in shared["acked"])

        def mark(phase: PhaseResult) -> tuple[float, dict, int, int, int]:
            report = _report(stub, phase.report_ms)
            return (time.perf_counter(), rss.cpu(), report.steps_compared if report else -1, *in_flight())

        for number, name in enumerate(cfg.phases):
            rate = 0.0
            if name == PACED:
                saturation = result.phase(SATURATION)
                rate = cfg.rate or cfg.fraction * saturation.steps_per_s
            phase = PhaseResult(name=name, rate=rate)
            result.phases.append(phase)
            if number > 0:  # hold every stream until what the phase before left in flight is acknowledged
                shared["hold"].value = 1
                t = time.perf_counter()
                while time.perf_counter() - t < 300:
                    handed, acked = in_flight()
                    if handed == acked:
                        break
                    time.sleep(0.05)
                phase.drain_s = time.perf_counter() - t
            phase.start = time.perf_counter() + 0.05
            shared["epoch"].value = phase.start
            shared["epoch_step"].value = max(shared["handed"]) + 1  # the paced schedule's first step, for all
            shared["rate"].value = rate
            shared["hold"].value = 0
            go.set()
            t0_at = phase.start + cfg.warmup
            t1_at = t0_at + cfg.seconds
            if cfg.inject and number == len(cfg.phases) - 1:
                shared["inject_at"].value = t0_at + cfg.seconds / 2
            probe_results: list[float | None] = []

            def probes(first: int = probe_sessions, t0: float = t0_at, t1: float = t1_at,
                       out: list = probe_results) -> None:
                spacing = max(cfg.seconds - 1.0, 0.5) / max(cfg.probes, 1)
                for i in range(cfg.probes):
                    due = t0 + 0.25 + i * spacing
                    while time.perf_counter() < due:
                        time.sleep(0.01)
                    if time.perf_counter() > t1:
                        break
                    out.append(_probe(channel, stub, f"probe{first + i}", manifest, probe_bodies))

            probe_sessions += cfg.probes
            prober = threading.Thread(target=probes, name="probes", daemon=True)
            prober.start()
            time.sleep(max(0.0, t0_at - time.perf_counter()))
            a = mark(phase)
            while time.perf_counter() < t1_at - 1.0:  # the server keeps answering reports under load
                time.sleep(min(2.0, max(0.0, t1_at - 1.0 - time.perf_counter())))
                if time.perf_counter() < t1_at - 1.0:
                    _report(stub, phase.report_ms)
            time.sleep(max(0.0, t1_at - time.perf_counter()))
            b = mark(phase)
            prober.join(60)
            phase.window = (a[0], b[0])
            phase.compared_steps = b[2] - a[2]
            phase.records_compared_per_s = phase.compared_steps * cfg.ranks * cfg.records / phase.seconds
            phase.records_received_per_s = (b[4] - a[4]) * cfg.records / phase.seconds
            phase.cores_busy = rss.cores(a[1], b[1], phase.seconds, FRONT) + rss.cores(a[1], b[1], phase.seconds, SHARD)
            phase.front_cores_busy = rss.cores(a[1], b[1], phase.seconds, FRONT)
            phase.ray_cores_busy = rss.cores(a[1], b[1], phase.seconds, RAY)
            phase.load_cores_busy = rss.cores(a[1], b[1], phase.seconds, LOAD)
            phase.in_flight = (a[3] - a[4], b[3] - b[4])
            phase.probe_alert_ms = sorted(1e3 * x for x in probe_results if x is not None)
            phase.probes_missing = sum(1 for x in probe_results if x is None)
            phase.peak_rss_mb = rss.peak_mb(phase.start, b[0])

        # One last step for every stream: a little past the furthest, reachable by all.
        shared["stop_step"].value = max(shared["handed"]) + 2
        result.final_step = shared["stop_step"].value
        errors = []
        for _ in procs:
            try:
                got = results.get(timeout=300)
            except queue.Empty:
                errors.append("a load process reported nothing")
                break
            outcomes += got["outcomes"]
            samples += got["samples"]
            if got["error"]:
                errors.append(got["error"])
        for p in procs:
            p.join(30)
        if errors:
            raise RuntimeError("; ".join(errors))

        # Accounting, once every stream has closed.
        report = _report(stub)
        result.server_alive = report is not None
        if report is not None:
            result.final_steps_compared = report.steps_compared
            result.status = report.status
            for run in report.runs:
                result.received[run.name] = run.records_received
                result.resent[run.name] = run.steps_resent
                result.dropped[run.name] = dict(run.dropped_by_reason)
                result.run_ranks[run.name] = run.ranks
                result.run_states[run.name] = run.state
            if report.HasField("first_divergence"):
                d = report.first_divergence
                result.divergence = (d.step, d.rank, d.phase, d.module)
        if cfg.inject:
            watcher.diverged.wait(10)
        rss.sample()  # VmHWM read before the server stops
        memory = rss.memory()
        server = [m for m in memory.values() if m["group"] in (FRONT, SHARD)]
        result.rss_mb["end"] = sum(m["end"] for m in server)
        result.rss_mb["peak (VmHWM)"] = sum(m["hwm"] for m in server)  # sharded: the sum of each one's peak
        result.rss_mb["peak sampled"] = rss.peak_mb()
    finally:
        rss.done.set()
        go.set()
        if shared["stop_step"].value < 0:  # on an error: every stream ends now
            shared["stop_step"].value = 0
        if watcher is not None:
            watcher.stop()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        channel.close()
        result.processes = rss.memory()
        result.shard_addresses = {i: a for i, (_, a) in rss.shards.items()}
        result.shard_restarts = rss.restarts
        stop_server(proc, grace=60.0 if cfg.shards > 0 else 10.0)
        if cfg.shards > 0:
            time.sleep(2.0)
            rss._scan()
        result.left_over = rss.stop_left_over()
        result.server_log_tail = _tail(log)

    result.outcomes = sorted(outcomes, key=lambda o: o.index)
    for o in result.outcomes:
        result.sent[o.run] = result.sent.get(o.run, 0) + o.records_sent
    for phase in result.phases:
        phase.ack_ms = sorted(1e3 * lat for at, lat in samples if phase.window[0] <= at <= phase.window[1])
    if cfg.inject and shared["injected_step"].value >= 0:
        result.injected = (shared["injected_step"].value, cfg.ranks // 2, cfg.phases[-1])
        if watcher.divergence_at is not None:
            result.alert_ms = 1e3 * (watcher.divergence_at - shared["injected_at"].value)
    return result


# -- output ----------------------------------------------------------------------------------------------


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def _three(xs: list[float]) -> str:
    return f"{_pct(xs, 50):.1f} / {_pct(xs, 99):.1f} / {max(xs, default=float('nan')):.1f}"


def describe(result: LoadResult) -> str:
    cfg = result.config
    lock = f"ranks within {cfg.slack} steps of each other" if cfg.slack > 0 else "streams free-running"
    lines = [(f"\n== load: 1 session, 2 runs x {cfg.ranks} ranks = {cfg.streams} streams (one gRPC channel each) "
              f"from {min(cfg.clients, cfg.ranks)} client processes; {cfg.records} records/step "
              f"({result.step_bytes / 1e3:.1f} kB on the wire), {lock}; each phase {cfg.warmup:g} s warm-up, "
              f"then {cfg.seconds:g} s measured")]
    for phase in result.phases:
        if phase.rate > 0:
            offered = phase.rate * cfg.ranks * cfg.records
            held = phase.steps_per_s >= 0.95 * phase.rate and phase.in_flight[1] <= phase.in_flight[0] + 2 * cfg.streams
            title = (f"paced at {phase.rate:.2f} steps/s per stream ({offered:,.0f} records/s offered): "
                     f"{'held' if held else 'NOT HELD'}")
            if phase.drain_s:
                title += f"; it began once the backlog before it drained ({phase.drain_s:.1f} s)"
        else:
            title = "saturation: every stream as fast as Credit allows"
        lines.append(f"-- {title}")
        ack, probe = phase.ack_ms, phase.probe_alert_ms
        rows = [
            ("records compared / s", f"{phase.records_compared_per_s:,.0f}"),
            ("records received / s (both runs)", f"{phase.records_received_per_s:,.0f}"),
            ("steps compared / s per rank", f"{phase.steps_per_s:,.2f}"),
            ("MB/s received by the server",
             f"{phase.records_received_per_s / cfg.records * result.step_bytes / 1e6:.2f}"),
            ("server CPU (cores busy)" + (", front and shards" if cfg.shards else ""), f"{phase.cores_busy:.2f}"),
            *([("  of which the front", f"{phase.front_cores_busy:.2f}"),
               ("Ray's own processes CPU (cores busy)", f"{phase.ray_cores_busy:.2f}")] if cfg.shards else []),
            ("load generators CPU (cores busy)", f"{phase.load_cores_busy:.2f}"),
            ("records compared / s per server core",
             f"{phase.records_compared_per_s / max(phase.cores_busy, 1e-9):,.0f}"),
            ("steps in flight (handed, not acked), window start / end",
             f"{phase.in_flight[0]} / {phase.in_flight[1]}"),
            (f"ack latency p50 / p99 / max ms (n={len(ack)})", _three(ack)),
            (f"alert latency, probe sessions p50 / p99 / max ms (n={len(probe)}"
             + (f", {phase.probes_missing} without an event" if phase.probes_missing else "") + ")", _three(probe)),
            (f"GetReport of the loaded session, median / max ms (n={len(phase.report_ms)})",
             (f"{statistics.median(phase.report_ms) if phase.report_ms else float('nan'):.0f} / "
              f"{max(phase.report_ms, default=float('nan')):.0f}")),
            ("server peak VmRSS sampled in the phase MB", f"{phase.peak_rss_mb:.0f}"),
        ]
        for name, value in rows:
            lines.append(f"  {name:<62} {value:>22}")
    lines.append("-- the session")
    if result.injected is None:
        alert = "not injected"
    else:
        step, rank, where = result.injected
        alert = (f"{result.alert_ms:.1f} ms" if result.alert_ms is not None else "NO EVENT") + \
            f" (candidate step {step}, rank {rank}, {where} phase)"
    lines.append(f"  alert latency in the loaded session (divergent step handed -> Watch): {alert}")
    if result.divergence:
        step, rank, phase_name, module = result.divergence
        lines.append(f"  first divergence declared: step {step} rank {rank}, {phase_name} of {module!r}")
    if cfg.shards:
        lines.append(f"  sharded: {cfg.shards} shards at {', '.join(a for _, a in sorted(result.shard_addresses.items()))}"
                     f"; started and listening in {result.start_s:.1f} s; shard restarts seen {result.shard_restarts}")
        for label, m in sorted(result.processes.items(), key=lambda kv: (kv[1]["group"], kv[0])):
            lines.append(f"  {label:<28} pids {','.join(map(str, m['pids'])):<24} MB: peak VmHWM {m['hwm']:.0f}, "
                         f"sampled peak {m['peak']:.0f}, end {m['end']:.0f}")
        if result.left_over:
            lines.append(f"  left running after the server stopped (ended by pid): {', '.join(result.left_over)}")
    lines.append("  server MB" + (" (front and shards, summed)" if cfg.shards else "") + ": VmRSS start {start:.0f}, all joined {joined:.0f}, end {end:.0f}; "
                 "peak VmHWM {hwm:.0f} (sampled {sampled:.0f})".format(
                     start=result.rss_mb.get("start", 0), joined=result.rss_mb.get("joined", 0),
                     end=result.rss_mb.get("end", 0), hwm=result.rss_mb.get("peak (VmHWM)", 0),
                     sampled=result.rss_mb.get("peak sampled", 0)))
    joined = sum(1 for o in result.outcomes if o.welcomed)
    ok = sum(1 for o in result.outcomes if o.code == "OK")
    redirected = sum(1 for o in result.outcomes if o.stream_to)
    lines.append(f"  streams: {len(result.outcomes)} opened, {redirected} sent on to a shard by the front, "
                 f"{joined} joined, {ok} ended OK, "
                 f"{len(result.rejected)} rejected, failed or commanded; each sent steps 0..{result.final_step}; "
                 f"steps compared on every rank: {result.final_steps_compared}; status {result.status or '?'}; "
                 f"GetReport answered after the load: {'yes' if result.server_alive else 'NO'}")
    for o in result.rejected[:5]:
        lines.append(f"    stream {o.run}/rank{o.rank}: welcomed={o.welcomed} {o.code} {o.details} "
                     f"commands={o.commands}")
    short = [o for o in result.outcomes if o.last_step != result.final_step or o.acked != o.last_step]
    for o in short[:5]:
        lines.append(f"    stream {o.run}/rank{o.rank}: last step {o.last_step}, acknowledged {o.acked}")
    for run in (BASE, CAND):
        lines.append(f"  run {run}: {result.run_ranks.get(run, 0)} ranks, {result.run_states.get(run, '?')}; "
                     f"records sent {result.sent.get(run, 0):,}, received {result.received.get(run, 0):,}, "
                     f"steps resent {result.resent.get(run, 0)}, dropped {result.dropped.get(run) or 0} "
                     f"-> lost {result.lost[run]}")
    lost = sum(result.lost.values())
    parts = [f"RESULT {cfg.streams} streams x {cfg.records} records/step"]
    sat, paced = result.phase(SATURATION), result.phase(PACED)
    if sat:
        parts.append(f"saturation: {sat.records_compared_per_s:,.0f} records/s compared "
                     f"({sat.records_compared_per_s / max(sat.cores_busy, 1e-9):,.0f} per server core), "
                     f"ack p50/p99 {_pct(sat.ack_ms, 50):.0f}/{_pct(sat.ack_ms, 99):.0f} ms, "
                     f"alert p99 {_pct(sat.probe_alert_ms, 99):.1f} ms")
    if paced:
        parts.append(f"paced at {paced.records_compared_per_s:,.0f} records/s: "
                     f"ack p50/p99 {_pct(paced.ack_ms, 50):.1f}/{_pct(paced.ack_ms, 99):.1f} ms, "
                     f"alert p99 {_pct(paced.probe_alert_ms, 99):.1f} ms (probes)")
    parts.append("in-session alert " + (f"{result.alert_ms:.0f} ms" if result.alert_ms is not None else "none"))
    parts.append(f"server peak RSS {result.rss_mb.get('peak (VmHWM)', 0):.0f} MB")
    parts.append(f"lost records {lost}" + ("" if lost == 0 and not result.rejected else "  <-- FAIL"))
    lines.append("; ".join(parts))
    return "\n".join(lines)


def _held(result: LoadResult, phase: PhaseResult) -> bool:
    cfg = result.config
    return phase.steps_per_s >= 0.95 * phase.rate and phase.in_flight[1] <= phase.in_flight[0] + 2 * cfg.streams


def _p(xs: list[float], q: float, unit: float = 1.0, digits: int = 0) -> str:
    return f"{_pct(xs, q) / unit:,.{digits}f}" if xs else "-"


def compare(runs: list[tuple[int, LoadResult | None, str, float]]) -> str:
    """One table of every configuration's figures (markdown), then one of memory per process.

    ``runs``: (shards, result or None, error, wall seconds of the configuration)."""
    head = ["server", "records compared/s (saturation)", "server cores busy (front)", "per server core",
            "Ray's own cores", "load generators' cores", "ack p50 / p99 ms (saturation)",
            "paced: offered -> compared records/s", "ack p50 / p99 ms (paced)",
            "probe alert p50 / p99 ms (saturation; paced)", "loaded session's alert ms",
            "records lost", "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    mem = ["| server | process | peak VmHWM MB | sampled peak VmRSS MB | pids |", "|---|---|---|---|---|"]
    for shards, result, error, wall in runs:
        name = "one process" if shards == 0 else f"{shards} shard{'s' if shards > 1 else ''}"
        if result is None:
            lines.append(f"| {name} | FAILED: {error} |" + " |" * (len(head) - 2))
            continue
        sat, paced = result.phase(SATURATION), result.phase(PACED)
        row = [name]
        if sat:
            row += [f"{sat.records_compared_per_s:,.0f}",
                    f"{sat.cores_busy:.2f}" + (f" ({sat.front_cores_busy:.2f})" if shards else ""),
                    f"{sat.records_compared_per_s / max(sat.cores_busy, 1e-9):,.0f}",
                    f"{sat.ray_cores_busy:.2f}" if shards else "-", f"{sat.load_cores_busy:.2f}",
                    f"{_p(sat.ack_ms, 50)} / {_p(sat.ack_ms, 99)}"]
        else:
            row += ["-"] * 6
        if paced:
            row += [f"{paced.rate * result.config.ranks * result.config.records:,.0f} -> "
                    f"{paced.records_compared_per_s:,.0f} ({'held' if _held(result, paced) else 'NOT held'})",
                    f"{_p(paced.ack_ms, 50, digits=1)} / {_p(paced.ack_ms, 99, digits=1)}"]
        else:
            row += ["-", "-"]
        probes = [f"{_p(ph.probe_alert_ms, 50, digits=1)} / {_p(ph.probe_alert_ms, 99, digits=1)}"
                  + (f" ({ph.probes_missing} missed)" if ph.probes_missing else "") for ph in (sat, paced) if ph]
        row.append("; ".join(probes) or "-")
        row.append(f"{result.alert_ms:,.0f}" if result.alert_ms is not None else
                   ("NONE" if result.config.inject else "-"))
        lost = sum(result.lost.values())
        total = sum(result.sent.values())
        row.append(f"{lost} of {total / 1e6:.1f} M" + ("" if lost == 0 and not result.rejected else
                                                       f" FAIL ({len(result.rejected)} streams rejected)"))
        row.append(f"{wall:.0f}")
        lines.append("| " + " | ".join(row) + " |")
        for label, m in sorted(result.processes.items(), key=lambda kv: ({"front": 0, "shard": 1}.get(kv[1]["group"], 2),
                                                                            kv[0])):
            what = label if m["group"] != "ray" else label + " (Ray)"
            mem.append(f"| {name} | {what} | {m['hwm']:,.0f} | {m['peak']:,.0f} | "
                       f"{len(m['pids'])} process{'es' if len(m['pids']) > 1 else ''} |")
    return "\n".join(lines + ["", *mem])


def _uptime() -> str:
    try:
        with open("/proc/loadavg") as f:
            return "load average " + ", ".join(f.read().split()[:3])
    except OSError:
        return "load average unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = LoadConfig()
    parser.add_argument("--ranks", type=int, default=d.ranks, help="ranks per run (streams = 2 x ranks)")
    parser.add_argument("--records", type=int, default=d.records, help="records per step")
    parser.add_argument("--seconds", type=float, default=d.seconds, help="measured window of each phase")
    parser.add_argument("--warmup", type=float, default=d.warmup, help="warm-up before each window")
    parser.add_argument("--clients", type=int, default=d.clients, help="load-generating processes")
    parser.add_argument("--slack", type=int, default=d.slack, help="steps ranks may drift apart (-1: free-running)")
    parser.add_argument("--phases", default=",".join(d.phases), help="saturation,paced (either or both, in order)")
    parser.add_argument("--rate", type=float, default=d.rate,
                        help="paced phase: steps/s per stream (0: --fraction of the saturation phase's)")
    parser.add_argument("--fraction", type=float, default=d.fraction)
    parser.add_argument("--probes", type=int, default=d.probes, help="divergence-latency probe sessions per phase")
    parser.add_argument("--no-inject", action="store_true", help="no divergent step in the loaded session")
    parser.add_argument("--server-arg", action="append", default=[], help="passed to twinstep serve (repeatable)")
    parser.add_argument("--shards", default="0",
                        help="comma-separated shard counts, each measured in turn with its own server "
                             "(0: the embedded single-process server), e.g. 0,1,2,4; one table compares them")
    parser.add_argument("--ray-cpus", type=int, default=None,
                        help="with shards: CPUs the local Ray instance declares (default: twinstep serve's)")
    parser.add_argument("--shard-arg", action="append", default=[],
                        help="passed to twinstep serve only with shards (repeatable)")
    args = parser.parse_args()
    counts = [int(x) for x in args.shards.split(",") if x.strip()]
    if not counts or any(n < 0 for n in counts):
        parser.error("--shards: shard counts >= 0, e.g. 0,1,2,4")
    shard_args = tuple(args.shard_arg) + ((f"--ray-cpus={args.ray_cpus}",) if args.ray_cpus is not None else ())
    runs = []
    print(f"twinstep {2 * args.ranks}-stream load benchmark; {os.cpu_count()} CPUs; configurations: "
          + ", ".join("one process" if n == 0 else f"{n} shards" for n in counts) + f"; {_uptime()}", flush=True)
    for shards in counts:
        cfg = LoadConfig(ranks=args.ranks, records=args.records, seconds=args.seconds, warmup=args.warmup,
                         clients=args.clients, slack=args.slack,
                         phases=tuple(p for p in args.phases.split(",") if p), rate=args.rate,
                         fraction=args.fraction, probes=args.probes, inject=not args.no_inject,
                         server_args=tuple(args.server_arg), shards=shards, shard_args=shard_args)
        cfg.log = os.path.join(tempfile.gettempdir(), f"twinstep_load_streams_{os.getpid()}_{shards}.log")
        print(f"\n#### {'one server process' if shards == 0 else f'{shards} shards'}: server log {cfg.log}; "
              f"{_uptime()}", flush=True)
        t = time.perf_counter()
        try:
            result = run_load(cfg)
        except Exception as exc:  # one configuration failing still leaves the others' figures
            wall = time.perf_counter() - t
            print(f"FAILED after {wall:.0f} s: {type(exc).__name__}: {exc}\n-- server log, last lines:\n"
                  f"{_tail(cfg.log)}", flush=True)
            runs.append((shards, None, f"{type(exc).__name__}: {exc}", wall))
            continue
        wall = time.perf_counter() - t
        print(describe(result))
        print(f"(this configuration {wall:.1f} s wall; {_uptime()})", flush=True)
        runs.append((shards, result, "", wall))
    if len(runs) > 1:
        print(f"\n== every configuration, {2 * args.ranks} streams x {args.records} records/step; {_uptime()}\n")
        print(compare(runs))
    ok = all(r is not None and sum(r.lost.values()) == 0 and not r.rejected for _, r, _, _ in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
