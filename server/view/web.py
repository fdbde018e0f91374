"""The dashboard's HTTP side: pages, the JSON API, the halt endpoint and /metrics, as one Starlette app.

Pages and assets carry no data and need no token; every API call does when the server has tokens
(the gRPC servicer's Authorizer decides, with the same rights: a session token reads its own
session, the operator token everything and halts).  Halting from a page needs an operator token to
exist: an open server's page cannot halt (``twinstep halt`` can, as before).

Browsers are kept to their own origin: a POST whose ``Origin`` (or ``Sec-Fetch-Site``) says it comes
from another site is refused, and on a loopback listener a request must name a loopback host, so a
web page elsewhere cannot reach this server through DNS rebinding.

Pages poll ``/api/sessions/{name}/view`` rather than holding a server-sent event stream: the token
travels in the Authorization header (EventSource cannot send one, and a token in a URL ends up in logs
and history), gzip and ETags apply, and a page that goes away holds nothing on the server.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route

from twinstep._version import __version__
from twinstep.wire.netrules import is_loopback
from twinstep.server.security import Authorizer, Caller, Denied
from twinstep.server.view.page import asset, render_page
from twinstep.server.view.service import ViewService

logger = logging.getLogger("twinstep.server")

_MAX_REASON = 500
_MAX_BODY = 16 << 10
_SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
#: The live page loads its script and style from this server only (uPlot sets inline styles).
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def build_app(service: ViewService, authorizer: Authorizer, *, loopback_only: bool,
              metrics_app: Callable | None = None) -> Starlette:
    """The app; ``loopback_only``: the listener is on loopback, so requests must name a loopback host."""

    def guard(request: Request) -> None:
        if loopback_only and not _loopback_host(request.headers.get("host", "")):
            raise _Refused(421, "this dashboard listens on loopback: open it as localhost or 127.0.0.1")

    def caller_for(request: Request, action: str, session: str | None) -> Caller:
        try:
            caller = authorizer.bearer(request.headers.get("authorization"))
            if action != "list":
                authorizer.check(caller, action, session)
            return caller
        except Denied as denied:
            host = request.client.host if request.client else "unknown"
            authorizer.note(f"http:{host}", action, denied)
            raise _Refused(401 if denied.code.name == "UNAUTHENTICATED" else 403, denied.message) from None

    async def info(request: Request) -> Response:
        guard(request)
        return _json({"version": __version__, "auth_required": not authorizer.open,
                      "halt_enabled": service.halt_enabled, "halt_message": service.halt_message})

    async def sessions(request: Request) -> Response:
        guard(request)
        caller = caller_for(request, "list", None)
        listing = await run_in_threadpool(service.sessions, None if caller.operator else caller.session)
        return _json({"sessions": listing})

    async def view(request: Request) -> Response:
        guard(request)
        name = request.path_params["name"]
        caller_for(request, "report", name)
        found = await run_in_threadpool(service.view, name)  # takes the session's lock: off the event loop
        if found is None:
            raise _Refused(404, f"no session {name!r} on this server")
        body, etag = found
        headers = {"ETag": etag, "Cache-Control": "no-cache"}
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers=headers)
        return Response(body, media_type="application/json", headers=headers)

    async def halt(request: Request) -> Response:
        guard(request)
        _same_origin(request)
        name = request.path_params["name"]
        if not service.halt_enabled:
            raise _Refused(403, service.halt_message)
        caller_for(request, "halt", name)
        reason = "halted from the dashboard"
        if int(request.headers.get("content-length") or 0) > _MAX_BODY:
            raise _Refused(413, f"a halt's body holds a reason: at most {_MAX_BODY} bytes")
        try:
            body = await request.json() if await request.body() else {}
        except ValueError:
            raise _Refused(400, "the body must be JSON, e.g. {\"reason\": \"...\"}") from None
        if isinstance(body, dict) and isinstance(body.get("reason"), str) and body["reason"].strip():
            reason = body["reason"].strip()[:_MAX_REASON]
        runs = await run_in_threadpool(service.halt, name, reason)
        if runs is None:
            raise _Refused(404, f"no session {name!r} is running on this server")
        logger.warning("session %s: halted from the dashboard by %s: %s", name,
                       request.client.host if request.client else "unknown", reason)
        return _json({"runs": runs, "reason": reason})

    async def page(request: Request) -> Response:
        guard(request)
        name = request.path_params.get("name")
        html = render_page("dashboard" if name is not None else "sessions", session=name)
        return Response(html, media_type="text/html; charset=utf-8", headers={"Content-Security-Policy": _CSP})

    async def static(request: Request) -> Response:
        guard(request)
        found = asset(request.path_params["file"])
        if found is None:
            raise _Refused(404, "no such asset")
        data, media_type = found
        return Response(data, media_type=media_type, headers={"Cache-Control": "no-cache"})

    routes: list[Any] = [
        Route("/", page),
        Route("/sessions/{name:path}", page),
        Route("/assets/{file:path}", static),
        Route("/api/info", info),
        Route("/api/sessions", sessions),
        Route("/api/sessions/{name:path}/view", view),
        Route("/api/sessions/{name:path}/halt", halt, methods=["POST"]),
    ]
    if metrics_app is not None:
        metrics = _GuardedMetrics(metrics_app, authorizer, loopback_only)
        routes += [Route("/metrics", metrics), Mount("/metrics", app=metrics)]  # no redirect to /metrics/

    async def refused(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, _Refused)
        return _json({"error": exc.message}, status=exc.status)

    app = Starlette(routes=routes, middleware=[Middleware(GZipMiddleware, minimum_size=1024)],
                    exception_handlers={_Refused: refused})
    return _with_headers(app)


def _json(data: Any, status: int = 200) -> Response:
    return Response(json.dumps(data, allow_nan=False), status_code=status, media_type="application/json")


def _same_origin(request: Request) -> None:
    """Refuse a POST that a browser says comes from another origin."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        raise _Refused(403, f"cross-origin request refused ({site}); halt from the dashboard's own page")
    origin = request.headers.get("origin")
    if origin is None:
        return  # not a browser's cross-origin request (browsers send Origin on every cross-origin POST)
    expected = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if origin.rstrip("/").lower() != expected.lower():
        raise _Refused(403, f"cross-origin request from {origin} refused; halt from the dashboard's own page")


