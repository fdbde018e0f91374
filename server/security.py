"""Who may reach the server, and what each caller may do: TLS, tokens, and the loopback rule.

**The loopback rule.**  A server listening on a loopback address (127.0.0.0/8,
``::1``, ``localhost``) may run plaintext and open (no tokens), as it always
has: only this machine can reach it.  Listening anywhere else it needs TLS
(a certificate and key) *and* a way to tell callers apart (tokens, or client
certificates checked against a CA), unless ``insecure`` is asked for, and then
one warning per missing protection is logged.

**Tokens.**  Callers send ``authorization: Bearer TOKEN`` metadata.  A session
token opens Stream, Watch and GetReport of its own session; the operator token
opens everything, Halt included.  With no token configured the server is
open: every caller may do everything (the loopback rule decides where that is
allowed).  A missing or unknown token is ``UNAUTHENTICATED``; a known token
used beyond its session or role is ``PERMISSION_DENIED``.  Each refusal is
logged once per peer host and kind, never more, and ends only that call.
"""

from __future__ import annotations

import datetime
import hmac
import ipaddress
import logging
import os
import pathlib
import socket
import threading
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import grpc

from twinstep.wire.netrules import is_loopback, read_pem

logger = logging.getLogger("twinstep.server")

# Its settings (files, tokens, insecure), their flags and variables: twinstep.server.config.SecurityConfig.

_MAX_LOGGED = 4096  # refusals remembered for "logged once"; beyond that, new ones are not logged


def _check_token(token: str, what: str) -> str:
    if not token or any(c.isspace() or not c.isprintable() for c in token):
        raise ValueError(f"{what}: a token must be non-empty printable text without spaces")
    return token


def parse_session_token(text: str) -> tuple[str, str]:
    """``SESSION=TOKEN`` (the token may itself contain '=')."""
    session, sep, token = text.partition("=")
    if not sep or not session.strip():
        raise ValueError(f"session token {text.split('=')[0]!r}...: expected SESSION=TOKEN")
    return session.strip(), _check_token(token.strip(), f"session token of {session.strip()!r}")


def read_tokens_file(path: str | pathlib.Path) -> list[tuple[str, str]]:
    """Lines ``SESSION=TOKEN``; blank lines and lines starting with ``#`` are skipped."""
    path = pathlib.Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read tokens file {path}: {exc.strerror or exc}") from None
    pairs = []
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            pairs.append(parse_session_token(line))
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
    return pairs


def _read(path: str, what: str) -> bytes:
    return read_pem(path, what)


