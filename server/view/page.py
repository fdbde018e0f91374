"""The dashboard's HTML: the live page (assets fetched from the server) and the frozen one (everything inline).

One page template, one script and one style serve both: ``twinstep report --html`` writes the same
page with the script, the styles, the vendored chart library and the view itself inlined, so the
file opens anywhere with no network.
"""

from __future__ import annotations

import functools
import html
import json
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).with_name("assets")
#: Files a page may load, and their media types.  Anything else is not served.
_SERVED = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "vendor/uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "vendor/uPlot.min.css": "text/css; charset=utf-8",
    "vendor/uPlot.LICENSE": "text/plain; charset=utf-8",
}
_STYLES = ("vendor/uPlot.min.css", "dashboard.css")
_SCRIPTS = ("vendor/uPlot.iife.min.js", "dashboard.js")


@functools.lru_cache(maxsize=None)
def _read(name: str) -> bytes:
    return (ASSETS / name).read_bytes()


def asset(name: str) -> tuple[bytes, str] | None:
    """(contents, media type) of a file pages may load; None for anything else."""
    media_type = _SERVED.get(name)
    return None if media_type is None else (_read(name), media_type)


def render_page(page: str, session: str | None = None) -> str:
    """The live page: ``page`` is "sessions" (the list) or "dashboard" (one session's)."""
    styles = "\n".join(f'<link rel="stylesheet" href="/assets/{name}">' for name in _STYLES)
    scripts = "\n".join(f'<script src="/assets/{name}"></script>' for name in _SCRIPTS)
    return _fill(page=page, mode="live", session=session or "", styles=styles, scripts=scripts, data="")


def render_frozen(view: dict[str, Any]) -> str:
    """A self-contained page of one view (``twinstep report --html``): no request leaves it."""
    styles = "\n".join(f"<style>\n{_read(name).decode()}\n</style>" for name in _STYLES)
    scripts = "\n".join(f"<script>\n{_inline_script(_read(name).decode())}\n</script>" for name in _SCRIPTS)
    data = f'<script type="application/json" id="twinstep-view">{_json_for_html(view)}</script>'
    return _fill(page="dashboard", mode="frozen", session=str(view.get("session", "")), styles=styles,
                 scripts=scripts, data=data)


def _fill(*, page: str, mode: str, session: str, styles: str, scripts: str, data: str) -> str:
    template = _read("page.html").decode()
    title = f"twinstep · {session}" if session else "twinstep sessions"
    replacements = {
        "{{title}}": html.escape(title),
        "{{page}}": page,
        "{{mode}}": mode,
        "{{session}}": html.escape(session, quote=True),
        "<!--twinstep:styles-->": styles,
        "<!--twinstep:data-->": data,
        "<!--twinstep:scripts-->": scripts,
    }
    for marker, value in replacements.items():
        template = template.replace(marker, value)
    return template


def _json_for_html(value: Any) -> str:
    """JSON that cannot end its <script> element early (no "<", so no "</script>" or "<!--")."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c").replace(
        "\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _inline_script(code: str) -> str:
    if "</script" in code.lower():
        raise ValueError("a script to inline contains '</script': it would end its element early")
    return code
