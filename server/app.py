"""Start the comparison server, standalone or embedded (``twinstep.server.serve``)."""

from __future__ import annotations

import logging
import threading
from concurrent import futures
from typing import Any

import grpc

from twinstep.server.alert.webhooks import WebhookDispatcher
from twinstep.server.compare.comparator import StepComparison
from twinstep.server.config import ServerConfig
from twinstep.server.extras import DASHBOARD, require
from twinstep.server.report.builder import build_report
from twinstep.server.report.render import report_to_dict
from twinstep.server.security import ServerSecurity
from twinstep.server.servicer import TwinstepServicer, add_servicer
from twinstep.server.registry import SessionRegistry
from twinstep.server.shards.ownership import WHOLE, RankShare
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep.server")


class ServerHandle:
    """A running server: its address, reports, and a bounded stop."""

    def __init__(self, server: grpc.Server, port: int, host: str, registry: SessionRegistry, stopping: threading.Event,
                 tls: bool = False) -> None:
        self._server = server
        self._stopping = stopping
        self.port = port
        self.host = host
        self.registry = registry
        self.tls = tls
        """Connections are TLS (clients need to trust the certificate: TWINSTEP_TLS_CA)."""
        self.webhooks: WebhookDispatcher | None = None
        """The webhook senders (config.alerts), once started; stopped within the grace by stop()."""
        self.dashboard: Any = None
        """The dashboard's HTTP listener (twinstep.server.view.listener), when serve() was given http_port."""
        self.recording: Any = None
        """Recording and replay (twinstep.server.record.service), when config.recording.directory or config.recording.replay asks."""

    @property
    def http_port(self) -> int | None:
        """The dashboard's port (the one picked for http_port=0); None without a dashboard."""
        return self.dashboard.port if self.dashboard is not None else None

    @property
    def http_url(self) -> str | None:
        """Where a browser opens the dashboard, e.g. http://127.0.0.1:8080/; None without one."""
        return self.dashboard.url if self.dashboard is not None else None

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "[::]", "::", "") else self.host
        return f"{host}:{self.port}"

    def report(self, session: str) -> dict[str, Any]:
        """The JSON form of a session's report (KeyError if there is no such session)."""
        return report_to_dict(self.report_proto(session))

    def report_proto(self, session: str) -> pb.Report:
        found = self.registry.get(session)
        if found is None:
            archived = self.registry.archived_report(session)
            if archived is not None:
                return archived
            raise KeyError(f"no session {session!r}")
        return build_report(found.snapshot())

    def last_comparison(self, session: str) -> StepComparison | None:
        """The latest candidate step compared in a session, with every metric per row (``values``).

        The report keeps only each record's worst metric; tools and tests that need
        one metric of one row (e.g. a fused group's full-tensor rel_l2) read it here.
        """
        found = self.registry.get(session)
        if found is None:
            raise KeyError(f"no session {session!r}")
        return found.latest_comparison()

    def halt(self, session: str, reason: str = "halted by an operator") -> list[str]:
        found = self.registry.get(session)
        return found.halt(reason) if found else []

    def stop(self, grace: float = 2.0) -> None:
        """Refuse new RPCs now, let running ones end within ``grace`` seconds."""
        self._stopping.set()
        if self.dashboard is not None:  # pages first: they only read, and they go within the grace
            self.dashboard.stop(timeout=min(grace, 1.0))
        if self.recording is not None:
            self.recording.stop_players(timeout=min(grace, 1.0))
        self.registry.freeze()  # nothing more is accepted than the journal holds
        for name in self.registry.names():
            session = self.registry.get(name)
            if session is not None:
                session.events.close()
        self._server.stop(grace).wait(grace + 1.0)
        if self.webhooks is not None:
            self.webhooks.stop(timeout=grace)  # what is queued goes out within the grace, then gives up
        if self.recording is not None:
            self.recording.stop(grace)  # recordings end with every input the sessions took
        self.registry.close()

    def wait(self) -> None:
        self._server.wait_for_termination()


def serve(
    port: int = 0,
    host: str = "127.0.0.1",
    config: ServerConfig | None = None,
    halt_on_divergence: bool | None = None,
    *,
    security: ServerSecurity | None = None,
    insecure: bool | None = None,
    http_port: int | None = None,
    http_host: str | None = None,
    share: RankShare = WHOLE,
) -> ServerHandle:
    """Start a server in this process; ``port=0`` picks a free port (see ``.address``).

    ``security`` holds TLS files and tokens (twinstep.server.security); without
    it, ``config.security`` (by default the server is plaintext and open, which the
    loopback rule allows only on a loopback ``host`` unless ``insecure=True``).
    ValueError when the rule or a file says no.

    ``share``: the ranks this server compares (one shard's, twinstep.server.shards; default all).

    ``http_port`` (default ``config.dashboard.port``) also serves the live dashboard
    and /metrics over HTTP (HTTPS with TLS) on ``http_host`` (default
    ``config.dashboard.host``, else ``host``; 0 picks a free port: ``.http_url``),
    under the same rule and tokens (docs/dashboard.md).
    """
    config = config or ServerConfig()
    security = security or config.security.build(host)
    http_port = config.dashboard.port if http_port is None else http_port
    http_host = config.dashboard.host if http_host is None else http_host
    if insecure is not None:
        security.insecure = insecure
    security.check_exposure(host)
    if http_port is not None:
        security.check_exposure(host if http_host is None else http_host)
        # Before anything starts: the gRPC side needs the core dependencies only, the HTTP side the server extra.
        require(DASHBOARD, "the dashboard and /metrics (--http-port)")
    credentials = security.credentials()
    if halt_on_divergence is not None:
        config.halt.on_divergence = halt_on_divergence
    registry = SessionRegistry(config, share)
    stopping = threading.Event()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.limits.max_workers, thread_name_prefix="twinstep-rpc"),
        # Each stream and watcher holds a worker; refuse beyond that instead of queueing forever.
        maximum_concurrent_rpcs=config.limits.max_workers,
        options=[
            ("grpc.max_receive_message_length", config.limits.max_message_bytes),
            ("grpc.max_send_message_length", 64 << 20),
            # Allow clients' 20 s keepalive pings on idle streams.
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
        ],
    )
    add_servicer(TwinstepServicer(registry, stopping, security.authorizer()), server)
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    if credentials is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    handle = ServerHandle(server, bound, host, registry, stopping, tls=credentials is not None)
    receivers = config.alerts.receivers()
    if receivers:  # before the first stream: every session's events reach them
        handle.webhooks = WebhookDispatcher(receivers, server=handle.address)
        registry.add_session_listener(handle.webhooks.attach)
        logger.info("webhooks: %s", ", ".join(f"{w.label} ({w.format})" for w in receivers))
    if config.recording.directory or config.recording.replay:  # before the first stream: every session is recorded
        from twinstep.server.record.service import start as start_recording

        try:
            handle.recording = start_recording(registry, config)
        except BaseException:
            handle.stop(grace=0.5)
            raise
    server.start()
    logger.info("twinstep server listening on %s:%d (%s%s)", host, bound, "TLS" if credentials else "plaintext",
                ", client certificates required" if security.tls_client_ca else "")
    if http_port is not None:
        from twinstep.server.view.listener import start_dashboard  # starlette and uvicorn load only here

        try:
            handle.dashboard = start_dashboard(registry, security, host if http_host is None else http_host,
                                               http_port, handle.webhooks)
        except BaseException:
            handle.stop(grace=0.5)
            raise
    return handle
