"""Webhooks: a POST to each configured receiver on divergence, halt, lost run and capture failure.

Never in the comparison's way: the session's event bus calls :meth:`WebhookDispatcher.offer`
on the publisher's thread, which only appends to each receiver's bounded queue
(past ``queue_size`` the oldest waiting event is dropped and counted:
``queue_full``).  One named daemon thread per receiver sends, so a slow or dead
receiver delays only its own events.  Each event is tried up to
``max_attempts`` times: retried on connection errors, timeouts, 408, 429 and
5xx with exponential backoff and jitter (a Retry-After header is honoured up
to the cap); other answers (4xx: a wrong url or token) fail at once.  A stop
sends what is queued within its time limit, without retries, then aborts the
request in flight and counts the rest as ``shutdown``.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import socket
import ssl
import threading
import time
import urllib.parse
from collections import deque
from typing import TYPE_CHECKING

from twinstep._version import __version__
from twinstep.server.alert.webhook_config import WebhookConfig
from twinstep.server.alert.webhook_payload import event_kind, json_payload, slack_payload
from twinstep.v1 import twinstep_pb2 as pb

if TYPE_CHECKING:
    from twinstep.server.session import Session

logger = logging.getLogger("twinstep.server")

BACKOFF_BASE = 0.5
"""Seconds before the first retry; doubled for each further one (with jitter: half to all of it)."""
BACKOFF_CAP = 30.0
_WARN_EVERY = 60.0
_MAX_ANSWER = 64 << 10


class WebhookReceiver:
    """One receiver: its queue, its sender thread and its counters."""

    def __init__(self, config: WebhookConfig, server: str = "") -> None:
        self.config = config
        self.name = config.label
        """How logs and metrics call it: scheme://host:port (the path may hold a secret), made unique."""
        self._server = server
        self._url = urllib.parse.urlsplit(config.url)
        self._queue: deque[pb.Event] = deque()
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._deadline = float("inf")
        self._active: http.client.HTTPConnection | None = None
        self._ssl = ssl.create_default_context() if self._url.scheme == "https" else None
        self.sent = 0
        self.failed = 0
        self.retries = 0
        self.dropped: dict[str, int] = {}
        self._last_warned = -_WARN_EVERY
        self._unwarned = 0
        self._thread = threading.Thread(target=self._loop, name=f"twinstep-webhook-{config.label}", daemon=True)
        self._thread.start()

    # -- the publisher's side: never blocks ------------------------------------------------------

    def offer(self, event: pb.Event) -> None:
        with self._cond:
            if self._stopping.is_set():
                self._drop("shutdown")
                return
            if len(self._queue) >= self.config.queue_size:
                self._queue.popleft()  # the oldest waiting event goes: the receiver is far behind anyway
                self._drop("queue_full")
            self._queue.append(event)
            self._cond.notify()

    def _drop(self, reason: str, count: int = 1) -> None:
        with self._cond:  # reentrant: offer() holds it already
            first = reason not in self.dropped
            self.dropped[reason] = self.dropped.get(reason, 0) + count
        if first:
            logger.warning("webhook %s: dropping events (%s); counted (twinstep_webhook_dropped_total), warned once",
                           self.name, reason)

    def counts(self) -> dict[str, object]:
        """sent, failed, retries, queued and dropped (by reason), copied at once (for metrics)."""
        with self._cond:
            return {"sent": self.sent, "failed": self.failed, "retries": self.retries, "queued": len(self._queue),
                    "dropped": dict(self.dropped)}

    # -- the sender thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping.is_set():
                    self._cond.wait()
                if not self._queue:
                    return
                event = self._queue.popleft()
            try:
                self._deliver(event)
            except Exception:  # never let the sender die: the next event may go through
                self.failed += 1
                logger.exception("webhook %s: sending an event failed", self.name)

    def _deliver(self, event: pb.Event) -> None:
        make = slack_payload if self.config.format == "slack" else json_payload
        body = json.dumps(make(event, self._server)).encode()
        for attempt in range(self.config.max_attempts):
            if self._past_deadline():
                self._drop("shutdown")
                return
            ok, retry, why, wait = self._post(body)
            if ok:
                self.sent += 1
                return
            last = attempt + 1 == self.config.max_attempts or self._stopping.is_set()
            if not retry or last:
                self.failed += 1
                self._warn(f"{event_kind(event)} event of session {event.session!r} not delivered after "
                           f"{attempt + 1} attempt(s): {why}")
                return
            self.retries += 1
            delay = min(BACKOFF_CAP, BACKOFF_BASE * 2 ** attempt)
            delay = max(delay / 2 + random.uniform(0, delay / 2), min(wait, BACKOFF_CAP))
            self._stopping.wait(delay)  # a stop cuts the backoff short: one last try, if time is left

    def _post(self, body: bytes) -> tuple[bool, bool, str, float]:
        """One POST: (delivered, worth retrying, why not, the receiver's Retry-After in seconds)."""
        timeout = min(self.config.timeout, max(0.05, self._deadline - time.monotonic()))
        url = self._url
        if url.scheme == "https":
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(url.hostname, url.port, timeout=timeout,
                                                                           context=self._ssl)
        else:
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
        path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        headers = {"Content-Type": "application/json", "User-Agent": f"twinstep/{__version__}",
                   **self.config.headers}
        with self._cond:
            self._active = conn
        try:
            conn.request("POST", path, body=body, headers=headers)
            answer = conn.getresponse()
            text = answer.read(_MAX_ANSWER)
            status = answer.status
        except (OSError, http.client.HTTPException) as exc:
            return False, True, f"{type(exc).__name__}: {exc}", 0.0
        finally:
            with self._cond:
                self._active = None
            conn.close()
        if 200 <= status < 300:
            return True, False, "", 0.0
        why = f"HTTP {status}: {text[:200].decode(errors='replace')}"
        retry = status >= 500 or status in (408, 429)
        return False, retry, why, _retry_after(answer.getheader("Retry-After"))

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warned < _WARN_EVERY:
            self._unwarned += 1
            return
        more = f" ({self._unwarned} more since the last warning)" if self._unwarned else ""
        logger.warning("webhook %s: %s%s", self.name, message, more)
        self._last_warned, self._unwarned = now, 0

    def _past_deadline(self) -> bool:
        return time.monotonic() >= self._deadline

    # -- stop ---------------------------------------------------------------------------------------

    def begin_stop(self, timeout: float) -> None:
        with self._cond:
            self._deadline = time.monotonic() + timeout
            self._stopping.set()
            self._cond.notify_all()

    def finish_stop(self, deadline: float) -> bool:
        """Wait for the sender until ``deadline`` (monotonic); then abort its request. True if it ended."""
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            with self._cond:
                conn, left = self._active, len(self._queue)
                self._queue.clear()
            if left:
                self._drop("shutdown", left)
            if conn is not None and conn.sock is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked read; the thread then ends
                except OSError:
                    pass
            self._thread.join(0.5)
        return not self._thread.is_alive()


