"""``sender="process"``: the gRPC stream runs in a sender process beside the training.

In tensor mode the sender thread's work (about 90 ms of CPU per 166 MB step of
the reference model: building pieces and copying them into gRPC's buffers,
largely under the GIL) competes with the training thread for the training
process's GIL.  Here the training
thread still copies each tensor once, but into shared memory
(:mod:`twinstep.runtime.transport.shared_memory`); a small frame naming the buffer goes
over a local socket to a sender process, which runs the ordinary
:class:`~twinstep.runtime.transport.stream.StreamClient` on the same memory and says
when a buffer may be reused.

:class:`SidecarClient` is a :class:`~twinstep.runtime.transport.base.Sender` like
StreamClient, so the monitor does not care which one it drives; the two
processes speak in :mod:`twinstep.runtime.transport.frames`.  Fail-open as everywhere: if the sender process
cannot start or dies, steps are dropped with reason ``sender_lost`` and one
warning, and training goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
from collections import deque
from typing import Any, Callable, Iterable

import numpy as np

from twinstep.runtime.capture.recorder import StepBatch
from twinstep.runtime.transport import frames
from twinstep.runtime.transport.base import ClientStats, Sender
from twinstep.runtime.transport.ledger import DropLedger, at_fork_in_child
from twinstep.runtime.transport.shared_memory import SharedBuffers
from twinstep.runtime.transport.stream import StreamConfig
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep")

# StepBatch fields that are callables or tensors of this process: rebuilt on the other side.
_LOCAL_FIELDS = frozenset({"tensors", "storage_array", "release", "copies_ready"})
_CONNECT_WAIT_S = 15.0


def batch_state(batch: StepBatch) -> dict[str, Any]:
    """A StepBatch's plain fields (numpy arrays, lists, numbers)."""
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch) if f.name not in _LOCAL_FIELDS}


