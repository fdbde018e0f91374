"""The sharded server's shards as Ray actors: the settings that start Ray, and a shard that Ray restarts.

Real Ray (a local instance, or a cluster started with `ray start`), real gRPC,
raw multi-rank streams.  Real training jobs against shards on Ray are in
test_sharded_server.py.  Runs in the one leg that installs the `ray` extra.
"""

from __future__ import annotations

import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import pytest

ray = pytest.importorskip("ray")

import grpc  # noqa: E402

from tests.conftest import serve_process, wait_for  # noqa: E402
from tests.integration.test_sharded_sessions import _session  # noqa: E402
from twinstep.server.config import ServerConfig  # noqa: E402
from twinstep.server.shards import serve_sharded  # noqa: E402
from twinstep.v1 import twinstep_pb2 as pb  # noqa: E402
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_local_ray_instance_declares_the_cpus_asked_and_a_killed_shard_comes_back() -> None:
    config = ServerConfig()
    config.sharding.ray_cpus = 3
    config.sharding.poll_interval = 0.1
    handle = serve_sharded(port=0, config=config, shards=2, runtime="ray")
    try:
        assert ray.cluster_resources()["CPU"] == 3
        ranks = _session(handle.address, "ray-kill")
        for stream in ranks.values():
            stream.steps(range(3))
        wait_for(lambda: handle.report("ray-kill")["steps_compared"] == 3, timeout=60)
        before = handle.report("ray-kill")
        address, pid = handle.shard_addresses()[1], handle.coordinator.pids[1]
        handle.kill_shard(1)
        wait_for(lambda: handle.coordinator.pids[1] not in (0, pid), timeout=90)  # Ray restarted the actor
        assert handle.shard_addresses()[1] == address  # on its port again: clients reconnect where they were
        after = handle.report("ray-kill")
        assert after["steps_compared"] == before["steps_compared"]
        assert [r["records_received"] for r in after["runs"]] == [r["records_received"] for r in before["runs"]]
    finally:
        handle.stop(1.0)
    assert not ray.is_initialized()  # the local instance went with the server


_CLUSTER = """
import sys
import ray
ray.init(num_cpus=2, include_dashboard=False, _temp_dir=sys.argv[1])
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()  # until the test closes it: the instance ends with this process
"""


def _report(address: str, session: str) -> pb.Report:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.TwinstepStub(channel).GetReport(pb.ReportRequest(session=session), timeout=60)


def test_shards_start_on_a_running_ray_cluster_and_outlive_a_front_that_dies(monkeypatch) -> None:
    """--ray-address: the shards go to a Ray instance another process keeps.  The front (`twinstep serve`, the
    coordinator) is killed with SIGKILL; one started again on its port finds the same shards, and the report is
    the one before: the coordinator held nothing the shards do not."""
    temp = tempfile.mkdtemp(prefix="tsray", dir="/tmp")  # Ray's socket paths must stay short
    # The cluster's token, given to the front as Ray reads it (not ~/.ray/auth_token, which another local
    # Ray instance on this machine may rewrite meanwhile).
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    cluster = subprocess.Popen([sys.executable, "-c", _CLUSTER, temp], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    front = None
    try:
        gcs = cluster.stdout.readline().strip()
        assert gcs, "the Ray instance did not start"
        port = _free_port()
        args = ("--shards", "2", "--ray-address", gcs, "--shard-poll", "0.1", "--port", str(port))
        front, address = serve_process(*args)
        ranks = _session(address, "cluster")
        for (run, rank), stream in ranks.items():
            stream.steps(range(3), {2: 0.5} if (run, rank) == ("cand", 1) else None)
        wait_for(lambda: _report(address, "cluster").status == "diverged", timeout=90)
        before = _report(address, "cluster")
        front.kill()  # no goodbye: the detached shards stay on the cluster
        front.wait(30)
        front, again = serve_process(*args)
        assert again.endswith(f":{port}")
        wait_for(lambda: _report(again, "cluster").status == "diverged", timeout=90)
        after = _report(again, "cluster")
        assert after.first_divergence == before.first_divergence and after.first_divergence.rank == 1
        assert after.steps_compared == before.steps_compared == 3
        assert [(r.name, r.records_received) for r in after.runs] == [(r.name, r.records_received) for r in before.runs]
    finally:
        if front is not None:
            front.send_signal(signal.SIGINT)  # a clean stop ends the shards too
            front.wait(60)
        cluster.stdin.close()
        cluster.wait(60)
        shutil.rmtree(temp, ignore_errors=True)
