"""A real TCP proxy on loopback that injects network faults between a training job and a twinstep server.

Sockets and threads, no mocks: a job pointed at ``proxy.address`` speaks real
gRPC over real TCP, and the proxy forwards the bytes to the server, unless
told otherwise:

- ``cut()`` closes every current connection, both directions at once (what a
  dropped link or a restarted load balancer does); ``cut(refuse_for=N)`` also
  resets new connections for N seconds, or until ``accept()`` (the server looks down).
- ``set_delay(seconds, direction)`` delays every byte by that much, keeping
  their order (a slow or distant link).
- ``hold()`` buffers the client-to-server bytes of every connection (current
  and new) and ``release()`` lets them go, in order: with one proxy per run,
  one run's steps then reach the server after the other run's later ones.

Each direction of each connection has one reader and one writer thread and a
buffer of at most ``max_buffer_bytes``; past it the reader stops reading, so
the sender is slowed by TCP itself rather than the proxy growing.  Threads are
daemons, and ``close()`` (or leaving the ``with`` block) ends them all.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator

UP, DOWN = "up", "down"
"""Directions: client to server (a job's steps), server to client (credits, acknowledgements, commands)."""
_DIRECTIONS = {"up": (UP,), "down": (DOWN,), "both": (UP, DOWN)}
_CHUNK = 64 << 10
_POLL = 0.05


@dataclass
class ProxyStats:
    """What the proxy did; read with the proxy's lock held or after it closed."""

    accepted: int = 0
    refused: int = 0
    cut: int = 0
    """Connections closed by cut()."""
    bytes_up: int = 0
    bytes_down: int = 0
    max_wait: float = 0.0
    """The longest any bytes waited in the proxy (held or delayed) before they were written on, in seconds."""


def _parse(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class _Pipe:
    """One direction of one connection: a reader filling a bounded buffer, a writer draining it."""

    def __init__(self, proxy: "TcpProxy", link: "_Link", direction: str, src: socket.socket,
                 dst: socket.socket) -> None:
        self.proxy, self.link, self.direction, self.src, self.dst = proxy, link, direction, src, dst
        self.chunks: deque[tuple[float, bytes]] = deque()  # (arrival time, bytes), oldest first
        self.nbytes = 0
        self.eof = False
        name = f"tcp-proxy-{link.number}-{direction}"
        self.threads = [threading.Thread(target=self._read, name=f"{name}-read", daemon=True),
                        threading.Thread(target=self._write, name=f"{name}-write", daemon=True)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def _read(self) -> None:
        cond = self.proxy._cond
        try:
            while True:
                with cond:
                    while self.nbytes >= self.proxy.max_buffer_bytes and not self.link.closed:
                        cond.wait(_POLL)  # full: stop reading, so TCP slows the sender
                    if self.link.closed:
                        return
                data = self.src.recv(_CHUNK)
                with cond:
                    if not data:
                        self.eof = True
                    else:
                        self.chunks.append((time.monotonic(), data))
                        self.nbytes += len(data)
                    cond.notify_all()
                if not data:
                    return
        except OSError:
            self.link.close()

    def _write(self) -> None:
        proxy, cond = self.proxy, self.proxy._cond
        try:
            while True:
                with cond:
                    data = self._next_locked()
                if data is None:
                    return  # the link was closed
                if not data:  # end of stream, everything before it delivered: pass the half-close on
                    try:
                        self.dst.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    with cond:
                        self.link.half_closed += 1
                        both = self.link.half_closed == 2
                    if both:
                        self.link.close()
                    return
                self.dst.sendall(data)  # outside the lock: may block on a slow reader, which is the point
                with cond:
                    self.nbytes -= len(data)
                    if self.direction == UP:
                        proxy.stats.bytes_up += len(data)
                    else:
                        proxy.stats.bytes_down += len(data)
                    cond.notify_all()
        except OSError:
            self.link.close()

    def _next_locked(self) -> bytes | None:
        """The next bytes due (b"": end of stream; None: the link closed), waiting for them; lock held."""
        proxy = self.proxy
        while not self.link.closed:
            if self.chunks:
                arrived, data = self.chunks[0]
                wait = arrived + proxy._delay[self.direction] - time.monotonic()
                if self.direction in proxy._held:
                    proxy._cond.wait(_POLL)
                elif wait > 0:
                    proxy._cond.wait(min(wait, _POLL))
                else:
                    self.chunks.popleft()
                    proxy.stats.max_wait = max(proxy.stats.max_wait, time.monotonic() - arrived)
                    return data
            elif self.eof:
                return b""
            else:
                proxy._cond.wait(_POLL)
        return None


class _Link:
    """One proxied connection: the client's socket, the server's, and a pipe each way."""

    def __init__(self, proxy: "TcpProxy", number: int, client: socket.socket, server: socket.socket) -> None:
        self.proxy, self.number, self.client, self.server = proxy, number, client, server
        self.closed = False
        self.half_closed = 0
        self.pipes = (_Pipe(proxy, self, UP, client, server), _Pipe(proxy, self, DOWN, server, client))

    def close(self) -> None:
        """Close both sockets now; bytes still buffered are lost, as on a broken link."""
        with self.proxy._cond:
            if self.closed:
                return
            self.closed = True
            self.proxy._links.discard(self)
            self.proxy._cond.notify_all()
        for sock in (self.client, self.server):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def threads(self) -> Iterator[threading.Thread]:
        for pipe in self.pipes:
            yield from pipe.threads


class TcpProxy:
    """Listens on a free loopback port and forwards each connection to ``upstream`` (host:port)."""

    def __init__(self, upstream: str, *, max_buffer_bytes: int = 32 << 20, max_connections: int = 16) -> None:
        self.upstream = _parse(upstream)
        self.max_buffer_bytes = max_buffer_bytes
        """Bytes buffered per direction of a connection (held or delayed); past it reading stops."""
        self.max_connections = max_connections
        """Open connections at once; more are reset (a job has one, a watcher one more)."""
        self.stats = ProxyStats()
        self._cond = threading.Condition()
        self._links: set[_Link] = set()
        self._threads: list[threading.Thread] = []
        self._delay = {UP: 0.0, DOWN: 0.0}
        self._held: set[str] = set()
        self._refuse_until = 0.0
        self._closed = False
        self._count = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL * 4)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._acceptor = threading.Thread(target=self._accept, name="tcp-proxy-accept", daemon=True)
        self._acceptor.start()

    # -- controls --------------------------------------------------------------------------------

    def cut(self, refuse_for: float = 0.0) -> int:
        """Close every current connection, both directions; reset new ones for ``refuse_for`` s.

        Returns how many connections were closed.
        """
        with self._cond:
            if refuse_for > 0:
                self._refuse_until = max(self._refuse_until, time.monotonic() + refuse_for)
            links = list(self._links)
            self.stats.cut += len(links)
        for link in links:
            link.close()
        return len(links)

    def accept(self) -> None:
        """Accept new connections again now, ending a refusal cut() started."""
        with self._cond:
            self._refuse_until = 0.0

    def set_delay(self, seconds: float, direction: str = "both") -> None:
        """Delay bytes by ``seconds`` in ``direction`` ("up": client to server, "down", "both"); order is kept."""
        if seconds < 0:
            raise ValueError("a delay cannot be negative")
        with self._cond:
            for d in _DIRECTIONS[direction]:
                self._delay[d] = float(seconds)
            self._cond.notify_all()

    def hold(self, direction: str = "up") -> None:
        """Buffer the bytes of ``direction`` on every connection (and new ones) until release()."""
        with self._cond:
            self._held.update(_DIRECTIONS[direction])
            self._cond.notify_all()

    def release(self, direction: str = "both") -> None:
        """Let held bytes go, in the order they came."""
        with self._cond:
            self._held.difference_update(_DIRECTIONS[direction])
            self._cond.notify_all()

    def buffered_bytes(self, direction: str = "both") -> int:
        """Bytes read from one side and not yet written to the other (held or delayed)."""
        wanted = _DIRECTIONS[direction]
        with self._cond:
            return sum(p.nbytes for link in self._links for p in link.pipes if p.direction in wanted)

    @property
    def connections(self) -> int:
        with self._cond:
            return len(self._links)

    def close(self) -> None:
        """Stop listening, close every connection, end every thread (bounded)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._held.clear()
            self._cond.notify_all()
        self._acceptor.join(2.0)
        self._listener.close()
        self.cut()
        with self._cond:
            threads = list(self._threads)
        deadline = time.monotonic() + 5.0
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> "TcpProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- threads ---------------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            with self._cond:
                refuse = (self._closed or time.monotonic() < self._refuse_until
                          or len(self._links) >= self.max_connections)
                if refuse:
                    self.stats.refused += 1
            if refuse:
                _reset(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5.0)
                server.settimeout(None)
            except OSError:
                _reset(client)
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._cond:
                self._count += 1
                link = _Link(self, self._count, client, server)
                self._links.add(link)
                self.stats.accepted += 1
                # Finished threads are forgotten, so a long test with many cuts stays bounded.
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.extend(link.threads())
            for pipe in link.pipes:
                pipe.start()


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0): the client sees its connection refused or reset at once."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()