def _loopback_host(host_header: str) -> bool:
    """The Host header names this machine (localhost, 127.0.0.0/8, [::1]), with or without a port."""
    host = host_header.strip()
    if host.startswith("["):
        host = host[: host.find("]") + 1] if "]" in host else host
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return bool(host) and is_loopback(host)


class _GuardedMetrics:
    """/metrics spans every session: with tokens it needs the operator's (a scraper's bearer token)."""

    def __init__(self, metrics_app: Callable, authorizer: Authorizer, loopback_only: bool) -> None:
        self.metrics_app = metrics_app
        self.authorizer = authorizer
        self.loopback_only = loopback_only

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            problem = None
            if self.loopback_only and not _loopback_host(headers.get("host", "")):
                problem = (421, "this server listens on loopback: scrape it as localhost or 127.0.0.1")
            else:
                try:
                    self.authorizer.check(self.authorizer.bearer(headers.get("authorization")), "metrics", None)
                except Denied as denied:
                    problem = (401 if denied.code.name == "UNAUTHENTICATED" else 403, denied.message)
            if problem is not None:
                response = _json({"error": problem[1]}, status=problem[0])
                await response(scope, receive, send)
                return
        await self.metrics_app(scope, receive, send)


def _with_headers(app: Callable) -> Callable:
    """Every response carries the headers that keep it out of other sites' frames and sniffing."""

    async def wrapped(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {k.decode("latin-1").lower() for k, _ in headers}
                for key, value in _SECURITY_HEADERS.items():
                    if key.lower() not in present:
                        headers.append((key.encode("latin-1"), value.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await app(scope, receive, send_with_headers)

    return wrapped
