"""The contract between the monitor and whatever carries its steps to the server.

Two senders implement :class:`Sender`: :class:`~twinstep.runtime.transport.stream.StreamClient`
(a thread of the training process owns the gRPC stream) and
:class:`~twinstep.runtime.transport.sidecar.SidecarClient` (a sender process does, on
tensors in shared memory).  The monitor types against this class only.

Threads.  ``start``, ``add_manifest``, ``submit``, ``send_health``, ``send_setup``,
``mark_missing``, ``wait_for_credit`` and ``close`` are called by the training
thread (``close`` also from ``atexit``).  ``on_command`` and ``current_step``,
given to the constructor, are called back on the sender's own thread.
``stats``, ``pending_steps``, ``credit`` and ``welcomed`` may be read from any
thread.

Never blocks.  Every method returns at once, but two: ``wait_for_credit``
(lockstep, bounded by its ``timeout``, and at once while disconnected) and
``close`` (bounded by its ``timeout``, plus a few seconds at most to stop a
sender process).

Never raises into training.  What cannot be delivered is dropped with a
reason, counted in ``stats.dropped``, listed by step in the missing steps the
server is told in-band, and warned once per reason (:mod:`twinstep.runtime.transport.ledger`).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

from twinstep.runtime.capture.recorder import StepBatch
from twinstep.runtime.transport.ledger import DropLedger
from twinstep.v1 import twinstep_pb2 as pb

POLL_SECONDS = 0.2


@dataclass
class ClientStats:
    """Counters of one sender (read them from any thread)."""

    ledger: DropLedger = field(default_factory=DropLedger, repr=False, compare=False)
    steps_sent: int = 0
    tensor_bytes: int = 0
    """Storage bytes of the full tensors encoded (tensor and lossy modes)."""
    tensor_wire_bytes: int = 0
    """Bytes those tensors took on the wire, after compression or quantisation."""
    reconnects: int = 0
    connected: bool = False
    reached: bool = False
    """The server has welcomed this sender at least once (``connected`` is whether it is now)."""
    failed_before_reached: bool = False
    """A connection attempt failed before the server ever welcomed this sender: with ``reached`` False,
    the server has not been reached so far, and ``close`` does not wait to flush into it."""
    rejected: str = ""

    @property
    def dropped(self) -> dict[str, int]:
        """Steps not delivered, per reason (a copy)."""
        return self.ledger.counts()


class Sender(ABC):
    """Carries one training process's steps to the server; see the module docstring for the contract.

    Subclasses set ``stats``, ``_cond`` (guarding ``_credit`` and ``_welcomed``),
    ``_credit`` and ``_welcomed``, and say when they are ``_gone``.
    """

    stats: ClientStats
    _cond: threading.Condition
    _credit: int
    _welcomed: bool

    @abstractmethod
    def start(self) -> None:
        """Start sending (the worker thread, or the sender process's threads)."""

    @abstractmethod
    def add_manifest(self, modules: list[pb.ModuleInfo], parameters: list[pb.ParameterInfo]) -> None:
        """Modules and parameters first seen; the server hears of them before the steps that name them."""

    @abstractmethod
    def submit(self, batch: StepBatch) -> bool:
        """Queue one step; False if it was dropped at once. Beyond the queue's bound the oldest step is dropped."""

    @abstractmethod
    def send_health(self, health: pb.CaptureHealth) -> None:
        """The latest capture-health snapshot (cumulative): only the latest is kept and sent."""

    @abstractmethod
    def send_setup(self, setup: pb.Setup) -> None:
        """The run's training set-up (docs/preflight.md): only the latest is kept, sent, and sent again after a reconnect."""

    @abstractmethod
    def mark_missing(self, step: int, reason: str, detail: str = "") -> None:
        """A step this process will not deliver (its capture failed, say): the server is told which and why."""

    @abstractmethod
    def close(self, reason: str, last_step: int, timeout: float) -> None:
        """Send what is queued, say Close, and stop; bounded by ``timeout``. Idempotent."""

    @property
    @abstractmethod
    def pending_steps(self) -> int:
        """Steps queued or sent but not yet acknowledged by the server."""

    @property
    def credit(self) -> int:
        """The highest step the server lets this run send (-1 until welcomed)."""
        return self._credit

    @property
    def welcomed(self) -> bool:
        """The server has accepted this run's stream (and it has not broken since)."""
        return self._welcomed

    def wait_for_credit(self, step: int, timeout: float, interrupted: Callable[[], bool]) -> bool:
        """Block until the server lets this run reach ``step`` (lockstep); False on timeout.

        Returns at once while not welcomed: lockstep never turns a dead server into a hung training.
        """
        deadline = time.monotonic() + timeout
        self._settle(timeout)
        with self._cond:
            while self._credit < step and self._welcomed and not interrupted() and not self._gone():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, POLL_SECONDS))
        return True

    def _settle(self, timeout: float) -> None:
        """Before a credit wait: give the connection time to be made (a sender process starts slowly)."""

    @abstractmethod
    def _gone(self) -> bool:
        """No credit will come any more (stopped, rejected, sender lost); caller holds ``_cond``."""
