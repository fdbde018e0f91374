"""Watch: waiting for a session that does not exist yet never creates it."""

from __future__ import annotations

import grpc
import pytest

from tests.conftest import wait_for
from tests.integration.rawclient import RawStream, hello, manifest
from tests.integration.test_capture_health import Watcher
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc


def test_watching_an_unknown_session_waits_for_it_without_creating_it(server):
    watcher = Watcher(server.address, "later")
    wait_for(lambda: watcher.lines)  # the stream is live: an empty progress line
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as missing:
            pb_grpc.TwinstepStub(channel).GetReport(pb.ReportRequest(session="later"), timeout=30)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert server.registry.names() == []
    stream = RawStream(server.address).send(hello("later", "torch", baseline=True)).send(manifest((0, "fc", "Linear")))
    assert stream.next().WhichOneof("body") == "welcome"
    wait_for(lambda: any("torch* no step yet, streaming" in line for line in watcher.lines))
    watcher.close()
    stream.close()
