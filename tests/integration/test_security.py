"""TLS, mutual TLS and tokens, over real gRPC on loopback (docs/security.md)."""

from __future__ import annotations

import datetime
import logging
import queue
import subprocess
import sys

import grpc
import pytest

from tests.conftest import serve_process, wait_for
from twinstep._version import PROTOCOL_VERSION
from twinstep.server import serve
from twinstep.server.security import ServerSecurity, self_signed
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc

CLI = [sys.executable, "-m", "twinstep"]
OPERATOR, TOKEN_A, TOKEN_B = "op-0123456789", "tok-a-0123456789", "tok-b-0123456789"
UNAUTHENTICATED, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED


def _metadata(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None


def _hello(session: str, run: str, baseline: bool = False) -> pb.ClientMessage:
    return pb.ClientMessage(hello=pb.Hello(
        protocol_version=PROTOCOL_VERSION, session=session, run=run, baseline=baseline, framework="torch",
        framework_version="test", rank=0, world_size=1, capture="stats",
    ))


class Stream:
    """A Stream call carrying a token: sends a hello, then holds the stream open until closed."""

    def __init__(self, channel: grpc.Channel, session: str, run: str, token: str | None, baseline: bool = False):
        self._requests: queue.Queue = queue.Queue()
        self._requests.put(_hello(session, run, baseline))
        self.call = pb_grpc.TwinstepStub(channel).Stream(iter(self._requests.get, None), metadata=_metadata(token))

    def first(self):
        """The first response, or the error that ended the stream."""
        try:
            return next(self.call)
        except grpc.RpcError as error:
            return error

    def close(self) -> None:
        self._requests.put(None)
        self.call.cancel()


def _code(call) -> grpc.StatusCode | str:
    try:
        result = call()
    except grpc.RpcError as error:
        return error.code()
    return "ok" if not isinstance(result, grpc.RpcError) else result.code()


@pytest.fixture
def guarded():
    handle = serve(port=0, security=ServerSecurity(operator_token=OPERATOR,
                                                   session_tokens=[("a", TOKEN_A), ("b", TOKEN_B)]))
    channel = grpc.insecure_channel(handle.address)
    yield handle, channel
    channel.close()
    handle.stop(grace=0.5)


def test_every_rpc_checks_its_token(guarded, caplog):
    handle, channel = guarded
    stub = pb_grpc.TwinstepStub(channel)
    b = Stream(channel, "b", "torch", TOKEN_B, baseline=True)  # another session, streaming all along
    assert b.first().WhichOneof("body") == "welcome"
    a = Stream(channel, "a", "torch", TOKEN_A, baseline=True)
    assert a.first().WhichOneof("body") == "welcome"

    def stream(token, session="a"):
        s = Stream(channel, session, "paddle", token)
        try:
            return s.first()
        finally:
            s.close()

    def watch(token, session="a"):
        events = stub.Watch(pb.WatchRequest(session=session), metadata=_metadata(token), timeout=10)
        try:
            return next(events)
        finally:
            events.cancel()

    def report(token, session="a"):
        return stub.GetReport(pb.ReportRequest(session=session), metadata=_metadata(token), timeout=10)

    def halt(token, session="a"):
        return stub.Halt(pb.HaltRequest(session=session, reason="test"), metadata=_metadata(token), timeout=10)

    caplog.set_level(logging.WARNING, logger="twinstep.server")
    for rpc in (stream, watch, report, halt):
        assert _code(lambda: rpc(None)) == UNAUTHENTICATED, rpc.__name__
        assert _code(lambda: rpc("not-a-token")) == UNAUTHENTICATED, rpc.__name__
        assert _code(lambda: rpc(TOKEN_B)) == DENIED, rpc.__name__  # another session's token
    # A session token may stream, watch and read its own session; halting needs the operator.
    assert _code(lambda: halt(TOKEN_A)) == DENIED
    assert _code(lambda: watch(TOKEN_A)) == "ok"
    assert report(TOKEN_A).session == "a"
    # A token for session "a" never creates session "c".
    assert _code(lambda: stream(TOKEN_A, session="c")) == DENIED
    assert "c" not in handle.registry.names()
    # A session token does not learn other sessions' names from a miss; the operator does.
    with pytest.raises(grpc.RpcError) as missing:
        report(OPERATOR, session="nope")
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND and "sessions: " in missing.value.details()
    with pytest.raises(grpc.RpcError) as denied:
        report(TOKEN_A, session="nope")
    assert denied.value.code() == DENIED and "'a'" in denied.value.details()  # its own session, named

    # The messages say what is wrong.
    with pytest.raises(grpc.RpcError) as none:
        report(None)
    assert "Bearer" in none.value.details()
    with pytest.raises(grpc.RpcError) as operator_only:
        halt(TOKEN_A)
    assert "operator token" in operator_only.value.details()

    # Each refusal is logged once per peer and kind, however often it is repeated.
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused report")]
    assert len([m for m in refusals if "no token" in m or "needs a token" in m]) == 1, refusals

    # Listing sessions: a token is needed; a session token sees its own session only, the operator every one.
    def sessions(token):
        return [row.name for row in stub.ListSessions(pb.ListSessionsRequest(), metadata=_metadata(token),
                                                      timeout=10).sessions]

    assert _code(lambda: sessions(None)) == UNAUTHENTICATED
    assert _code(lambda: sessions("not-a-token")) == UNAUTHENTICATED
    assert sessions(TOKEN_A) == ["a"] and sessions(TOKEN_B) == ["b"]
    assert sorted(sessions(OPERATOR)) == ["a", "b"]

    # The operator may do everything; session b streamed through all of it.
    assert report(OPERATOR).session == "a" and report(OPERATOR, session="b").session == "b"
    assert _code(lambda: watch(OPERATOR, session="b")) == "ok"
    assert list(halt(OPERATOR).runs) == ["torch"]
    b2 = Stream(channel, "b", "paddle", TOKEN_B)
    assert b2.first().WhichOneof("body") == "welcome"
    assert {r.name for r in report(TOKEN_B, session="b").runs} == {"torch", "paddle"}
    for s in (a, b, b2):
        s.close()


def test_a_refused_training_logs_one_error_and_goes_on(guarded, caplog):
    torch = pytest.importorskip("torch")
    import twinstep

    handle, _ = guarded
    caplog.set_level(logging.ERROR, logger="twinstep")
    model = torch.nn.Linear(2, 2)
    mon = twinstep.attach(model, session="a", run="torch", baseline=True, server=handle.address,
                          token=TOKEN_B, tls_ca="", sender="thread")  # session b's token
    for _ in range(3):
        model(torch.ones(1, 2)).sum().backward()
        mon.step()
    wait_for(lambda: mon.stats.rejected)
    mon.close(timeout=2)
    assert "PERMISSION_DENIED" in mon.stats.rejected and "'b'" in mon.stats.rejected
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name == "twinstep"]
    assert len(errors) == 1 and "training continues" in errors[0].getMessage()
    assert "a" not in handle.registry.names()


