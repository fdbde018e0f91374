"""Server load: records/s and MB/s sustained, memory, divergence/HALT latency, and a profile of one step.

    python benchmarks/server_load.py [--sessions 2] [--ranks 2] [--records 500] [--seconds 20]
                                     [--clients 2] [--tensors] [--repeats 20] [--skip-latency]

Why each part is built the way it is:

* The server runs in its own process (``python -m twinstep serve``), so its CPU
  and RSS (read from /proc/<pid>) are not mixed with the load generator's.
* Load comes from ``--clients`` processes; each opens, for every session it
  owns, one stream per rank for the baseline and one per rank for a candidate,
  and sends pre-serialized StepRecords (only the step number is appended per
  send) as fast as the server's Credit allows.  Client serialization is thus
  nearly free and the server is the bottleneck being measured.
* Throughput counts what the server compared: ``steps_compared`` from
  GetReport (steps compared on every rank) x ranks x records per step, read
  after a warm-up and again at the end of ``--seconds``.  MB/s is the wire
  size of the steps the server acknowledged (both runs) over the same window.
  "Per server core" divides by the server's CPU time (all its threads, gRPC's
  included) over that window: the figure that does not depend on how much of
  a shared machine the load generators take.  The RESULT line repeats both.
* Latency runs on a second server with --halt-on-divergence, unloaded: the
  time from putting the candidate's step K on the wire to (a) a Watch stream
  seeing the Divergence event and (b) each run's stream seeing Command HALT.
* The profile runs decode_step + compare_step + the per-step detection (first
  divergence, headroom) in this process, timed and then under cProfile, so one
  can see whether per-record Python (not numpy) dominates a step.

The machine may be small and shared: the figures are provisional.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import multiprocessing as mp
import os
import pstats
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np

from twinstep.wire import codec, stats
from twinstep._version import PROTOCOL_VERSION
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc

HOST = "127.0.0.1"
BATCH, SEQ, HIDDEN, FFN = 8, 128, 256, 1024
_END = object()

# -- synthetic steps ----------------------------------------------------------------------------

# One transformer layer: (module suffix, type, output shape) and its parameters (suffix, shape).
_LAYER_MODULES = [
    ("ln1", "LayerNorm", (BATCH, SEQ, HIDDEN)),
    ("attn.q", "Linear", (BATCH, SEQ, HIDDEN)),
    ("attn.k", "Linear", (BATCH, SEQ, HIDDEN)),
    ("attn.v", "Linear", (BATCH, SEQ, HIDDEN)),
    ("attn.o", "Linear", (BATCH, SEQ, HIDDEN)),
    ("ln2", "LayerNorm", (BATCH, SEQ, HIDDEN)),
    ("mlp.fc1", "Linear", (BATCH, SEQ, FFN)),
    ("mlp.fc2", "Linear", (BATCH, SEQ, HIDDEN)),
    ("", "Block", (BATCH, SEQ, HIDDEN)),
]
_LAYER_PARAMS = [
    ("ln1", "LayerNorm", "weight", (HIDDEN,)), ("ln1", "LayerNorm", "bias", (HIDDEN,)),
    ("attn.q", "Linear", "weight", (HIDDEN, HIDDEN)), ("attn.q", "Linear", "bias", (HIDDEN,)),
    ("attn.k", "Linear", "weight", (HIDDEN, HIDDEN)), ("attn.k", "Linear", "bias", (HIDDEN,)),
    ("attn.v", "Linear", "weight", (HIDDEN, HIDDEN)), ("attn.v", "Linear", "bias", (HIDDEN,)),
    ("attn.o", "Linear", "weight", (HIDDEN, HIDDEN)), ("attn.o", "Linear", "bias", (HIDDEN,)),
    ("ln2", "LayerNorm", "weight", (HIDDEN,)), ("ln2", "LayerNorm", "bias", (HIDDEN,)),
    ("mlp.fc1", "Linear", "weight", (FFN, HIDDEN)), ("mlp.fc1", "Linear", "bias", (FFN,)),
    ("mlp.fc2", "Linear", "weight", (HIDDEN, FFN)), ("mlp.fc2", "Linear", "bias", (HIDDEN,)),
]
# Records per layer: forward + backward per module, grad + param per parameter.
_PER_LAYER = 2 * len(_LAYER_MODULES) + 2 * len(_LAYER_PARAMS)


@dataclass
class _Rec:
    phase: int
    target: int
    shape: tuple[int, ...]
    mean: float
    std: float
    payload: bool


def _layout(n_records: int, tensors: bool, seed: int = 0) -> tuple[pb.Manifest, list[_Rec]]:
    """A transformer-like step of ``n_records`` records: forwards, loss, backwards, grads, params (trimmed)."""
    rng = np.random.default_rng(seed)
    layers = max(1, -(-(n_records - 1) // _PER_LAYER))
    manifest = pb.Manifest()
    fwd, bwd, grad, param = [], [], [], []
    module_id, param_id = 1, 1
    for layer in range(layers):
        prefix = f"layers.{layer}"
        for suffix, kind, shape in _LAYER_MODULES:
            name = f"{prefix}.{suffix}" if suffix else prefix
            manifest.modules.add(id=module_id, name=name, type=kind)
            fwd.append(_Rec(pb.FORWARD, module_id, shape, float(rng.normal(0, 0.1)), float(rng.uniform(0.5, 2)), False))
            bwd.append(_Rec(pb.BACKWARD, module_id, shape, float(rng.normal(0, 1e-6)), float(rng.uniform(1e-5, 1e-3)), False))
            module_id += 1
        for module, kind, local, shape in _LAYER_PARAMS:
            manifest.parameters.add(id=param_id, name=f"{prefix}.{module}.{local}", module=f"{prefix}.{module}",
                                    module_type=kind, shape=list(shape), dtype=pb.FLOAT32)
            small = len(shape) == 1
            grad.append(_Rec(pb.GRAD, param_id, shape, float(rng.normal(0, 1e-6)), float(rng.uniform(1e-5, 1e-3)), tensors and small))
            param.append(_Rec(pb.PARAM, param_id, shape, 1.0 if local == "weight" and kind == "LayerNorm" else float(rng.normal(0, 1e-3)),
                              float(rng.uniform(0.01, 0.05)), tensors and small))
            param_id += 1
    bwd.reverse()
    records = fwd + [_Rec(pb.LOSS, 0, (), 2.5, 0.0, False)] + bwd + grad + param
    return manifest, records[:n_records]


def _step_message(records: list[_Rec], rank: int, *, noise: float = 0.0, diverge: int | None = None,
                  seed: int = 0, pieces: list[bytes] | None = None) -> pb.StepRecords:
    """StepRecords (step 0) with consistent statistics; ``noise`` perturbs relatively, ``diverge`` one record by 20%.

    Records with a payload append their TensorPiece (serialized, without its step: see _piece_frame) to ``pieces``.
    """
    rng = np.random.default_rng(seed)
    msg = pb.StepRecords(rank=rank)
    for i, r in enumerate(records):
        n = int(np.prod(r.shape)) if r.shape else 1
        mean, std = r.mean, r.std
        if noise:
            mean *= 1 + noise * rng.standard_normal()
            std *= 1 + noise * rng.standard_normal()
        if diverge == i:
            mean, std = mean * 1.2 + 0.2 * std, std * 1.2
        msg.phase.append(r.phase)
        msg.target.append(r.target)
        msg.call_index.append(0)
        msg.slot.append(0)
        msg.dtype.append(pb.FLOAT32)
        msg.ndim.append(len(r.shape))
        msg.dims.extend(r.shape)
        if r.payload:
            values = (np.random.default_rng(1000 + i).standard_normal(r.shape) * std + mean).astype(np.float32)
            t = stats.of_array(values)
            kind, data, raw = codec.encode(values)
            if pieces is not None:
                pieces.append(pb.TensorPiece(record=i, numel=values.size, codec=kind, raw_nbytes=raw,
                                             data=data).SerializeToString())
                msg.tensor_pieces += 1
            row = {k: t[k][0].item() for k in stats.FIELDS}
        else:
            m2 = n * std * std
            total = n * mean
            lo, hi = mean - 4.5 * std, mean + 4.5 * std
            row = {"count": n, "sum": total, "sum_sq": m2 + total * total / n, "min": lo, "max": hi,
                   "abs_max": max(abs(lo), abs(hi)), "nan_count": 0, "inf_count": 0, "m2": m2}
        for name in stats.FIELDS:
            getattr(msg.stats, name).append(row[name])
    return msg


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _frame(body: bytes, step: int) -> bytes:
    """ClientMessage{step: body + (field 2 = step)}: protobuf fields may come in any order, so no reserialization."""
    inner = body + b"\x10" + _varint(step)
    return b"\x1a" + _varint(len(inner)) + inner


def _piece_frame(body: bytes, step: int) -> bytes:
    """ClientMessage{tensor: body + (field 1 = step)}, as _frame does for a step."""
    inner = body + b"\x08" + _varint(step)
    return b"\x32" + _varint(len(inner)) + inner


def _hello(session: str, run: str, baseline: bool, rank: int, world: int) -> bytes:
    return pb.ClientMessage(hello=pb.Hello(
        protocol_version=PROTOCOL_VERSION, session=session, run=run, baseline=baseline, framework="torch",
        framework_version="bench", rank=rank, world_size=world, capture="stats", pid=os.getpid(),
    )).SerializeToString()


# -- a raw stream ------------------------------------------------------------------------------


class Answer:
    """One call's first answer: set at its first ServerMessage (or at its end); ``stream_to`` if it redirects."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.stream_to = ""


