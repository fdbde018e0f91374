"""Where the shards run: Ray actors (what users start), or threads of this process (tests, every leg).

Both give the coordinator the same calls, each one per shard and batched
(a poll carries every session's digest and the events since the last one);
nothing per record crosses between processes.  A Ray shard is a named,
restartable actor: Ray restarts it after a crash and its journal restores it,
on the port it had when that port is free, so its clients reconnect to the
same address (or come back through the front when it moved).  Calls to a shard
are bounded: one poll in flight per shard at a time, and Ray's own bound on
pending calls (``max_pending_calls``) behind it.
"""

from __future__ import annotations

import logging
import os
import pathlib
import threading
import time
from typing import Any, Callable

from twinstep.server.config import ServerConfig
from twinstep.server.security import ServerSecurity
from twinstep.server.shards.ownership import RankShare
from twinstep.server.shards.shard import ShardServer

logger = logging.getLogger("twinstep.server")

NAMESPACE = "twinstep"
#: Pending calls a shard's handle allows before Ray refuses more (PendingCallsLimitExceeded).
MAX_PENDING_CALLS = 16


def _port_file(config: ServerConfig, index: int) -> pathlib.Path | None:
    if not config.journal.directory:
        return None
    return pathlib.Path(config.journal.directory) / f"shard-{index}.port"


def start_shard(share: RankShare, config: ServerConfig, host: str, security: ServerSecurity | None) -> ShardServer:
    """A shard's server on the port it had before (a restart), else a free one; the port is remembered."""
    remembered = _port_file(config, share.index)
    port = 0
    if remembered is not None and remembered.exists():
        try:
            port = int(remembered.read_text().strip() or 0)
        except ValueError:
            port = 0
    try:
        shard = ShardServer(share, config, host, port, security)
    except OSError:
        if port == 0:
            raise
        shard = ShardServer(share, config, host, 0, security)  # the old port is taken: the front redirects
    if remembered is not None:
        remembered.parent.mkdir(parents=True, exist_ok=True)
        remembered.write_text(str(shard.handle.port))
    return shard


class InProcessShards:
    """The shards as servers in this process: the same code paths as on Ray, for tests and small set-ups."""

    runtime = "inprocess"

    def __init__(self, count: int, key: str, front: str, config: ServerConfig, host: str,
                 security: ServerSecurity | None) -> None:
        self.count = count
        self._args = (config, host, security)
        self._shares = [RankShare(i, count, key, front) for i in range(count)]
        self._servers: list[ShardServer | None] = [start_shard(share, *self._args) for share in self._shares]
        self._lock = threading.Lock()

    def _call(self, index: int, call: Callable[[ShardServer], Any]) -> Any:
        server = self._servers[index]
        return None if server is None else call(server)

    waits = False
    """Polls return at once: the coordinator paces them itself."""

    def poll(self, afters: list[int], seen: list[int], wait: float, timeout: float) -> list[dict | None]:
        return [self._call(i, lambda s, a=after: s.poll(a)) for i, after in enumerate(afters)]

    def each(self, call: Callable[[ShardServer], Any], timeout: float) -> list[Any]:
        return [self._call(i, call) for i in range(self.count)]

    def one(self, index: int, call: Callable[[ShardServer], Any], timeout: float) -> Any:
        return self._call(index, call)

    def kill(self, index: int) -> None:
        """Stop shard ``index`` at once and start it again from its journal (what Ray does after a crash)."""
        with self._lock:
            server = self._servers[index]
            self._servers[index] = None
            if server is not None:
                server.stop(grace=0.0)
            self._servers[index] = start_shard(self._shares[index], *self._args)

    def stop(self, grace: float) -> None:
        for server in self._servers:
            if server is not None:
                server.stop(grace)


def start_ray(address: str | None, cpus: int, shards: int) -> bool:
    """Connect to ``address``'s Ray cluster, or start a local instance; True when this started one.

    Called before anything of gRPC runs in this process: Ray starts its processes with a hook that runs in the
    forked child, and a fork while gRPC's threads hold their locks can abort that child (seen as Ray's
    start-up timing out, its dashboard process killed by SIGABRT).
    """
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no telemetry from a comparison server
    if address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        return False
    ray.init(num_cpus=cpus or max(os.cpu_count() or 1, shards), include_dashboard=False, namespace=NAMESPACE,
             log_to_driver=False)
    return True