@dataclass(kw_only=True)
class ServerSecurity:
    """TLS files, tokens, and whether plaintext or an open server is accepted beyond loopback."""

    tls_cert: str | None = None
    """PEM certificate chain the server presents."""
    tls_key: str | None = None
    """PEM private key of ``tls_cert``."""
    tls_client_ca: str | None = None
    """PEM CA bundle: when set, every client must present a certificate it signed (mutual TLS)."""
    operator_token: str | None = None
    """May do everything: Halt, and Watch/GetReport of every session."""
    session_tokens: list[tuple[str, str]] = field(default_factory=list)
    """(session, token): the token opens Stream, Watch and GetReport of that session only."""
    insecure: bool = False
    """Accept plaintext, or an open server, on a non-loopback address (with a warning)."""

    def __post_init__(self) -> None:
        if isinstance(self.session_tokens, Mapping):
            self.session_tokens = list(self.session_tokens.items())
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs the server's own --tls-cert and --tls-key")
        if self.operator_token is not None:
            _check_token(self.operator_token, "operator token")
        owners: dict[str, str] = {}
        for session, token in self.session_tokens:
            _check_token(token, f"session token of {session!r}")
            if owners.setdefault(token, session) != session:
                raise ValueError(f"sessions {owners[token]!r} and {session!r} share a token; give each its own")
            if self.operator_token is not None and hmac.compare_digest(token, self.operator_token):
                raise ValueError(f"the token of session {session!r} is the operator token; give it its own")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def authenticates(self) -> bool:
        """Callers are told apart: by tokens, or by client certificates."""
        return bool(self.operator_token or self.session_tokens or self.tls_client_ca)

    def credentials(self) -> grpc.ServerCredentials | None:
        """The server's TLS credentials (None: plaintext); ValueError naming an unreadable file."""
        if not self.tls:
            return None
        assert self.tls_cert and self.tls_key
        chain = _read(self.tls_cert, "TLS certificate")
        key = _read(self.tls_key, "TLS key")
        client_ca = _read(self.tls_client_ca, "client CA") if self.tls_client_ca else None
        return grpc.ssl_server_credentials(
            [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
        )

    def check_exposure(self, host: str) -> None:
        """Apply the loopback rule to a listening address: ValueError, or a warning with ``insecure``."""
        if is_loopback(host):
            return
        where = host or "all interfaces"
        problems = []
        if not self.tls:
            problems.append("plaintext (give --tls-cert and --tls-key, or --self-signed DIR)")
        if not self.authenticates:
            problems.append("open to every caller (give --operator-token and --session-token SESSION=TOKEN, "
                            "a --tokens-file, or --tls-client-ca)")
        if not problems:
            return
        if not self.insecure:
            raise ValueError(f"refusing to listen on {where} {' and '.join(problems)}; "
                             f"pass --insecure (insecure=True) to accept that beyond loopback")
        for problem in problems:
            logger.warning("twinstep server on %s is %s: --insecure was asked for", where, problem.split(" (")[0])

    def authorizer(self) -> "Authorizer":
        return Authorizer(self.operator_token, self.session_tokens)


# -- authorization ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Caller:
    """Who is calling: the operator (or anyone, on an open server), or the holder of one session's token."""

    operator: bool
    session: str | None = None


class Denied(Exception):
    def __init__(self, code: grpc.StatusCode, kind: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.kind = kind
        self.message = message


#: What a session token may do with its own session.  Anything else is the operator's.
SESSION_ACTIONS = frozenset({"stream", "watch", "report"})


def peer_host(peer: str) -> str:
    """gRPC's peer ("ipv4:10.0.0.2:53412", "ipv6:[::1]:5000", "unix:/path") without the port."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0] or rest
    return peer


class Authorizer:
    """Checks the bearer token of each call (constant-time comparisons) and logs each refusal once."""

    def __init__(self, operator_token: str | None = None, session_tokens: Iterable[tuple[str, str]] = ()) -> None:
        self._operator = operator_token.encode() if operator_token else None
        self._sessions = [(token.encode(), session) for session, token in session_tokens]
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    @property
    def open(self) -> bool:
        return self._operator is None and not self._sessions

    def caller(self, context: grpc.ServicerContext) -> Caller:
        """The caller of this RPC; Denied(UNAUTHENTICATED) without a known token."""
        if self.open:
            return Caller(operator=True)
        values = [v for k, v in (context.invocation_metadata() or ()) if k == "authorization"]
        return self.bearer(str(values[0]) if values else None)

    @property
    def has_operator(self) -> bool:
        """An operator token is configured (halting from the dashboard needs one)."""
        return self._operator is not None

    def bearer(self, authorization: str | None) -> Caller:
        """The caller presenting ``authorization`` ("Bearer TOKEN": gRPC metadata, or an HTTP header)."""
        if self.open:
            return Caller(operator=True)
        if not authorization:
            raise Denied(grpc.StatusCode.UNAUTHENTICATED, "no token",
                         "this server needs a token: send 'authorization: Bearer TOKEN' "
                         "(twinstep: TWINSTEP_TOKEN, attach(token=...), --token)")
        scheme, _, token = authorization.strip().partition(" ")
        presented = token.strip().encode()
        if scheme.lower() != "bearer" or not presented:
            raise Denied(grpc.StatusCode.UNAUTHENTICATED, "malformed token",
                         "the authorization metadata must be 'Bearer TOKEN'")
        operator = self._operator is not None and hmac.compare_digest(presented, self._operator)
        session = None
        for known, name in self._sessions:  # every comparison runs: no early exit on a match
            if hmac.compare_digest(presented, known):
                session = name
        if operator:
            return Caller(operator=True)
        if session is not None:
            return Caller(operator=False, session=session)
        raise Denied(grpc.StatusCode.UNAUTHENTICATED, "unknown token", "the token is not known to this server")

    def check(self, caller: Caller, action: str, session: str | None) -> None:
        """Denied(PERMISSION_DENIED) unless ``caller`` may do ``action`` on ``session``."""
        if caller.operator:
            return
        if action not in SESSION_ACTIONS:
            raise Denied(grpc.StatusCode.PERMISSION_DENIED, f"{action} needs the operator",
                         f"{action} needs the operator token; a session token may stream, watch and read "
                         f"the report of its own session")
        if session != caller.session:
            raise Denied(grpc.StatusCode.PERMISSION_DENIED, "other session",
                         f"this token is for session {caller.session!r}, not {session!r}")

    def note(self, peer: str, action: str, denied: Denied) -> None:
        """Log a refusal once per peer host and kind."""
        key = (peer_host(peer), f"{action}: {denied.kind}")
        with self._lock:
            if key in self._logged or len(self._logged) > _MAX_LOGGED:
                return
            self._logged.add(key)
            if len(self._logged) > _MAX_LOGGED:
                logger.warning("twinstep server: more than %d refused callers; further refusals are not logged",
                               _MAX_LOGGED)
                return
        logger.warning("refused %s from %s: %s: %s (logged once per peer and kind)",
                       action, key[0], denied.code.name, denied.message)

    def authorize(self, context: grpc.ServicerContext, action: str, session: str | None = None,
                  check: bool = True) -> Caller:
        """The caller, if it may do ``action`` on ``session``; otherwise the RPC is aborted with the code.

        ``check=False`` only authenticates (Stream: the session comes later, in the hello).
        """
        try:
            caller = self.caller(context)
            if check:
                self.check(caller, action, session)
            return caller
        except Denied as denied:
            self.note(context.peer(), action, denied)
            context.abort(denied.code, denied.message)
            raise  # abort raises; this is never reached


# -- a self-signed certificate for a quick start ---------------------------------------------------


def self_signed(directory: str | pathlib.Path, hosts: Iterable[str] = (), days: int = 365) -> tuple[pathlib.Path, pathlib.Path]:
    """Write ``server.crt`` and ``server.key`` (ECDSA P-256) into ``directory``, reusing a pair already there.

    The certificate names localhost, 127.0.0.1, ::1, this machine's host names
    and ``hosts``; clients trust it by its own file (TWINSTEP_TLS_CA).
    Needs the ``cryptography`` package (``pip install 'twinstep[tls]'``).
    """
    directory = pathlib.Path(directory)
    cert_path, key_path = directory / "server.crt", directory / "server.key"
    if cert_path.exists() and key_path.exists():
        return cert_path, key_path
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise ValueError("--self-signed needs the cryptography package: pip install 'twinstep[tls]'") from None
    names = {"localhost", socket.gethostname(), socket.getfqdn(), *hosts}
    addresses = {"127.0.0.1", "::1"}
    dns = []
    for name in sorted(n.strip("[]") for n in names if n and n not in ("0.0.0.0", "::", "[::]")):
        try:
            addresses.add(str(ipaddress.ip_address(name)))
        except ValueError:
            dns.append(name)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "twinstep server (self-signed)")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(
            [x509.DNSName(n) for n in dns] + [x509.IPAddress(ipaddress.ip_address(a)) for a in sorted(addresses)]
        ), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path