def redirected_requests(hello: bytes, answer: Answer, rest):
    """One call's requests: the hello, then, once the server answered without sending the stream elsewhere
    (a sharded server's front answers with Welcome.stream_to and ends the stream), the rest.  A front
    receives the hello only; the stream's other messages wait for the call that will carry them."""
    yield hello
    answer.event.wait()
    if not answer.stream_to:
        yield from rest


MAX_REDIRECTS = 4


class Stream:
    """One rank of one run: pre-serialized frames out; credit, HALT and events timestamped in.

    When the server's Welcome names ``stream_to`` (a sharded server's front), the stream opens again on
    that address, with the same hello, on a channel of its own (closed when the stream ends)."""

    def __init__(self, channel: grpc.Channel, hello: bytes, manifest: pb.Manifest) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._hello = hello
        self._cond = threading.Condition()
        self.max_step = -1
        self.acked = -1
        self.halt_at: float | None = None
        self.divergence_at: float | None = None
        self.ended = threading.Event()
        self.last_sent = -1
        self.stream_to = ""
        self._requests.put(pb.ClientMessage(manifest=manifest).SerializeToString())
        self.call, self._answer = self._open(channel)
        threading.Thread(target=self._read, daemon=True).start()

    def _open(self, channel: grpc.Channel):
        method = channel.stream_stream("/twinstep.v1.Twinstep/Stream", request_serializer=lambda b: b,
                                       response_deserializer=pb.ServerMessage.FromString)
        answer = Answer()
        return method(redirected_requests(self._hello, answer, iter(self._requests.get, _END))), answer

    def _read(self) -> None:
        own = None  # the channel to the address a front named
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
                if own is not None:
                    own.close()
                own = grpc.insecure_channel(self.stream_to)
                self.call, self._answer = self._open(own)
        except grpc.RpcError:
            pass
        finally:
            self.ended.set()
            with self._cond:
                self._cond.notify_all()
            if own is not None:
                own.close()

    def _read_call(self) -> None:
        for message in self.call:
            kind = message.WhichOneof("body")
            now = time.perf_counter()
            if kind == "welcome" and message.welcome.stream_to:
                self._answer.stream_to = message.welcome.stream_to  # the front ends this call
            self._answer.event.set()
            if kind == "credit":
                with self._cond:
                    self.max_step, self.acked = message.credit.max_step, message.credit.acked_step
                    self._cond.notify_all()
            elif kind == "command":
                if message.command.kind == pb.Command.HALT_PREPARE:
                    ack = pb.HaltAck(request_id=message.command.request_id, current_step=self.last_sent)
                    self._requests.put(pb.ClientMessage(halt_ack=ack).SerializeToString())
                elif message.command.kind == pb.Command.HALT and self.halt_at is None:
                    self.halt_at = now
            elif kind == "event" and message.event.WhichOneof("body") == "divergence" and self.divergence_at is None:
                self.divergence_at = now

    def wait_credit(self, step: int, deadline: float) -> bool:
        """Block until ``step`` may be sent (False at the deadline or stream end)."""
        with self._cond:
            while self.max_step < step:
                if self.ended.is_set() or self.halt_at is not None:
                    return False
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.2))
            return True

    def wait_acked(self, step: int, timeout: float) -> bool:
        deadline = time.perf_counter() + timeout
        with self._cond:
            while self.acked < step and not self.ended.is_set():
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return self.acked >= step

    def send(self, frame: bytes, step: int) -> None:
        self.last_sent = step
        self._requests.put(frame)

    def close(self, reason: str = "finished") -> None:
        self._requests.put(pb.ClientMessage(close=pb.Close(reason=reason, last_step=self.last_sent)).SerializeToString())
        self._requests.put(_END)