class SidecarClient(Sender):
    """The training process's side of ``sender="process"``; see the module docstring."""

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
        self._ledger = DropLedger()  # drops here; the sender process's own come with its state
        self._warn_once = self._ledger.warn
        self.stats = ClientStats(self._ledger)
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
        self._forked_child = False
        self._closed = threading.Event()
        # The sender has connected (welcomed), failed to, or is gone: lockstep may judge credit from here on.
        self._settled = threading.Event()
        self._handlers: dict[type[frames.Frame], Callable[[Any], None]] = {
            frames.Release: self._on_release,
            frames.ServerCommand: self._on_server_command,
            frames.AskStep: self._on_ask_step,
            frames.Log: self._on_log,
            frames.State: self._on_state,
            frames.Closed: self._on_closed,
        }
        self.buffers = SharedBuffers(self._announce)
        self._sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-m", "twinstep.runtime.transport.sidecar_main", str(child.fileno())],
                pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, env=_child_env(),
            )
        except OSError as error:
            self._proc = None
            self._lose(f"could not start the sender process ({error})")
        finally:
            child.close()
        self._queue_control(frames.Start(hello.SerializeToString(), dataclasses.asdict(config)))
        self._writer = threading.Thread(target=self._write, name="twinstep-sidecar-writer", daemon=True)
        self._reader = threading.Thread(target=self._read, name="twinstep-sidecar-reader", daemon=True)
        at_fork_in_child(self._after_fork_in_child)

    def _after_fork_in_child(self) -> None:
        # A forked child (a data-loader worker) must not talk to its parent's sender process.
        self._cond = threading.Condition()
        self._control, self._batches, self._inflight = deque(), deque(), {}
        self._ledger.after_fork()
        self._proc = None
        self._dead = self._closing = self._forked_child = True
        self._closed.set()

    # -- HostMemory, for the recorder's buffer pool ----------------------------------------------

    def allocate(self, nbytes: int) -> np.ndarray:
        return self.buffers.allocate(nbytes)

    def discard(self, buffer: Any, nbytes: int) -> None:
        number = self.buffers.forget(np.asarray(buffer).ctypes.data, nbytes)
        if number is not None:
            self._queue_control(frames.Forget(number))

    # -- Sender --------------------------------------------------------------------------------

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
            self._queue_control(frames.Manifest(tuple(m.SerializeToString() for m in modules),
                                                tuple(p.SerializeToString() for p in parameters)))

    def send_health(self, health: pb.CaptureHealth) -> None:
        """The sender process keeps the latest snapshot and sends it."""
        self._queue_control(frames.Health(health.SerializeToString()))

    def send_setup(self, setup: pb.Setup) -> None:
        """The sender process keeps the latest set-up and sends it."""
        self._queue_control(frames.Setup(setup.SerializeToString()))

    def mark_missing(self, step: int, reason: str, detail: str = "") -> None:
        """The sender process lists the step with its health."""
        self._queue_control(frames.Missing(step, reason, detail))

    def submit(self, batch: StepBatch) -> bool:
        """Queue a step for the sender process; never blocks. Its buffers come back once encoded there."""
        if self._dead or self._closing:
            self._release_batch(batch)
            reason = "forked_child" if self._forked_child else "sender_lost" if self._dead else "already_shutdown"
            self._ledger.drop(reason, batch.step)
            return False
        if batch.copies_ready is not None:  # asynchronous device copies: the other process reads them next
            batch.copies_ready()
            batch.copies_ready = None
        tensors: list[frames.SharedTensor | frames.InlineTensor] = []
        numbers = []
        for host in batch.tensors:
            array = batch.storage_array(host.copy) if batch.storage_array else np.asarray(host.copy)
            number = self.buffers.number_of(array.ctypes.data) if host.buffer is not None else None
            records = tuple(host.records)
            if number is None:  # not in shared memory (e.g. an accelerator tensor copied by the framework)
                tensors.append(frames.InlineTensor(records, host.dtype, host.nbytes, np.ascontiguousarray(array)))
                if batch.release is not None:
                    batch.release(host)
            else:
                tensors.append(frames.SharedTensor(records, host.dtype, host.nbytes, number, array.dtype.str,
                                                   tuple(array.shape)))
                numbers.append(number)
                with self._cond:
                    self._inflight[number] = (host, batch.release)
        frame = frames.encode(frames.Batch(batch_state(batch), tuple(tensors), self._current_step()))
        with self._cond:
            self._batches.append((frame, numbers, batch.step))
            # Drop from the old end: the newest steps are the ones still comparable.
            while len(self._batches) > self._config.max_queue_steps:
                _, old, old_step = self._batches.popleft()
                self._release_numbers(old)
                self._ledger.drop("queue_full", old_step)
                # Counted here; the sender process lists the step and tells the server of the count.
                self._control.append((frames.encode(frames.Missing(old_step, "queue_full", dropped=True)), None))
            self._cond.notify_all()
        return True

    def close(self, reason: str, last_step: int, timeout: float) -> None:
        """Let the sender process flush (bounded by ``timeout``), then stop it."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            # After every queued batch.
            self._batches.append((frames.encode(frames.Close(reason, last_step, timeout)), [], -1))
            self._cond.notify_all()
        if not self._closed.wait(timeout + 2.0) and not self._dead:
            self._warn_once("close", "twinstep: the sender process did not finish within %.0f s; stopping it", timeout)
        self._stop_process()

    def _settle(self, timeout: float) -> None:
        """A thread sender is connected within milliseconds of attach; a sender process first starts an
        interpreter, and lockstep should hold from the first step: up to 15 s for it to connect."""
        self._settled.wait(min(timeout, _CONNECT_WAIT_S))

    def _gone(self) -> bool:
        return self._dead

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
                    frames.send(self._sock, frame, fd)
                finally:
                    if fd is not None:
                        os.close(fd)
        except OSError as error:
            self._lose(f"the sender process stopped reading ({error})")

    def _read(self) -> None:
        reader = frames.FrameReader(self._sock)
        try:
            while True:
                frame = reader.read()
                if frame is None:
                    break
                handler = self._handlers.get(type(frame))
                if handler is None:
                    raise frames.FrameError(f"the sender process sent a {type(frame).__name__} frame, "
                                            "which only the training process sends")
                handler(frame)
        except (OSError, frames.FrameError) as error:
            self._lose(f"lost the sender process ({error})")
            return
        if not self._closed.is_set():
            code = self._proc.poll() if self._proc is not None else None
            self._lose(f"the sender process exited (code {code})")

    def _on_release(self, frame: frames.Release) -> None:
        with self._cond:
            self._release_numbers(frame.numbers)

    def _on_server_command(self, frame: frames.ServerCommand) -> None:
        self._on_command(pb.Command.FromString(frame.command))

    def _on_ask_step(self, frame: frames.AskStep) -> None:
        """A halt is being prepared: the server needs the step training is at now."""
        self._queue_control(frames.StepAnswer(frame.token, self._current_step()))

    def _on_log(self, frame: frames.Log) -> None:
        logger.log(frame.level, "%s", frame.text)

    def _on_state(self, frame: frames.State | frames.Closed) -> None:
        state = frame.state
        self._ledger.set_remote(state.dropped)
        with self._cond:
            self._credit, self._welcomed, self._remote_pending = state.credit, state.welcomed, state.pending
            self._received = state.received
            for name in ("steps_sent", "tensor_bytes", "tensor_wire_bytes", "reconnects", "connected", "reached",
                         "failed_before_reached", "rejected"):
                setattr(self.stats, name, getattr(state, name))
            self._cond.notify_all()
        if state.welcomed or state.reconnects or state.rejected:
            self._settled.set()

    def _on_closed(self, frame: frames.Closed) -> None:
        self._on_state(frame)
        self._closed.set()

    # -- bookkeeping -----------------------------------------------------------------------------

    def _announce(self, number: int, nbytes: int, fd: int) -> None:
        if self._dead:
            os.close(fd)
            return
        self._queue_control(frames.Segment(number, nbytes), fd=fd)

    def _queue_control(self, frame: frames.Frame, fd: int | None = None) -> None:
        with self._cond:
            if self._dead:
                if fd is not None:
                    os.close(fd)
                return
            self._control.append((frames.encode(frame), fd))
            self._cond.notify_all()

    def _release_batch(self, batch: StepBatch) -> None:
        if batch.release is not None:
            for host in batch.tensors:
                batch.release(host)

    def _release_numbers(self, numbers: Iterable[int]) -> None:
        """Give buffers back to the pool (caller holds the lock)."""
        for number in numbers:
            entry = self._inflight.pop(number, None)
            if entry is not None and entry[1] is not None:
                entry[1](entry[0])

    def _lose(self, why: str) -> None:
        """The sender process is gone: drop what waits for it, free its buffers, warn once."""
        with self._cond:
            if self._dead:
                return
            self._dead = True
            self.stats.connected = False
            lost = [step for _, _, step in self._batches if step >= 0]
            for _, numbers, _ in self._batches:
                self._release_numbers(numbers)
            self._batches.clear()
            self._release_numbers(list(self._inflight))
            for _, fd in self._control:
                if fd is not None:
                    os.close(fd)
            self._control.clear()
            for step in lost:
                self._ledger.drop("sender_lost", step)
            self._cond.notify_all()
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


def _child_env() -> dict[str, str]:
    """The sender process finds twinstep where this one did, even through a sys.path edit."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    return env
