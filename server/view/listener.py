"""The dashboard's HTTP(S) listener: uvicorn on a thread of its own in the server's process.

The socket is bound here, before the thread starts, so a port in use is an error of ``serve()``
(as for gRPC) and port 0's choice is known at once.  The listener follows the gRPC server's security:
the loopback rule for its host, the same certificate (HTTPS) and client CA, the same tokens.  It stops
within a bounded time with the server (ServerHandle.stop).
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from typing import Any, Callable

from twinstep.wire.netrules import is_loopback
from twinstep.server.security import ServerSecurity

logger = logging.getLogger("twinstep.server")

_START_TIMEOUT = 10.0


class HttpListener:
    """A running dashboard: its URL, and a bounded stop."""

    def __init__(self, app: Callable, host: str, port: int, security: ServerSecurity, service: Any = None) -> None:
        import uvicorn

        self.service = service
        """The ViewService behind the pages (its build counts and times), if given."""
        self.host = host
        self.tls = security.tls
        self._socket = _bind(host, port)
        self.port = self._socket.getsockname()[1]
        options: dict[str, Any] = {}
        if security.tls:
            options.update(ssl_certfile=security.tls_cert, ssl_keyfile=security.tls_key)
            if security.tls_client_ca:
                options.update(ssl_ca_certs=security.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=5, timeout_graceful_shutdown=1, **options)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="twinstep-http", daemon=True)
        self._failure: BaseException | None = None
        self._thread.start()
        deadline = time.monotonic() + _START_TIMEOUT
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop(1.0)
                raise OSError(f"the dashboard could not start on {host}:{self.port}: "
                              f"{self._failure or 'it did not start within 10 s'}")
            time.sleep(0.01)

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        except BaseException as exc:  # reported by the constructor, or logged once it had started
            self._failure = exc
            if self._server.started:
                logger.exception("the dashboard's HTTP listener stopped")

    @property
    def url(self) -> str:
        """Where a browser opens the dashboard (a wildcard host is shown as 127.0.0.1)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::", "[::]") else self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/"

    def stop(self, timeout: float = 2.0) -> None:
        """Stop taking requests; give open ones ``timeout`` seconds, then close them."""
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(1.0)
        try:
            self._socket.close()
        except OSError:
            pass


def _bind(host: str, port: int) -> socket.socket:
    bare = host.strip("[]") if host else "0.0.0.0"
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bare, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise OSError(f"the dashboard cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def start_dashboard(registry: Any, security: ServerSecurity, host: str, port: int,
                    webhooks: Any = None) -> HttpListener:
    """The dashboard for ``registry``'s sessions on ``host:port`` (0: a free port); the caller has applied the
    loopback rule to ``host`` (serve() does, before it starts anything)."""
    from twinstep.server.view.service import ViewService
    from twinstep.server.view.web import build_app

    authorizer = security.authorizer()
    if authorizer.has_operator:
        halt_message = ""
    else:
        halt_message = ("halting from this page needs the operator's token: start the server with "
                        "--operator-token TOKEN (twinstep halt SESSION halts from the command line)")
    service = ViewService(registry, halt_enabled=authorizer.has_operator, halt_message=halt_message,
                          auth_required=not authorizer.open)
    app = build_app(service, authorizer, loopback_only=is_loopback(host), metrics_app=_metrics_app(registry, webhooks))
    listener = HttpListener(app, host, port, security, service)
    logger.info("twinstep dashboard on %s", listener.url)
    return listener


def _metrics_app(registry: Any, webhooks: Any) -> Callable | None:
    """Prometheus' /metrics (twinstep.server.alert.prometheus), when that module is present."""
    try:
        from twinstep.server.alert.prometheus import make_metrics_app
    except ImportError as exc:
        logger.info("dashboard: /metrics is not served (%s)", exc)
        return None
    return make_metrics_app(registry, webhooks)
