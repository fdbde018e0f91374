"""Start a sharded server: the shards (Ray actors, or threads), the coordinator, and the front's gRPC server."""

from __future__ import annotations

import copy
import logging
import tempfile
import threading
from concurrent import futures
from typing import Any

import grpc

from twinstep.server.config import ServerConfig
from twinstep.server.report.render import report_to_dict
from twinstep.server.security import ServerSecurity
from twinstep.server.shards.coordinator import ShardCoordinator
from twinstep.server.shards.front import FrontServicer, ShardChannels, add_front
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep.server")

RUNTIMES = ("ray", "inprocess")


class ShardedServerHandle:
    """A running sharded server: the front's address, merged reports, shard faults on demand, a bounded stop."""

    def __init__(self, server: grpc.Server, port: int, host: str, shards: Any, coordinator: ShardCoordinator,
                 channels: ShardChannels, stopping: threading.Event, tls: bool, journal: str,
                 owned_journal: tempfile.TemporaryDirectory | None) -> None:
        self._server = server
        self.port = port
        self.host = host
        self.shards = shards
        self.coordinator = coordinator
        self.tls = tls
        self.journal = journal
        """The shards' journals: JOURNAL/shard-I (a temporary folder unless journal.directory was set)."""
        self._channels = channels
        self._stopping = stopping
        self._owned_journal = owned_journal
        self.servicer: FrontServicer | None = None
        self.webhooks: Any = None
        """The webhook senders (config.alerts), fed from the coordinator's view of each session."""

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "[::]", "::", "") else self.host
        return f"{host}:{self.port}"

    def shard_addresses(self) -> list[str]:
        return list(self.coordinator.addresses)

    def report_proto(self, session: str) -> pb.Report:
        report = self.coordinator.report(session)
        if report is None:
            raise KeyError(f"no session {session!r}")
        return report

    def report(self, session: str) -> dict[str, Any]:
        """The JSON form of a session's report, merged over every shard (KeyError: no such session)."""
        return report_to_dict(self.report_proto(session))

    def halt(self, session: str, reason: str = "halted by an operator") -> list[str]:
        return self.coordinator.halt(session, reason)

    def restart_coordinator(self) -> None:
        """A new coordinator over the same shards, as a front restarted on a Ray cluster starts: it knows
        nothing but what the shards tell it (tests: the report after it equals the one before)."""
        old = self.coordinator
        old.stop()
        self.coordinator = ShardCoordinator(self.shards, old.config, old.key)
        if self.webhooks is not None:
            self.coordinator.add_listener(self.webhooks.offer)
        self.coordinator.start()
        if self.servicer is not None:
            self.servicer.coordinator = self.coordinator

    def kill_shard(self, index: int) -> None:
        """Kill shard ``index``'s process (Ray restarts it; in-process, it is started again from its journal)."""
        self.shards.kill(index)

    def stop(self, grace: float = 2.0) -> None:
        self._stopping.set()
        self._server.stop(grace).wait(grace + 1.0)
        self.coordinator.stop()
        if self.webhooks is not None:
            self.webhooks.stop(timeout=grace)
        self._channels.close()
        self.shards.stop(grace)
        if self._owned_journal is not None:
            self._owned_journal.cleanup()

    def wait(self) -> None:
        self._server.wait_for_termination()


def serve_sharded(port: int = 0, host: str = "127.0.0.1", config: ServerConfig | None = None, *,
                  shards: int | None = None, runtime: str = "ray", security: ServerSecurity | None = None,
                  insecure: bool | None = None) -> ShardedServerHandle:
    """Start the front on ``host:port`` and ``shards`` comparator shards (default ``config.sharding.shards``).

    ``runtime="ray"`` runs each shard in a Ray actor (a local instance, or ``config.sharding.ray_address``);
    ``"inprocess"`` runs them in this process (the same code, no Ray: tests).  The shards listen on
    ``host`` too, with the same TLS and tokens.  Without ``config.journal.directory`` the shards journal
    to a temporary folder, so that a shard that dies comes back with its sessions.
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime {runtime!r}: one of {', '.join(RUNTIMES)}")
    config = copy.deepcopy(config or ServerConfig())
    count = config.sharding.shards if shards is None else shards
    if count < 1:
        raise ValueError("a sharded server needs at least one shard (sharding.shards)")
    config.sharding.shards = count
    security = security or config.security.build(host)
    if insecure is not None:
        security.insecure = insecure
    security.check_exposure(host)
    started_ray = False
    if runtime == "ray":  # before gRPC runs anything in this process (runtime.start_ray)
        from twinstep.server.extras import RAY, require
        from twinstep.server.shards.runtime import start_ray

        require(RAY, "a sharded server (--shards)")
        started_ray = start_ray(config.sharding.ray_address, config.sharding.ray_cpus, count)
    try:
        return _start(port, host, config, count, runtime, security, started_ray)
    except BaseException:
        if started_ray:  # the local instance goes with the server that could not start
            import ray

            ray.shutdown()
        raise


def _start(port: int, host: str, config: ServerConfig, count: int, runtime: str, security: ServerSecurity,
           started_ray: bool) -> ShardedServerHandle:
    credentials = security.credentials()
    owned = None
    if not config.journal.directory:
        owned = tempfile.TemporaryDirectory(prefix="twinstep-shards-")
        config.journal.directory = owned.name
    stopping = threading.Event()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.limits.max_workers, thread_name_prefix="twinstep-front"),
        maximum_concurrent_rpcs=config.limits.max_workers,
        options=[("grpc.max_receive_message_length", config.limits.max_message_bytes),
                 ("grpc.max_send_message_length", 64 << 20),
                 ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                 ("grpc.keepalive_permit_without_calls", 1)],
    )
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    bound = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    front_host = "127.0.0.1" if host in ("0.0.0.0", "[::]", "::", "") else host
    front = f"{front_host}:{bound}"
    key = config.sharding.key
    if runtime == "ray":
        from twinstep.server.shards.runtime import RayShards

        shard_set: Any = RayShards(count, key, front, config, host, security, config.sharding.ray_address,
                                   started_ray)
    else:
        from twinstep.server.shards.runtime import InProcessShards

        shard_set = InProcessShards(count, key, front, config, host, security)
    coordinator = ShardCoordinator(shard_set, config, key)
    channel_credentials = None
    if credentials is not None:
        with open(security.tls_cert or "", "rb") as cert:
            channel_credentials = grpc.ssl_channel_credentials(root_certificates=cert.read())
    channels = ShardChannels(channel_credentials)
    try:
        coordinator.start()
        servicer = FrontServicer(coordinator, security.authorizer(), channels, stopping)
        add_front(servicer, server)
        server.start()
    except BaseException:
        server.stop(0)
        shard_set.stop(0.5)
        raise
    receivers = config.alerts.receivers()
    webhooks = None
    if receivers:  # from the session's view over every shard: each event once
        from twinstep.server.alert.webhooks import WebhookDispatcher

        webhooks = WebhookDispatcher(receivers, server=front)
        coordinator.add_listener(webhooks.offer)
    logger.info("twinstep sharded server: front on %s:%d, %d shard(s) by %s (%s)", host, bound, count, key, runtime)
    handle = ShardedServerHandle(server, bound, host, shard_set, coordinator, channels, stopping,
                                 tls=credentials is not None, journal=config.journal.directory, owned_journal=owned)
    handle.servicer = servicer
    handle.webhooks = webhooks
    return handle


__all__ = ["RUNTIMES", "ShardedServerHandle", "serve_sharded"]
