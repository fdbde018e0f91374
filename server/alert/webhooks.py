"""Webhooks: a POST to each configured receiver on divergence, halt, lost run and capture failure.

Never in the comparison's way: the session's event bus calls :meth:`WebhookDispatcher.offer`
on the publisher's thread, which only appends to each receiver's bounded queue
(past ``queue_size`` the oldest waiting event is dropped and counted:
``queue_full``).  One named daemon thread per receiver sends, so a slow or dead
receiver delays only its own events.  Each event is tried up to
``max_attempts`` times: retried on connection errors, timeouts, 408, 429 and
5xx with exponential backoff and jitter (a Retry-After header is honoured up
to the cap); other answers (4xx: a wrong url or token; 3xx: redirects are not
followed) fail at once.  A stop sends what is queued within its time limit,
without retries, then aborts the request in flight and counts the rest as
``shutdown``.

Requests go through urllib.request, so the proxy variables are honoured as
everywhere else: ``HTTPS_PROXY`` / ``HTTP_PROXY`` (an https receiver is
reached through a CONNECT tunnel) and ``NO_PROXY``, read when the server starts.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Protocol

from twinstep._retry import Backoff, Retry
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
_BACKOFF = Backoff(BACKOFF_BASE, BACKOFF_CAP, jitter=(0.5, 1.0))
_WARN_EVERY = 60.0
_MAX_ANSWER = 64 << 10


class WebhookReceiver:
    """One receiver: its queue, its sender thread and its counters."""

    def __init__(self, config: WebhookConfig, server: str = "") -> None:
        self.config = config
        self.name = config.label
        """How logs and metrics call it: scheme://host:port (the path may hold a secret), made unique."""
        self._server = server
        url = urllib.parse.urlsplit(config.url)
        # Without user:password@ (http.client never sent it either) and with "/" for an empty path.
        self._url = urllib.parse.urlunsplit((url.scheme, url.netloc.rpartition("@")[2], url.path or "/", url.query, ""))
        self._queue: deque[pb.Event] = deque()
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._deadline = float("inf")
        self._active: _Connection | None = None
        self._opener = _opener(ssl.create_default_context() if url.scheme == "https" else None, self._track)
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
        retry = Retry(_BACKOFF, attempts=self.config.max_attempts, stop=self._stopping, on_retry=self._count_retry)
        while True:
            if self._past_deadline():
                self._drop("shutdown")
                return
            ok, retryable, why, wait = self._post(body)
            if ok:
                self.sent += 1
                return
            # A stop cuts the backoff short: one last try, if time is left; once stopping, no retries.
            if retryable and not self._stopping.is_set() and (
                    retry.again(at_least=min(wait, BACKOFF_CAP)) or retry.ended == "stopped"):
                continue
            self.failed += 1
            self._warn(f"{event_kind(event)} event of session {event.session!r} not delivered after "
                       f"{retry.attempts_made} attempt(s): {why}")
            return

    def _count_retry(self, error: BaseException | None, delay: float) -> None:
        self.retries += 1

    def _track(self, conn: "_Connection | None") -> None:
        with self._cond:
            self._active = conn

    def _post(self, body: bytes) -> tuple[bool, bool, str, float]:
        """One POST: (delivered, worth retrying, why not, the receiver's Retry-After in seconds)."""
        timeout = min(self.config.timeout, max(0.05, self._deadline - time.monotonic()))
        headers = {"Content-Type": "application/json", "User-Agent": f"twinstep/{__version__}",
                   **self.config.headers}
        request = urllib.request.Request(self._url, data=body, headers=headers, method="POST")
        try:
            with self._opener.open(request, timeout=timeout) as answer:
                answer.read(_MAX_ANSWER)
            return True, False, "", 0.0
        except urllib.error.HTTPError as answer:  # the receiver answered, but not with 2xx
            try:
                text = answer.read(_MAX_ANSWER)
            except (OSError, http.client.HTTPException):
                text = b""
            finally:
                answer.close()
            why = f"HTTP {answer.code}: {text[:200].decode(errors='replace')}"
            retry = answer.code >= 500 or answer.code in (408, 429)
            return False, retry, why, _retry_after(answer.headers.get("Retry-After"))
        except (OSError, http.client.HTTPException) as exc:  # URLError too: no answer (refused, timed out, cut)
            if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, BaseException):
                exc = exc.reason  # what went wrong, as http.client said it
            return False, True, f"{type(exc).__name__}: {exc}", 0.0
        finally:
            self._track(None)

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
            sock = conn.in_use() if conn is not None else None
            if sock is not None:
                try:  # wakes the blocked read; the thread then ends (socket's own shutdown: TLS too)
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
                except OSError:
                    pass
            self._thread.join(0.5)
        return not self._thread.is_alive()


class _Connection(Protocol):
    """What a receiver holds of its request in flight: the socket stop() shuts down to abort it."""

    def in_use(self) -> Any: ...


def _tracked(base: type[http.client.HTTPConnection], track: Callable[[Any], None]) -> Callable[..., Any]:
    """A connection class for urllib that tells ``track`` about each connection it makes."""

    class Tracked(base):  # type: ignore[misc,valid-type]
        _held = None

        def connect(self) -> None:
            super().connect()
            self._held = self.sock  # urllib drops conn.sock once the answer's head is in; its body is read after

        def in_use(self) -> Any:
            return self.sock or self._held  # during connect (a proxy's CONNECT, the TLS handshake): the plain socket

    def make(host: str, **kwargs: Any) -> Any:
        conn = Tracked(host, **kwargs)
        track(conn)
        return conn

    return make


def _opener(context: ssl.SSLContext | None, track: Callable[[Any], None]) -> urllib.request.OpenerDirector:
    """urllib with the proxy variables (read now), no redirects followed, and abortable connections."""
    http_class, https_class = _tracked(http.client.HTTPConnection, track), _tracked(http.client.HTTPSConnection, track)

    class HTTPHandler(urllib.request.HTTPHandler):
        def http_open(self, req: urllib.request.Request) -> Any:
            return self.do_open(http_class, req)

    class HTTPSHandler(urllib.request.HTTPSHandler):
        def https_open(self, req: urllib.request.Request) -> Any:
            return self.do_open(https_class, req, context=context)

    opener = urllib.request.OpenerDirector()
    for handler in (urllib.request.ProxyHandler(), HTTPHandler(), HTTPSHandler(context=context),
                    urllib.request.HTTPDefaultErrorHandler(), urllib.request.HTTPErrorProcessor()):
        opener.add_handler(handler)
    return opener


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