def _retry_after(value: str | None) -> float:
    try:
        return max(0.0, float(value)) if value else 0.0
    except ValueError:
        return 0.0  # an HTTP date: use our own backoff


class WebhookDispatcher:
    """Every configured receiver, fed by the event buses of every session (see :meth:`attach`)."""

    def __init__(self, configs: list[WebhookConfig], server: str = "") -> None:
        self.receivers = [WebhookReceiver(config, server) for config in configs]
        seen: dict[str, int] = {}
        for receiver in self.receivers:
            seen[receiver.name] = seen.get(receiver.name, 0) + 1
            if seen[receiver.name] > 1:
                receiver.name += f" #{seen[receiver.name]}"

    def attach(self, session: "Session") -> None:
        """Send this session's events from now on (a SessionRegistry session listener: quick, never blocks)."""
        session.events.add_listener(self.offer)

    def offer(self, event: pb.Event) -> None:
        """Queue ``event`` for every receiver that wants its kind; anything else is ignored at once."""
        kind = event_kind(event)
        if kind is None:
            return
        for receiver in self.receivers:
            if kind in receiver.config.events:
                receiver.offer(event)

    def stop(self, timeout: float = 2.0) -> bool:
        """Send what is queued within ``timeout`` seconds (no retries), then give up; True if every sender ended."""
        deadline = time.monotonic() + timeout
        for receiver in self.receivers:
            receiver.begin_stop(timeout)
        ended = [receiver.finish_stop(deadline) for receiver in self.receivers]
        for receiver in self.receivers:
            if receiver.dropped.get("shutdown"):
                logger.warning("webhook %s: %d event(s) not sent: the server stopped first", receiver.name,
                               receiver.dropped["shutdown"])
        return all(ended)
