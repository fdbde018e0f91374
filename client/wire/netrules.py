"""Network rules shared by the client and the server: what counts as loopback, and reading PEM files.

Both sides apply one rule: plaintext and an open server are fine on loopback,
anywhere else they must be asked for.  Imports nothing of the client's runtime.
"""

from __future__ import annotations

import ipaddress
import pathlib

_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 (bracketed or not) and localhost; False for wildcards and anything else."""
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host in _LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def target_is_loopback(target: str) -> bool:
    """True for a ``host:port`` on loopback, and for ``unix:`` sockets."""
    return target.startswith("unix:") or is_loopback(target.rpartition(":")[0])


def is_true(value: str | None) -> bool:
    """An environment flag's value: 1, true, yes or on."""
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def read_pem(path: str, what: str) -> bytes:
    """A PEM file's bytes, or a ValueError naming ``what`` and why."""
    try:
        data = pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"the {what} {path} is not PEM (no '-----BEGIN' line)")
    return data
