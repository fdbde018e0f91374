"""``sender="process"``: the gRPC stream runs in a sender process beside the training.

In tensor mode the sender thread's work (about 90 ms of CPU per 166 MB step of
the reference model: building pieces and copying them into gRPC's buffers,
largely under the GIL) competes with the training thread for the training
process's GIL.  Here the training
thread still copies each tensor once, but into shared memory
(:mod:`twinstep.transport.shared_memory`); a small frame naming the buffer goes
over a local socket to a sender process, which runs the ordinary
:class:`~twinstep.transport.stream.StreamClient` on the same memory and says
when a buffer may be reused.

:class:`SidecarClient` has StreamClient's interface, so the monitor does not
care which one it drives.  Fail-open as everywhere: if the sender process
cannot start or dies, steps are dropped with reason ``sender_lost`` and one
warning, and training goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable

import numpy as np

from twinstep.capture.recorder import StepBatch
from twinstep.transport.shared_memory import SharedBuffers
from twinstep.transport.stream import ClientStats, StreamConfig
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep")

_HEADER = struct.Struct("<I")
# StepBatch fields that are callables or tensors of this process: rebuilt on the other side.
_LOCAL_FIELDS = frozenset({"tensors", "storage_array", "release", "copies_ready"})
_CONNECT_WAIT_S = 15.0


# -- frames: a 4-byte length, then a pickle; descriptors ride along with SCM_RIGHTS ----------


def encode_frame(message: tuple) -> bytes:
    body = pickle.dumps(message, protocol=5)
    return _HEADER.pack(len(body)) + body


def send_frame(sock: socket.socket, frame: bytes, fd: int | None = None) -> None:
    """Send one whole frame (blocking, without the GIL), with a file descriptor if given."""
    if fd is None:
        sock.sendall(frame)
        return
    sent = socket.send_fds(sock, [frame], [fd])
    if sent < len(frame):
        sock.sendall(frame[sent:])


class FrameReader:
    """Reads frames and the descriptors sent with them, in order."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._data = bytearray()
        self.fds: deque[int] = deque()

    def read(self) -> tuple | None:
        """The next message; None at end of stream."""
        while True:
            if len(self._data) >= _HEADER.size:
                (size,) = _HEADER.unpack_from(self._data)
                if len(self._data) >= _HEADER.size + size:
                    body = bytes(self._data[_HEADER.size : _HEADER.size + size])
                    del self._data[: _HEADER.size + size]
                    return pickle.loads(body)
            data, fds, _, _ = socket.recv_fds(self._sock, 1 << 20, 64)
            self.fds.extend(fds)
            if not data:
                return None
            self._data += data


def batch_state(batch: StepBatch) -> dict[str, Any]:
    """A StepBatch's plain fields (numpy arrays, lists, numbers)."""
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch) if f.name not in _LOCAL_FIELDS}


# -- the training process's side ---------------------------------------------------------------


