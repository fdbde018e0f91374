"""Optional dependencies: a clear error naming the extra that brings them, before anything starts.

Training jobs install twinstep's core dependencies only; the server's web and terminal side comes with
``pip install 'twinstep[server]'`` (the dashboard and /metrics: starlette, uvicorn, prometheus-client;
``twinstep watch``'s live view: rich), a self-signed certificate with ``'twinstep[tls]'``, a sharded
comparator with ``'twinstep[ray]'``.
"""

from __future__ import annotations

import importlib
from typing import Iterable

#: What the dashboard and /metrics (``--http-port``) import.
DASHBOARD = ("starlette", "uvicorn", "prometheus_client")
#: What ``twinstep watch``'s live view imports.
LIVE_VIEW = ("rich",)
#: What a sharded server (``twinstep serve --shards N``) imports: its shards are Ray actors.
RAY = ("ray",)


class MissingExtra(ImportError, ValueError):
    """A feature asked for needs a package that is not installed; the message names the pip command.

    An ImportError by nature; a ValueError too, as serve() reports every setting it cannot honour
    (the command line prints it, without a traceback).
    """


def require(modules: Iterable[str], feature: str, extra: str = "server", hint: str = "") -> None:
    """Raise :class:`MissingExtra` when a module ``feature`` needs cannot be imported."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise MissingExtra(f"{feature} needs {', '.join(missing)}, which the {extra} extra installs: "
                           f"pip install 'twinstep[{extra}]'{hint}", name=missing[0])