def test_plaintext_or_open_beyond_loopback_needs_insecure(tmp_path):
    with pytest.raises(ValueError, match="plaintext"):
        serve(port=0, host="0.0.0.0")
    with pytest.raises(ValueError, match="open to every caller"):
        cert, key = self_signed(tmp_path)
        serve(port=0, host="0.0.0.0", security=ServerSecurity(tls_cert=str(cert), tls_key=str(key)))
    out = subprocess.run(CLI + ["serve", "--host", "0.0.0.0", "--port", "0"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "--insecure" in out.stderr
    handle = serve(port=0, host="0.0.0.0", insecure=True)  # asked for: served, with a warning
    handle.stop(grace=0.1)


# -- TLS -------------------------------------------------------------------------------------------


def _ca_and_client(directory):
    """A CA and a client certificate it signed (PEM files), for mutual TLS."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def build(subject, issuer, public, signer, ca):
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public)
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
                .sign(signer, hashes.SHA256()))

    def write(name, cert, key):
        (directory / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (directory / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        return str(directory / f"{name}.crt"), str(directory / f"{name}.key")

    ca_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
    client_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "trainer")])
    ca = build(ca_name, ca_name, ca_key.public_key(), ca_key, True)
    client = build(client_name, ca_name, client_key.public_key(), ca_key, False)
    return write("ca", ca, ca_key)[0], *write("client", client, client_key)


def _train(server: str, steps: int = 2, **kwargs):
    """A tiny torch model attached in this process; returns its monitor's stats after close."""
    torch = pytest.importorskip("torch")
    import twinstep

    model = torch.nn.Linear(2, 2)
    kwargs.setdefault("sender", "thread")
    mon = twinstep.attach(model, session=kwargs.pop("session", "tls"), run=kwargs.pop("run", "torch"), baseline=True,
                          server=server, **kwargs)
    for _ in range(steps):
        model(torch.ones(1, 2)).sum().backward()
        mon.step()
    wait_for(lambda: mon.stats.steps_sent == steps or mon.stats.rejected or mon.stats.reconnects)
    mon.close(timeout=2)
    return mon.stats


def test_self_signed_tls_serves_trusted_clients_only(jobs, tmp_path, caplog):
    server, address = serve_process("--self-signed", str(tmp_path / "tls"), "--operator-token", OPERATOR,
                                    "--session-token", f"tls={TOKEN_A}")
    cert = str(tmp_path / "tls" / "server.crt")
    try:
        # A real job that trusts the certificate, by environment variables only.
        job = jobs("torch", server=address, session="tls", baseline=True, steps=2,
                   env={"TWINSTEP_TLS_CA": cert, "TWINSTEP_TOKEN": TOKEN_A})
        result = job.wait()
        assert result.returncode == 0 and result.result["steps_sent"] == 2, result.output
        out = subprocess.run(CLI + ["report", "tls", "--server", address, "--tls-ca", cert, "--token", TOKEN_A,
                                    "--json"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and '"last_step": 1' in out.stdout, out.stderr

        # A client trusting another certificate: one clear warning, no step sent, training goes on.
        other, _ = self_signed(tmp_path / "other")
        caplog.set_level(logging.WARNING, logger="twinstep")
        stats = _train(address, tls_ca=str(other), token=TOKEN_A, session="tls", run="stranger")
        assert stats.steps_sent == 0 and not stats.connected
        warned = [r.getMessage() for r in caplog.records if r.name == "twinstep"
                  and f"cannot reach the comparison server at {address}" in r.getMessage()]  # never reached
        assert len(warned) == 1 and "not trusted" in warned[0] and "TWINSTEP_TLS_CA" in warned[0], warned

        # A plaintext CLI call to the TLS server fails with a status, not a hang.
        out = subprocess.run(CLI + ["report", "tls", "--server", address, "--token", TOKEN_A, "--tls-ca", ""],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "UNAVAILABLE" in out.stderr
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert server.returncode == 0


def test_mutual_tls_refuses_a_client_without_a_certificate(tmp_path, caplog):
    cert, key = self_signed(tmp_path / "server")
    ca, client_cert, client_key = _ca_and_client(tmp_path)
    handle = serve(port=0, security=ServerSecurity(tls_cert=str(cert), tls_key=str(key), tls_client_ca=ca))
    try:
        assert handle.tls
        caplog.set_level(logging.WARNING, logger="twinstep")
        stats = _train(handle.address, tls_ca=str(cert), run="anonymous", token="")
        assert stats.steps_sent == 0 and not stats.connected
        assert "tls" not in handle.registry.names()
        warned = [r.getMessage() for r in caplog.records if r.name == "twinstep" and "cannot reach" in r.getMessage()]
        assert len(warned) == 1 and "client certificate" in warned[0], warned

        # The sender process (full tensors) gets the TLS files with its StreamConfig.
        stats = _train(handle.address, tls_ca=str(cert), tls_client_cert=client_cert, tls_client_key=client_key,
                       run="trainer", token="", capture="tensors", sender="process")
        assert stats.steps_sent == 2 and not stats.rejected
        wait_for(lambda: handle.report("tls")["runs"][0]["last_step"] == 1)
    finally:
        handle.stop(grace=0.5)


def test_a_plaintext_client_of_a_tls_server_is_told_the_server_may_speak_tls(tmp_path, caplog):
    """On loopback a client speaks plaintext unless given TLS files; a TLS server closes that connection."""
    cert, key = self_signed(tmp_path / "server")
    handle = serve(port=0, security=ServerSecurity(tls_cert=str(cert), tls_key=str(key)))
    try:
        caplog.set_level(logging.WARNING, logger="twinstep")
        stats = _train(handle.address, run="plain", token="", tls_ca="")
        assert stats.steps_sent == 0 and not stats.connected
        warned = [r.getMessage() for r in caplog.records if r.name == "twinstep" and handle.address in r.getMessage()
                  and "UNAVAILABLE" in r.getMessage()]
        assert len(warned) == 1, warned
        assert f"cannot reach the comparison server at {handle.address}" in warned[0], warned
        assert ("the server closed the connection before answering: it may speak TLS while this client speaks "
                "plaintext (a loopback address is reached in plaintext unless TLS files are given): set "
                "TWINSTEP_TLS_CA (attach(tls_ca=...), --tls-ca) to the server's certificate or its CA") in warned[0]

        # The command line says the same.
        out = subprocess.run(CLI + ["report", "tls", "--server", handle.address, "--tls-ca", ""],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "UNAVAILABLE" in out.stderr, out.stderr
        assert "it may speak TLS while this client speaks plaintext" in out.stderr, out.stderr
        assert "--tls-ca" in out.stderr
        # Given the certificate, the same client is served.
        stats = _train(handle.address, run="trusting", token="", tls_ca=str(cert))
        assert stats.steps_sent == 2 and not stats.rejected
    finally:
        handle.stop(grace=0.5)