class SidecarClient:
    """Drop-in for StreamClient whose stream lives in a sender process; see the module docstring."""

    def __init__(
        self,
        hello: pb.Hello,
        config: StreamConfig,
        on_command: Callable[[pb.Command], None],
        current_step: Callable[[], int],
    ) -> None:
        self._config = config
        self._on_command = on_command
        self._current_step = current_step
        self.stats = ClientStats()
        self._local_dropped: dict[str, int] = {}
        self._remote_dropped: dict[str, int] = {}
        self._cond = threading.Condition()
        self._control: deque[tuple[bytes, int | None]] = deque()  # before any batch: they name what batches use
        self._batches: deque[tuple[bytes, list[int], int]] = deque()  # (frame, shared buffers, step)
        self._inflight: dict[int, tuple[Any, Callable[[Any], None]]] = {}  # buffer number -> (host, release)
        self._credit = -1
        self._welcomed = False
        self._remote_pending = 0
        self._written = 0  # batch frames written to the socket
        self._received = 0  # of those, how many the sender process has taken in (as of its last state)
        self._closing = False
        self._dead = False
        self._closed = threading.Event()
        # The sender has connected (welcomed), failed to, or is gone: lockstep may judge credit from here on.
        self._settled = threading.Event()
        self._warned: set[str] = set()
        self.buffers = SharedBuffers(self._announce)
        self._sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-m", "twinstep.transport.sidecar_main", str(child.fileno())],
                pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, env=_child_env(),
            )
        except OSError as error:
            self._proc = None
            self._lose(f"could not start the sender process ({error})")
        finally:
            child.close()
        self._queue_control(("start", hello.SerializeToString(), dataclasses.asdict(config)))
        self._writer = threading.Thread(target=self._write, name="twinstep-sidecar-writer", daemon=True)
        self._reader = threading.Thread(target=self._read, name="twinstep-sidecar-reader", daemon=True)
        if hasattr(os, "register_at_fork"):
            method = weakref.WeakMethod(self._after_fork_in_child)
            os.register_at_fork(after_in_child=lambda: (m := method()) is not None and m())

    def _after_fork_in_child(self) -> None:
        # A forked child (a data-loader worker) must not talk to its parent's sender process.
        self._cond = threading.Condition()
        self._control, self._batches, self._inflight = deque(), deque(), {}
        self._proc = None
        self._dead = self._closing = True
        self._closed.set()

    # -- HostMemory, for the recorder's buffer pool ----------------------------------------------

    def allocate(self, nbytes: int) -> np.ndarray:
        return self.buffers.allocate(nbytes)

    def discard(self, buffer: Any, nbytes: int) -> None:
        number = self.buffers.forget(np.asarray(buffer).ctypes.data, nbytes)
        if number is not None:
            self._queue_control(("forget", number))

    # -- StreamClient's interface ------------------------------------------------------------

    @property
    def pending_steps(self) -> int:
        """Steps not yet acknowledged by the server (here and in the sender process)."""
        with self._cond:
            return len(self._batches) + (self._written - self._received) + self._remote_pending

    def start(self) -> None:
        self._writer.start()
        self._reader.start()

    def add_manifest(self, modules: list[pb.ModuleInfo], parameters: list[pb.ParameterInfo]) -> None:
        if modules or parameters:
            self._queue_control(("manifest", [m.SerializeToString() for m in modules],
                                 [p.SerializeToString() for p in parameters]))

    def send_health(self, health: pb.CaptureHealth) -> None:
        """As StreamClient's: the sender process keeps the latest snapshot and sends it."""
        self._queue_control(("health", health.SerializeToString()))

    def mark_missing(self, step: int, reason: str, detail: str = "") -> None:
        """As StreamClient's: the sender process lists the step with its health."""
        self._queue_control(("missing", step, reason, detail))

    def submit(self, batch: StepBatch) -> bool:
        """Queue a step for the sender process; never blocks. Its buffers come back once encoded there."""
        if self._dead or self._closing:
            self._release_batch(batch)
            self._drop("sender_lost" if self._dead else "already_shutdown")
            return False
        if batch.copies_ready is not None:  # asynchronous device copies: the other process reads them next
            batch.copies_ready()
            batch.copies_ready = None
        tensors, numbers = [], []
        for host in batch.tensors:
            array = batch.storage_array(host.copy) if batch.storage_array else np.asarray(host.copy)
            number = self.buffers.number_of(array.ctypes.data) if host.buffer is not None else None
            if number is None:  # not in shared memory (e.g. an accelerator tensor copied by the framework)
                tensors.append((host.records, host.dtype, host.nbytes, "inline", np.ascontiguousarray(array)))
                if batch.release is not None:
                    batch.release(host)
            else:
                tensors.append((host.records, host.dtype, host.nbytes, "shared", (number, array.dtype.str, array.shape)))
                numbers.append(number)
                with self._cond:
                    self._inflight[number] = (host, batch.release)
        frame = encode_frame(("batch", batch_state(batch), tensors, self._current_step()))
        with self._cond:
            self._batches.append((frame, numbers, batch.step))
            while len(self._batches) > self._config.max_queue_steps:
                _, old, old_step = self._batches.popleft()
                self._release_numbers(old)
                self._drop("queue_full")
                self._queue_control(("missing", old_step, "queue_full", ""))  # the server hears which step
            self._cond.notify_all()
        return True

    def wait_for_credit(self, step: int, timeout: float, interrupted: Callable[[], bool]) -> bool:
        """As StreamClient's, after first giving the sender process up to 15 s to connect.

        A thread sender is connected within milliseconds of attach; a sender
        process first starts an interpreter, and lockstep should hold from the first step.
        """
        deadline = time.monotonic() + timeout
        self._settled.wait(min(timeout, _CONNECT_WAIT_S))
        with self._cond:
            while self._credit < step and self._welcomed and not interrupted() and not self._dead:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.2))
        return True

    def close(self, reason: str, last_step: int, timeout: float) -> None:
        """Let the sender process flush (bounded by ``timeout``), then stop it."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
        with self._cond:  # after every queued batch
            self._batches.append((encode_frame(("close", reason, last_step, timeout)), [], -1))
            self._cond.notify_all()
        if not self._closed.wait(timeout + 2.0) and not self._dead:
            self._warn_once("close", "twinstep: the sender process did not finish within %.0f s; stopping it", timeout)
        self._stop_process()

    # -- writer and reader threads -------------------------------------------------------------

    def _write(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._control and not self._batches and not self._dead:
                        self._cond.wait(0.5)
                    if self._dead:
                        return
                    # Control first: segments and manifests name what the batches after them use.
                    if self._control:
                        frame, fd = self._control.popleft()
                    else:
                        frame, _, step = self._batches.popleft()
                        fd = None
                        # Counted before it leaves, so pending_steps never misses it; the close frame is no step.
                        self._written += step >= 0
                try:
                    send_frame(self._sock, frame, fd)
                finally:
                    if fd is not None:
                        os.close(fd)
        except OSError as error:
            self._lose(f"the sender process stopped reading ({error})")

    def _read(self) -> None:
        reader = FrameReader(self._sock)
        try:
            while True:
                message = reader.read()
                if message is None:
                    break
                self._handle(message)
        except (OSError, pickle.UnpicklingError, EOFError) as error:
            self._lose(f"lost the sender process ({error})")
            return
        if not self._closed.is_set():
            code = self._proc.poll() if self._proc is not None else None
            self._lose(f"the sender process exited (code {code})")

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "release":
            with self._cond:
                self._release_numbers(message[1])
        elif kind == "command":
            self._on_command(pb.Command.FromString(message[1]))
        elif kind == "ask_step":  # a halt is being prepared: the server needs the step training is at now
            self._queue_control(("step", message[1], self._current_step()))
        elif kind == "log":
            logger.log(message[1], "%s", message[2])
        elif kind in ("state", "closed"):
            state = message[1]
            with self._cond:
                self._remote_dropped = state["dropped"]
                self._credit, self._welcomed, self._remote_pending = state["credit"], state["welcomed"], state["pending"]
                self._received = state["received"]
                for name in ("steps_sent", "tensor_bytes", "tensor_wire_bytes", "reconnects", "connected", "rejected"):
                    setattr(self.stats, name, state[name])
                self._merge_dropped()
                self._cond.notify_all()
            if state["welcomed"] or state["reconnects"] or state["rejected"]:
                self._settled.set()
            if kind == "closed":
                self._closed.set()

    # -- bookkeeping -----------------------------------------------------------------------------

    def _announce(self, number: int, nbytes: int, fd: int) -> None:
        if self._dead:
            os.close(fd)
            return
        self._queue_control(("segment", number, nbytes), fd=fd)

    def _queue_control(self, message: tuple, fd: int | None = None) -> None:
        with self._cond:
            if self._dead:
                if fd is not None:
                    os.close(fd)
                return
            self._control.append((encode_frame(message), fd))
            self._cond.notify_all()

    def _release_batch(self, batch: StepBatch) -> None:
        if batch.release is not None:
            for host in batch.tensors:
                batch.release(host)

    def _release_numbers(self, numbers: list[int]) -> None:
        """Give buffers back to the pool (caller holds the lock)."""
        for number in numbers:
            entry = self._inflight.pop(number, None)
            if entry is not None and entry[1] is not None:
                entry[1](entry[0])

    def _drop(self, reason: str, count: int = 1) -> None:
        with self._cond:
            self._local_dropped[reason] = self._local_dropped.get(reason, 0) + count
            self._merge_dropped()
        if reason not in ("already_shutdown", "sender_lost"):
            self._warn_once("drop:" + reason, "twinstep: dropping steps (%s); counted, warned once", reason)

    def _merge_dropped(self) -> None:
        merged = dict(self._remote_dropped)
        for reason, count in self._local_dropped.items():
            merged[reason] = merged.get(reason, 0) + count
        self.stats.dropped = merged

    def _lose(self, why: str) -> None:
        """The sender process is gone: drop what waits for it, free its buffers, warn once."""
        with self._cond:
            if self._dead:
                return
            self._dead = True
            self.stats.connected = False
            lost = len(self._batches)
            for _, numbers, _ in self._batches:
                self._release_numbers(numbers)
            self._batches.clear()
            self._release_numbers(list(self._inflight))
            for _, fd in self._control:
                if fd is not None:
                    os.close(fd)
            self._control.clear()
            self._cond.notify_all()
        if lost:
            self._drop("sender_lost", lost)
        if not self._closing:
            self._warn_once("lost", "twinstep: %s; training continues without sending its steps", why)
        self._closed.set()
        self._settled.set()

    def _stop_process(self) -> None:
        proc = self._proc
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if proc is not None:
            try:
                proc.wait(2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(2.0)
        self._lose("the sender process was stopped")
        self._sock.close()

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)


def _child_env() -> dict[str, str]:
    """The sender process finds twinstep where this one did, even through a sys.path edit."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    return env