class RayShards:
    """The shards as named Ray actors, restarted by Ray (Ray started first: start_ray)."""

    runtime = "ray"

    def __init__(self, count: int, key: str, front: str, config: ServerConfig, host: str,
                 security: ServerSecurity | None, address: str | None = None, started_ray: bool = False) -> None:
        import ray

        self._ray = ray
        self.count = count
        self.started_ray = started_ray
        actor = ray.remote(_ShardActor).options  # the class stays importable without Ray
        # On a cluster of its own the shards outlive a front that dies: named for the server's port, detached,
        # and found again by the next front on that port (its coordinator rebuilds its view from them).  A
        # local instance ends with the front, and the shards with it.
        self.detached = bool(address)
        self._actors = []
        for index in range(count):
            share = RankShare(index, count, key, front)
            name = (f"twinstep-{front}-shard-{index}-of-{count}" if self.detached
                    else f"twinstep-shard-{index}-{os.getpid()}")
            handle = actor(name=name, namespace=NAMESPACE, max_restarts=-1, max_task_retries=3, max_concurrency=8,
                           max_pending_calls=MAX_PENDING_CALLS, num_cpus=1,
                           lifetime="detached" if self.detached else None,
                           get_if_exists=self.detached).remote(share, config, host, security)
            self._actors.append(handle)
        self._inflight: dict[int, Any] = {}
        ray.get([handle.info.remote() for handle in self._actors], timeout=120)  # started, and listening

    waits = True
    """A poll waits on the shard for a change (up to ``wait``): the coordinator hears of a divergence at once."""

    def poll(self, afters: list[int], seen: list[int], wait: float, timeout: float) -> list[dict | None]:
        """One poll per shard, each returning on a change or after ``wait``; those answered within ``timeout``
        (at least one, unless none is), None for the others.  A shard whose poll is still out is not asked
        again: calls never pile up on a slow shard."""
        ray = self._ray
        for index, after in enumerate(afters):
            if index not in self._inflight:
                self._inflight[index] = self._actors[index].poll.remote(after, wait, seen[index])
        refs = list(self._inflight.values())
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:  # and whatever else has come in meanwhile
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        ready_set = set(ready)
        out: list[dict | None] = [None] * self.count
        for index, ref in list(self._inflight.items()):
            if ref in ready_set:
                del self._inflight[index]
                try:
                    out[index] = ray.get(ref)
                except Exception as error:  # the actor died: Ray restarts it, the next poll finds it
                    logger.warning("twinstep shard %d: poll failed (%s); it is being restarted", index,
                                   type(error).__name__)
        return out

    def each(self, call: Callable[[ShardServer], Any], timeout: float) -> list[Any]:
        refs = [actor.call.remote(call) for actor in self._actors]
        out = []
        for ref in refs:
            try:
                out.append(self._ray.get(ref, timeout=timeout))
            except Exception as error:
                logger.warning("twinstep shard call failed: %s", error)
                out.append(None)
        return out

    def one(self, index: int, call: Callable[[ShardServer], Any], timeout: float) -> Any:
        return self._ray.get(self._actors[index].call.remote(call), timeout=timeout)

    def kill(self, index: int) -> None:
        """Kill the actor's process; Ray restarts it (max_restarts) and its journal restores it."""
        self._ray.kill(self._actors[index], no_restart=False)

    def stop(self, grace: float) -> None:
        ray = self._ray
        try:
            ray.get([actor.call.remote(lambda s: s.stop(grace)) for actor in self._actors], timeout=grace + 5)
        except Exception:
            pass
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        if self.started_ray:
            ray.shutdown()


class _ShardActor:
    """The body of a Ray shard: a ShardServer, and one generic call the coordinator batches into."""

    def __init__(self, share: RankShare, config: ServerConfig, host: str, security: ServerSecurity | None) -> None:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        if not config.memory.release_freed:
            from twinstep.server.memory import retain_freed_memory

            retain_freed_memory()  # this process is the shard's own, as `twinstep serve`'s is the server's
        self.server = start_shard(share, config, host, security)

    def info(self) -> dict[str, Any]:
        return self.server.info()

    def poll(self, after: int, wait: float = 0.0, seen: int = -1) -> dict[str, Any]:
        return self.server.poll(after, wait, seen)

    def call(self, call: Callable[[ShardServer], Any]) -> Any:
        return call(self.server)


def wait_until(condition: Callable[[], bool], timeout: float, every: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    return condition()
