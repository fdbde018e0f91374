"""Halting a session's runs so that every rank of a run stops at the same step.

A run of one process is told to halt at its next step.  A run of several ranks
is first asked where each rank is (HALT_PREPARE, answered by HaltAck), then
every rank is told to halt one step past the furthest, so none is left waiting
in a collective.  Answers are awaited on a thread of its own, never under the
session's lock, and for at most ``prepare_timeout`` seconds.

With several candidates, a candidate can be halted alone (:meth:`HaltState.halt_one`, then
:meth:`HaltCoordinator.halt_one_run`): the baseline keeps going for the candidates still within
tolerance.  :class:`HaltState` is what the session remembers; :class:`HaltCoordinator` does the telling.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Callable

from twinstep.server.connection import Connection
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep.server")


def halt_command(at_step: int, reason: str) -> pb.ServerMessage:
    return pb.ServerMessage(command=pb.Command(kind=pb.Command.HALT, reason=reason, at_step=at_step))


class HaltState:
    """Whether the session halted and why, and the runs halted alone: state only (the session core's)."""

    def __init__(self) -> None:
        self.halted = False
        self.reason = ""
        self.runs_halted: dict[str, str] = {}
        """Runs halted alone, each with its reason (the session's other runs went on)."""

    def reason_for(self, run: str) -> str | None:
        """Why a stream of ``run`` that joins now must halt at once; None when it may go on."""
        if self.halted:
            return self.reason
        return self.runs_halted.get(run)

    def start(self, reason: str) -> bool:
        """Mark the session halted; False when it already was (a halt happens once)."""
        if self.halted:
            return False
        self.halted, self.reason = True, reason
        return True

    def halt_one(self, run: str, reason: str) -> bool:
        """Mark one run halted and not the session; False when it (or the session) already was."""
        if self.halted or run in self.runs_halted:
            return False
        self.runs_halted[run] = reason
        return True


class HaltCoordinator:
    """Telling runs to halt: at once for a run of one process, in two phases for a run of several ranks."""

    def __init__(self, session: str, prepare_timeout: float, announce: Callable[[pb.HaltNotice], None]) -> None:
        self.session = session
        self.prepare_timeout = prepare_timeout
        self._announce = announce
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._acks: dict[int, dict[int, int]] = {}

    def halt_one_run(self, run: str, world_size: int, conns: list[Connection], reason: str) -> None:
        """Halt one run's streams (the session decided it halts alone)."""
        logger.warning("session %s: halting run %r (the other runs go on): %s", self.session, run, reason)
        if conns:
            self._halt_run(run, world_size, conns, reason, None)

    def halt_runs(self, plan: list[tuple[str, int, list[Connection]]], reason: str,
                  at_step: int | None = None) -> list[str]:
        """Send HALT to every open stream of (run, world size, streams); returns the runs told.

        ``at_step``: a step already chosen ahead of every rank (twinstep.server.control): every
        stream is told to stop there, with no question asked.
        """
        logger.warning("session %s: halting all runs: %s", self.session, reason)
        told = []
        for run, world_size, conns in plan:
            if not conns:
                continue
            told.append(run)
            self._halt_run(run, world_size, conns, reason, at_step)
        return told

    def _halt_run(self, run: str, world_size: int, conns: list[Connection], reason: str, at_step: int | None) -> None:
        if at_step is not None:
            for conn in conns:
                conn.send(halt_command(at_step, reason))
            self._announce(pb.HaltNotice(reason=reason, run=run, at_step=at_step))
        elif len(conns) == 1 and world_size == 1:
            conns[0].send(halt_command(-1, reason))
            self._announce(pb.HaltNotice(reason=reason, run=run, at_step=-1))
        else:
            threading.Thread(target=self._coordinate, args=(run, conns, reason), name="twinstep-halt",
                             daemon=True).start()

    def ack(self, conn: Connection, ack: pb.HaltAck) -> None:
        with self._cond:
            acks = self._acks.get(ack.request_id)
            if acks is not None:
                acks[conn.rank] = ack.current_step
                self._cond.notify_all()

    def _coordinate(self, run: str, conns: list[Connection], reason: str) -> None:
        """Ask every rank for its current step, then halt all at one step past the furthest."""
        request_id = next(self._ids)
        with self._cond:
            self._acks[request_id] = {}
        prepare = pb.ServerMessage(command=pb.Command(kind=pb.Command.HALT_PREPARE, reason=reason,
                                                      request_id=request_id))
        for conn in conns:
            conn.send(prepare)
        deadline = time.monotonic() + self.prepare_timeout
        with self._cond:
            while len(self._acks[request_id]) < len(conns):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            acks = self._acks.pop(request_id)
        # One step of slack: a rank may finish the step it reported before HALT arrives.
        at_step = max(acks.values()) + 1 if acks else -1
        if len(acks) < len(conns):
            logger.warning("session %s: %d of %d ranks of %r answered the halt; halting at step %d",
                           self.session, len(acks), len(conns), run, at_step)
        for conn in conns:
            conn.send(halt_command(at_step, reason))
        self._announce(pb.HaltNotice(reason=reason, run=run, at_step=at_step))
