"""Bad input gets a clear status or a reported divergence; the server keeps serving others."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from tests.conftest import wait_for
from tests.integration.rawclient import RawStream, hello, manifest, pieces, step, step_with_pieces
from twinstep.server import ServerConfig
from twinstep.server.config import LimitsConfig
from twinstep.v1 import twinstep_pb2 as pb

X = np.linspace(-1.0, 1.0, 24, dtype=np.float32).reshape(2, 3, 4)


def joined(address: str, session: str, run: str, baseline: bool, framework: str = "torch") -> RawStream:
    stream = RawStream(address).send(hello(session, run, baseline=baseline, framework=framework))
    assert stream.next().WhichOneof("body") == "welcome"
    stream.send(manifest((0, "fc", "Linear"), (1, "act", "GELU")))
    return stream


def run_pair(address: str, session: str, base_records, cand_records, *, payload: bool = False, steps: int = 1) -> dict:
    """Baseline and candidate each send `steps` steps (with their tensors as pieces if ``payload``) and close;
    returns nothing (query the report)."""
    base = joined(address, session, "base", True)
    cand = joined(address, session, "cand", False, framework="paddle")
    for s in range(steps):
        for stream, records in ((base, base_records), (cand, cand_records)):
            for message in step_with_pieces(s, records) if payload else [step(s, records)]:
                stream.send(message)
    for stream in (base, cand):
        stream.send(pb.ClientMessage(close=pb.Close(reason="finished", last_step=steps - 1)))
        stream.close()
        stream.wait_end()


def assert_serving(server, name: str = "healthy") -> None:
    """A well-behaved session on the same server still works end to end."""
    run_pair(server.address, name, [(0, X), (1, X * 2)], [(0, X), (1, X * 2)], steps=2)
    report = wait_for(lambda: (r := server.report(name))["status"] == "aligned" and r)
    assert report["steps_compared"] == 2


def test_unknown_precision_is_refused(server):
    message = hello("s", "r")
    message.hello.precision = "fp8"
    error = RawStream(server.address).send(message).error()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown precision 'fp8'" in error.details()
    assert_serving(server)


@pytest.mark.parametrize("version", [1, 2, 99], ids=["inline-tensors", "before-v3", "unknown"])
def test_unsupported_protocol_version_is_refused(server, version):
    error = RawStream(server.address).send(hello("s", "r", version=version)).error()
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"protocol version {version}; this server speaks 3" in error.details()
    assert_serving(server)


def test_first_message_must_be_hello(server):
    error = RawStream(server.address).send(manifest((0, "fc", "Linear"))).error()
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "first message must be hello" in error.details()


def test_second_hello_on_a_stream_is_refused(server):
    stream = joined(server.address, "twice", "base", True)
    error = stream.send(hello("twice", "base", baseline=True)).error()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("payload", [b"\x0a\xff\xff\xff\xff\xff", b"\x1a\x05\x08\x01"], ids=["garbage", "truncated"])
def test_malformed_and_truncated_messages(server, payload):
    error = RawStream(server.address, serializer=lambda raw: raw).send(payload).error()
    assert error.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
    assert_serving(server)


def test_record_naming_a_module_absent_from_the_manifest(server):
    stream = joined(server.address, "absent", "base", True)
    error = stream.send(step(0, [(7, X)])).error()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "module id 7, absent from the manifest" in error.details()
    assert_serving(server)


def test_a_step_without_m2_is_refused(server):
    stream = joined(server.address, "no-m2", "base", True)
    old = step(0, [(0, X)])
    del old.step.stats.m2[:]  # as a client from before m2 sent it
    error = stream.send(old).error()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "step 0: missing m2" in error.details()
    assert_serving(server)


def test_second_baseline_in_a_session(server):
    joined(server.address, "two-bases", "first", True)
    error = RawStream(server.address).send(hello("two-bases", "second", baseline=True)).error()
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "already has baseline run 'first'" in error.details()


def test_shapes_beyond_broadcast_or_transpose_are_a_divergence(server):
    run_pair(server.address, "shapes", [(0, X), (1, X)], [(0, X.reshape(4, 6)), (1, X)])
    first = server.report("shapes")["first_divergence"]
    assert (first["module"], first["metric"]) == ("fc", "shape")


def test_broadcast_equivalent_shapes_are_not_a_divergence(server):
    rope = np.linspace(0, 1, 12, dtype=np.float32).reshape(1, 3, 4)
    run_pair(server.address, "rope", [(0, rope)], [(0, np.broadcast_to(rope, (5, 3, 4)))], payload=True)
    assert server.report("rope")["status"] == "aligned"


def test_nan_and_inf_are_a_divergence(server):
    bad = X.copy()
    bad[0, 0, 0] = np.nan
    bad[1, 0, 0] = np.inf
    run_pair(server.address, "nan", [(0, X), (1, X)], [(0, X), (1, bad)])
    first = server.report("nan")["first_divergence"]
    assert (first["module"], first["metric"], first["value"]) == ("act", "nonfinite", 2.0)


@pytest.mark.parametrize("server", [{"config": ServerConfig(limits=LimitsConfig(max_message_bytes=1 << 20))}], indirect=True)
def test_oversized_message_is_refused(server):
    stream = joined(server.address, "big", "base", True)
    noise = np.random.default_rng(0).random(600_000, dtype=np.float32)  # incompressible: 2.4 MB on the wire
    error = stream.send(pieces(0, [(0, noise)])[0]).error()  # one piece of 2.4 MB
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in error.details()
    assert_serving(server)
