"""A live session's actions carried out: streams, watchers, timers, halts and zooms.

Actions are queued under the session's lock, in the order the core produced
them, and carried out after it is released by whichever thread finds the
queue non-empty, one thread at a time.  So no lock of the session is held
across a send, and what the core ordered stays ordered across threads: a
stream's Welcome, queued by its join, reaches it before any credit or event
that another stream's step computed later.  A caller returns once the queue
is empty, its own actions included (unless it is the thread carrying them
out, further up its stack: that loop takes them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Callable

from twinstep.server.connection import Connection
from twinstep.server.control import ZoomCoordinator
from twinstep.server.runs.halt import HaltCoordinator
from twinstep.server.session.actions import (Action, Alert, ArmGiveUp, AutoOps, AutoZoom, EndStream, HaltRun,
                                             HaltRuns, HaltWithBundle, Log, Publish, PublishProgress, Send,
                                             SessionEnded, SetCredit)
from twinstep.v1 import twinstep_pb2 as pb

if TYPE_CHECKING:
    from twinstep.server.session.coordinator import Session

logger = logging.getLogger("twinstep.server")

_PROGRESS_INTERVAL = 0.25
_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class LiveHandler:
    """Carries out one live session's actions (see the module docstring)."""

    def __init__(self, session: "Session", on_ended: Callable[["Session"], object] | None) -> None:
        self.session = session
        self.halts = HaltCoordinator(session.name, session.config.halt.prepare_timeout, self._announce_halt)
        self.zooms = ZoomCoordinator(session.name, session.config.halt.prepare_timeout)
        self._on_ended = on_ended  # the registry's memory budget and journal summary, once every run has ended
        self._queue: deque[Action] = deque()
        self._order = threading.Lock()
        self._carrier: int | None = None
        self._last_progress = 0.0

    def queue(self, actions: list[Action]) -> None:
        """Queue ``actions`` (the caller holds the session's lock: the queue keeps the core's order)."""
        self._queue.extend(actions)

    def carry_out_queue(self) -> None:
        """Carry out every queued action in order (the caller holds no lock of the session)."""
        me = threading.get_ident()
        if self._carrier == me:
            return
        with self._order:
            self._carrier = me
            try:
                while self._queue:
                    action = self._queue.popleft()
                    try:
                        self.carry_out(action)
                    except Exception:  # one action's fault must not drop the others
                        logger.exception("session %s: carrying out %s failed", self.session.name,
                                         type(action).__name__)
            finally:
                self._carrier = None

    def carry_out(self, action: Action) -> None:
        session = self.session
        if isinstance(action, Send):
            action.conn.send(action.message)
        elif isinstance(action, SetCredit):
            action.conn.set_credit(action.max_step, action.acked_step)
        elif isinstance(action, PublishProgress):
            self._publish_progress(action.force)
        elif isinstance(action, Alert):  # logged at its own level: information is not a warning
            logger.log(_LEVELS.get(action.level, logging.WARNING), "session %s: %s", session.name, action.message)
            session.events.publish(action.event(), keep=True)
        elif isinstance(action, Publish):
            session.events.publish(action.event, keep=action.keep)
            for conn in action.streams:
                conn.send(pb.ServerMessage(event=action.event))
        elif isinstance(action, Log):
            logger.log(action.level, "%s", action.message)
        elif isinstance(action, EndStream):
            action.conn.finish()
        elif isinstance(action, ArmGiveUp):
            self.give_up_later(action.conn, action.after)
        elif isinstance(action, SessionEnded):
            if self._on_ended is not None:
                self._on_ended(session)
        elif isinstance(action, HaltRuns):
            self.halts.halt_runs([(t.run, t.world_size, list(t.streams)) for t in action.targets], action.reason,
                                 action.at_step)
        elif isinstance(action, HaltRun):
            target = action.target
            self.halts.halt_one_run(target.run, target.world_size, list(target.streams), action.reason)
        elif isinstance(action, AutoZoom):
            self.zooms.after_divergence(session, action.found, action.steps)
        elif isinstance(action, AutoOps):
            self.zooms.ops_after_divergence(session, action.found, action.module, action.candidate_module)
        elif isinstance(action, HaltWithBundle):
            self.zooms.halt_with_bundle(session, action.found, action.reason)
        else:
            raise TypeError(f"no way to carry out {action!r}")

    def ack(self, conn: Connection, ack: pb.HaltAck) -> None:
        """An answer to a question a waiting thread asked: a zoom's step query, or a halt's."""
        if not self.zooms.ack(conn, ack):
            self.halts.ack(conn, ack)

    def give_up_later(self, conn: Connection, grace: float) -> None:
        """In ``grace`` seconds, tell the session the lost stream ``conn`` did not come back."""
        timer = threading.Timer(grace, self._give_up_safely, args=(conn,))
        timer.daemon = True
        timer.start()

    def _give_up_safely(self, conn: Connection) -> None:
        try:
            self.session.give_up(conn)
        except Exception:  # a timer thread must not die silently: the session would never end
            logger.exception("session %s: releasing lost stream %s failed", self.session.name, conn.label)

    def _publish_progress(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._last_progress < _PROGRESS_INTERVAL:
            return
        self._last_progress = now
        self.session.events.publish(pb.Event(progress=self.session.progress()))

    def _announce_halt(self, notice: pb.HaltNotice) -> None:
        self.session.events.publish(pb.Event(halt=notice), keep=True)