# -- throughput phase --------------------------------------------------------------------------


def _client_process(address: str, sessions: list[str], ranks: int, records: int, tensors: bool,
                    stop_at: float, acked: "mp.Array", slot0: int, ready: "mp.Barrier") -> None:
    """Open 2 x ranks streams per session and send as fast as credit allows until ``stop_at`` (wall clock)."""
    manifest, layout = _layout(records, tensors)
    bodies, piece_bodies = {}, {}
    for run in ("base", "cand"):
        for r in range(ranks):
            piece_bodies[(run, r)] = []
            bodies[(run, r)] = _step_message(layout, r, noise=1e-9 if run == "cand" else 0.0, seed=r,
                                             pieces=piece_bodies[(run, r)]).SerializeToString()
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 256 << 20)])
    streams: list[tuple[Stream, bytes, list[bytes]]] = []
    for session in sessions:
        for run in ("base", "cand"):
            for r in range(ranks):
                streams.append((Stream(channel, _hello(session, run, run == "base", r, ranks), manifest), bodies[(run, r)],
                                piece_bodies[(run, r)]))
    ready.wait()
    deadline_perf = time.perf_counter() + (stop_at - time.time())

    def pump(k: int, stream: Stream, body: bytes, pieces: list[bytes]) -> None:
        step = 0
        while time.perf_counter() < deadline_perf:
            if not stream.wait_credit(step, deadline_perf):
                break
            for piece in pieces:  # a step's tensors go ahead of its records
                stream.send(_piece_frame(piece, step), step)
            stream.send(_frame(body, step), step)
            step += 1
            acked[slot0 + k] = stream.acked
        stream.close()
        stream.ended.wait(10)
        acked[slot0 + k] = stream.acked

    threads = [threading.Thread(target=pump, args=(k, *item), daemon=True) for k, item in enumerate(streams)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        for k, (stream, _, _) in enumerate(streams):
            acked[slot0 + k] = stream.acked
        time.sleep(0.05)
    channel.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _start_server(halt: bool, log: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "twinstep", "serve", "--host", HOST, "--port", str(port)] + (["--halt-on-divergence"] if halt else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    line = proc.stdout.readline()
    if "listening" not in line:
        raise RuntimeError(f"server did not start: {line!r}; see {log}")
    return proc, f"{HOST}:{port}"


def _stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def _proc_status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                out[line.split(":")[0]] = int(line.split()[1])  # kB
    return out


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _compared(stub: pb_grpc.TwinstepStub, sessions: list[str]) -> int:
    total = 0
    for s in sessions:
        try:
            total += stub.GetReport(pb.ReportRequest(session=s), timeout=30).steps_compared
        except grpc.RpcError:
            pass
    return total


def throughput(args: argparse.Namespace, log: str) -> None:
    proc, address = _start_server(False, log)
    try:
        time.sleep(0.5)
        rss0 = _proc_status(proc.pid)
        sessions = [f"load{i}" for i in range(args.sessions)]
        shards = [sessions[i::args.clients] for i in range(args.clients)]
        shards = [s for s in shards if s]
        streams_per = [len(s) * 2 * args.ranks for s in shards]
        acked = mp.Array("q", [-1] * sum(streams_per), lock=False)
        ready = mp.Barrier(len(shards) + 1)
        warmup = min(3.0, args.seconds / 4)
        stop_at = time.time() + args.seconds + warmup + 3.0  # 3 s for connecting
        ctx = mp.get_context("fork")
        procs = []
        offset = 0
        for shard, count in zip(shards, streams_per):
            p = ctx.Process(target=_client_process, args=(address, shard, args.ranks, args.records, args.tensors,
                                                          stop_at, acked, offset, ready), daemon=True)
            p.start()
            procs.append(p)
            offset += count
        ready.wait(timeout=60)
        manifest, layout = _layout(args.records, args.tensors)
        step_bytes = len(_frame(_step_message(layout, 0).SerializeToString(), 1000))
        channel = grpc.insecure_channel(address)
        stub = pb_grpc.TwinstepStub(channel)
        time.sleep(warmup)
        t0, cpu0, c0, a0 = time.perf_counter(), _proc_cpu(proc.pid), _compared(stub, sessions), sum(x + 1 for x in acked)
        time.sleep(args.seconds)
        t1, cpu1, c1, a1 = time.perf_counter(), _proc_cpu(proc.pid), _compared(stub, sessions), sum(x + 1 for x in acked)
        rss1 = _proc_status(proc.pid)
        for p in procs:
            p.join(timeout=30)
        channel.close()
    finally:
        _stop_server(proc)
    dt = t1 - t0
    pairs = (c1 - c0) * args.ranks  # (candidate, baseline) rank-steps compared
    records_s = pairs * args.records / dt
    mb_s = (a1 - a0) * step_bytes / dt / 1e6
    streams = sum(streams_per)
    busy = (cpu1 - cpu0) / dt  # server cores busy (all its threads, gRPC's included)
    print(f"\n== throughput: {args.sessions} sessions x {args.ranks} ranks x 2 runs = {streams} streams, "
          f"{len(shards)} client processes, {args.records} records/step ({step_bytes / 1e3:.1f} kB on the wire"
          f"{', tensors of 1-D params' if args.tensors else ', stats only'}), {dt:.1f} s measured after {warmup:.0f} s warm-up")
    rows = [
        ("rank-steps compared (pairs)", f"{pairs}"),
        ("steps received (both runs)", f"{a1 - a0}"),
        ("records compared / s", f"{records_s:,.0f}"),
        ("records compared / s per server core", f"{records_s / max(busy, 1e-9):,.0f}"),
        ("step pairs compared / s", f"{pairs / dt:,.1f}"),
        ("MB/s received by server", f"{mb_s:.2f}"),
        ("server CPU (cores busy)", f"{busy:.2f}"),
        ("server CPU ms per step pair", f"{1e3 * (cpu1 - cpu0) / max(pairs, 1):.2f}"),
        ("server CPU us per record pair", f"{1e6 * (cpu1 - cpu0) / max(pairs * args.records, 1):.2f}"),
        ("server VmRSS start / end (MB)", f"{rss0['VmRSS'] / 1024:.0f} / {rss1['VmRSS'] / 1024:.0f}"),
        ("server VmHWM end (MB)", f"{rss1['VmHWM'] / 1024:.0f}"),
    ]
    for name, value in rows:
        print(f"  {name:<38} {value:>16}")
    print(f"RESULT records/s: {records_s:,.0f} compared, {records_s / max(busy, 1e-9):,.0f} per server core "
          f"({busy:.2f} cores busy)")


# -- latency phase ------------------------------------------------------------------------------


def latency(args: argparse.Namespace, log: str) -> None:
    proc, address = _start_server(True, log)
    step_k = 5
    manifest, layout = _layout(args.records, False)
    forwards = [i for i, r in enumerate(layout) if r.phase == pb.FORWARD]
    diverge_at = forwards[len(forwards) // 2]  # mid-model: the first divergence, not the loss
    base_body = _step_message(layout, 0).SerializeToString()
    cand_body = _step_message(layout, 0, noise=1e-9).SerializeToString()
    bad_body = _step_message(layout, 0, noise=1e-9, diverge=diverge_at).SerializeToString()
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.TwinstepStub(channel)
    watch_ms, base_ms, cand_ms, missing = [], [], [], 0
    try:
        for rep in range(args.repeats):
            session = f"latency{rep}"
            seen = threading.Event()
            divergence: list[float] = []

            def watch() -> None:
                call = stub.Watch(pb.WatchRequest(session=session), timeout=30)
                try:
                    for event in call:
                        seen.set()
                        if event.WhichOneof("body") == "divergence":
                            divergence.append(time.perf_counter())
                            call.cancel()
                            return
                except grpc.RpcError:
                    pass

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            seen.wait(10)
            base = Stream(channel, _hello(session, "base", True, 0, 1), manifest)
            cand = Stream(channel, _hello(session, "cand", False, 0, 1), manifest)
            deadline = time.perf_counter() + 30
            for s in range(step_k + 1):
                base.wait_credit(s, deadline)
                base.send(_frame(base_body, s), s)
            base.wait_acked(step_k, 30)
            for s in range(step_k):
                cand.wait_credit(s, deadline)
                cand.send(_frame(cand_body, s), s)
            cand.wait_acked(step_k - 1, 30)
            time.sleep(0.05)  # let credit/progress traffic settle
            t0 = time.perf_counter()
            cand.send(_frame(bad_body, step_k), step_k)
            end = time.perf_counter() + 10
            while time.perf_counter() < end and (not divergence or base.halt_at is None or cand.halt_at is None):
                time.sleep(0.0005)
            if divergence and base.halt_at and cand.halt_at:
                watch_ms.append(1e3 * (divergence[0] - t0))
                base_ms.append(1e3 * (base.halt_at - t0))
                cand_ms.append(1e3 * (cand.halt_at - t0))
            else:
                missing += 1
            base.close("halted")
            cand.close("halted")
            watcher.join(2)
    finally:
        channel.close()
        _stop_server(proc)

    def row(name: str, xs: list[float]) -> None:
        if not xs:
            print(f"  {name:<44} no samples")
            return
        xs = sorted(xs)
        p95 = xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]
        print(f"  {name:<44} {statistics.median(xs):8.2f} {p95:8.2f} {xs[0]:8.2f} {xs[-1]:8.2f}")

    print(f"\n== latency: candidate step {step_k} ({args.records} records, record {diverge_at} divergent) sent -> ..., "
          f"halt_on_divergence, {len(watch_ms)} of {args.repeats} repeats ({missing} incomplete), unloaded server")
    print(f"  {'ms':<44} {'median':>8} {'p95':>8} {'min':>8} {'max':>8}")
    row("Watch receives Divergence", watch_ms)
    row("baseline stream receives HALT", base_ms)
    row("candidate stream receives HALT", cand_ms)


# -- profile -------------------------------------------------------------------------------------


class _Detect:
    """What the session runs on every compared step after compare_step: first divergence and headroom."""

    def __init__(self, tracker, headroom) -> None:
        self.tracker, self.headroom = tracker, headroom

    def __call__(self, comparison) -> None:
        self.tracker.add(comparison)
        self.headroom.add(comparison)


def profile(sizes: list[int], top: int = 10) -> None:
    """decode_step + compare_step + the per-step detection (first divergence, headroom) on one realistic
    step, in this process."""
    from twinstep.server.compare.comparator import CompareContext, compare_step
    from twinstep.server.detect.first_divergence import FirstDivergenceTracker
    from twinstep.server.detect.headroom import HeadroomTracker
    from twinstep.server.compare.mapping import NameMapping
    from twinstep.server.compare.plan import PlanCache
    from twinstep.server.compare.tolerance import ToleranceConfig
    from twinstep.server.ingest.decode import decode_step
    from twinstep.server.ingest.manifest import Manifest

    for n in sizes:
        manifest_msg, layout = _layout(n, False)
        manifest = Manifest()
        manifest.add(manifest_msg)
        base_msg = _step_message(layout, 0)
        cand_msg = _step_message(layout, 0, noise=1e-9)
        base_msg.step = cand_msg.step = 3
        ctx = CompareContext(base_framework="torch", cand_framework="torch", candidate_run="cand",
                             tolerances=ToleranceConfig(), mapping=NameMapping(), plans=PlanCache())
        base, cand = decode_step(base_msg, manifest), decode_step(cand_msg, manifest)
        result = compare_step(base, cand, ctx)
        assert len(result.rows) == n and result.first is None, (len(result.rows), result.first)
        iterations = max(20, 200_000 // n)
        detect = _Detect(FirstDivergenceTracker(), HeadroomTracker())

        timings = {"decode_step": 0.0, "compare_step": 0.0, "detect": 0.0}
        for _ in range(iterations):
            t = time.perf_counter()
            base = decode_step(base_msg, manifest)
            timings["decode_step"] += time.perf_counter() - t
            t = time.perf_counter()
            result = compare_step(base, cand, ctx)
            timings["compare_step"] += time.perf_counter() - t
            t = time.perf_counter()
            detect(result)
            timings["detect"] += time.perf_counter() - t
        total = sum(timings.values())
        print(f"\n== profile: {n} records/step, {iterations} iterations (no profiler): "
              + ", ".join(f"{k} {1e3 * v / iterations:.3f} ms ({1e6 * v / iterations / n:.3f} us/record)" for k, v in timings.items())
              + f"; together {n * iterations / total:,.0f} records/s on one core")
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(iterations):
            detect(compare_step(decode_step(base_msg, manifest), cand, ctx))
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
        lines = out.getvalue().splitlines()
        start = next(i for i, line in enumerate(lines) if "ncalls" in line)
        print(f"  top {top} by own time (decode_step + compare_step + detect, cProfile):")
        for line in lines[start:start + top + 1]:
            print("  " + line.replace(os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + "/", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--records", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=2, help="load-generating processes")
    parser.add_argument("--tensors", action="store_true", help="send 1-D parameters' grads and params as tensor pieces too")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--skip-profile", action="store_true")
    args = parser.parse_args()
    log = os.path.join(tempfile.gettempdir(), f"twinstep_server_load_{os.getpid()}.log")
    print(f"twinstep server load benchmark; {os.cpu_count()} CPUs; server log {log}")
    throughput(args, log)
    if not args.skip_latency:
        latency(args, log + ".latency")
    if not args.skip_profile:
        profile([args.records, 5000] if args.records != 5000 else [5000])


if __name__ == "__main__":
    main()
