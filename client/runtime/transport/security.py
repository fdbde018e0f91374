"""How a client reaches the server: TLS or plaintext, and the token it presents.

The loopback rule, client side (the server applies the same rule to where it
listens, twinstep.server.security):

- TLS settings given (a CA to trust, or a client certificate): TLS;
- otherwise a loopback target (127.0.0.0/8, ``::1``, ``localhost``, ``unix:``):
  plaintext, as before;
- otherwise TLS, trusting the system's certificate authorities, unless
  plaintext is asked for (``insecure=True``, ``--insecure``, TWINSTEP_INSECURE=1),
  and then one warning is logged.

The token travels as ``authorization: Bearer TOKEN`` metadata on every call.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping

import grpc

from twinstep.wire.netrules import is_true, read_pem, target_is_loopback

logger = logging.getLogger("twinstep")

ENV_TOKEN = "TWINSTEP_TOKEN"
ENV_TLS_CA = "TWINSTEP_TLS_CA"
ENV_TLS_CLIENT_CERT = "TWINSTEP_TLS_CLIENT_CERT"
ENV_TLS_CLIENT_KEY = "TWINSTEP_TLS_CLIENT_KEY"
ENV_INSECURE = "TWINSTEP_INSECURE"

_warned_plaintext: set[str] = set()


def _env_flag(value: str | None) -> bool:
    return is_true(value)


def _read(path: str, what: str) -> bytes:
    return read_pem(path, what)


@dataclass(kw_only=True)
class ClientSecurity:
    """A client's TLS files, token and plaintext choice; ``resolve`` fills what is not given from the environment."""

    token: str | None = None
    """Sent as 'authorization: Bearer TOKEN'."""
    tls_ca: str | None = None
    """PEM CA bundle (or the server's self-signed certificate) to trust; None: the system's."""
    tls_client_cert: str | None = None
    """PEM client certificate, for a server that asks for one (mutual TLS)."""
    tls_client_key: str | None = None
    insecure: bool = False
    """Plaintext to a non-loopback server (logged as a warning)."""

    @classmethod
    def resolve(cls, *, token: str | None = None, tls_ca: str | None = None, tls_client_cert: str | None = None,
                tls_client_key: str | None = None, insecure: bool | None = None,
                environ: Mapping[str, str] | None = None) -> "ClientSecurity":
        """Arguments win; None falls back to TWINSTEP_TOKEN, TWINSTEP_TLS_CA, TWINSTEP_TLS_CLIENT_CERT/KEY,
        TWINSTEP_INSECURE.  An empty string means "none" (the environment is not consulted)."""
        env = environ if environ is not None else os.environ

        def pick(value: str | None, name: str) -> str | None:
            return (env.get(name) or None) if value is None else (value or None)

        security = cls(
            token=pick(token, ENV_TOKEN),
            tls_ca=pick(tls_ca, ENV_TLS_CA),
            tls_client_cert=pick(tls_client_cert, ENV_TLS_CLIENT_CERT),
            tls_client_key=pick(tls_client_key, ENV_TLS_CLIENT_KEY),
            insecure=_env_flag(env.get(ENV_INSECURE)) if insecure is None else insecure,
        )
        security.validate()
        return security

    def validate(self) -> None:
        """ValueError for settings no connection could use, before any is tried."""
        if bool(self.tls_client_cert) != bool(self.tls_client_key):
            raise ValueError("a client certificate needs its key too (TWINSTEP_TLS_CLIENT_CERT and TWINSTEP_TLS_CLIENT_KEY)")
        if self.token is not None and (not self.token or any(c.isspace() or not c.isprintable() for c in self.token)):
            raise ValueError("the token must be printable text without spaces")
        if self.insecure and (self.tls_ca or self.tls_client_cert):
            raise ValueError("insecure (plaintext) was asked for together with TLS files; choose one")
        for path, what in ((self.tls_ca, "TLS CA"), (self.tls_client_cert, "TLS client certificate"),
                           (self.tls_client_key, "TLS client key")):
            if path:
                _read(path, what)

    @property
    def tls_configured(self) -> bool:
        return bool(self.tls_ca or self.tls_client_cert)

    def uses_tls(self, target: str) -> bool:
        if self.tls_configured:
            return True
        return not self.insecure and not target_is_loopback(target)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel(self, target: str, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
        """A channel to ``target`` by the loopback rule (see the module's docstring)."""
        if not self.uses_tls(target):
            if not target_is_loopback(target) and target not in _warned_plaintext:
                _warned_plaintext.add(target)
                logger.warning("twinstep: plaintext (insecure) connection to %s: data and token travel unencrypted",
                               target)
            return grpc.insecure_channel(target, options=options)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca, "TLS CA") if self.tls_ca else None,
            private_key=_read(self.tls_client_key, "TLS client key") if self.tls_client_key else None,
            certificate_chain=_read(self.tls_client_cert, "TLS client certificate") if self.tls_client_cert else None,
        )
        return grpc.secure_channel(target, credentials, options=options)

    def as_dict(self) -> dict[str, Any]:
        return {"token": self.token, "tls_ca": self.tls_ca, "tls_client_cert": self.tls_client_cert,
                "tls_client_key": self.tls_client_key, "insecure": self.insecure}


def explain(details: str, tls: bool | None = None, *, reached: bool = False) -> str:
    """A hint for a connection failure that looks like TLS (empty when it does not).

    ``tls``: this client uses it (None: not known); ``reached``: the server answered this client
    before, so a closed connection is a lost server rather than a protocol mismatch.
    """
    text = details.lower()
    if tls is False and not reached and any(
            sign in text for sign in ("socket closed", "connection reset", "wrong_version_number", "ssl_error")):
        # A TLS server closes a plaintext connection at its first bytes; the client sees no TLS at all.
        return (" -- the server closed the connection before answering: it may speak TLS while this client speaks "
                "plaintext (a loopback address is reached in plaintext unless TLS files are given): set "
                "TWINSTEP_TLS_CA (attach(tls_ca=...), --tls-ca) to the server's certificate or its CA")
    if tls and "socket closed" in text:
        return (" -- the server closed the TLS connection: it may want a client certificate "
                "(TWINSTEP_TLS_CLIENT_CERT/KEY) that this client lacks or it does not accept, or speak plaintext")
    if "certificate_verify_failed" in text or "certificate verify failed" in text:
        return (" -- the server's certificate is not trusted: set TWINSTEP_TLS_CA (attach(tls_ca=...), --tls-ca) "
                "to the CA or self-signed certificate file the server uses")
    if "handshake" in text or "ssl" in text or "tls" in text:
        return (" -- the TLS handshake failed: the server may speak plaintext while this client uses TLS (or the "
                "reverse), or it wants a client certificate (TWINSTEP_TLS_CLIENT_CERT/KEY)")
    return ""
