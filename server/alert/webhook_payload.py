"""What a webhook POSTs: twinstep's versioned JSON payload, or a Slack-compatible body.

The JSON payload (``"schema": "twinstep.webhook/v1"``) is documented in
docs/alerts.md; fields are only ever added within a version, a field's
meaning never changes.  The Slack body is ``{"text": ..., "blocks": [...]}``:
``text`` is the notification line, ``blocks`` its richer form.
"""

from __future__ import annotations

import datetime
import math
from typing import Any

from twinstep.v1 import twinstep_pb2 as pb

SCHEMA = "twinstep.webhook/v1"
VERSION = 1


def event_kind(event: pb.Event) -> str | None:
    """The webhook event an event bus event is, or None (progress, other alerts)."""
    body = event.WhichOneof("body")
    if body in ("divergence", "halt"):
        return body
    if body == "alert" and event.alert.kind in ("lost_run", "capture_failure", "preflight"):
        return event.alert.kind
    return None


def json_payload(event: pb.Event, server: str = "") -> dict[str, Any]:
    """twinstep's own payload for ``event`` (one of event_kind's kinds)."""
    kind = event_kind(event)
    if kind is None:
        raise ValueError(f"no webhook payload for a {event.WhichOneof('body')} event")
    payload: dict[str, Any] = {
        "schema": SCHEMA,
        "version": VERSION,
        "event": kind,
        "session": event.session,
        "time": event.time,
        "time_iso": datetime.datetime.fromtimestamp(event.time, datetime.timezone.utc).isoformat(),
        "server": server or None,
        "summary": summary(event),
    }
    if kind == "divergence":
        d = event.divergence
        payload["divergence"] = {
            "candidate_run": d.candidate_run, "step": d.step, "rank": d.rank, "phase": d.phase, "module": d.module,
            "candidate_module": d.candidate_module, "metric": d.metric, "value": _finite(d.value),
            "tolerance": _finite(d.tolerance), "stage": d.stage or None, "after_gap": d.after_gap,
            "gaps_summary": d.gaps_summary or None,
        }
    elif kind == "halt":
        h = event.halt
        payload["halt"] = {"run": h.run, "at_step": h.at_step if h.at_step >= 0 else None, "reason": h.reason}
    else:
        a = event.alert
        payload["alert"] = {"level": a.level, "run": a.run, "rank": a.rank, "message": a.message}
    return payload


def summary(event: pb.Event) -> str:
    """The event in one line."""
    session = event.session
    body = event.WhichOneof("body")
    if body == "divergence":
        d = event.divergence
        line = (f"session {session!r}: first divergence of run {d.candidate_run!r} at step {d.step} rank {d.rank}, "
                f"{d.phase} of {d.module or '(model)'!r}: {d.metric} {d.value:.3g} > {d.tolerance:.3g}")
        return line + (" (after steps that were not compared)" if d.after_gap else "")
    if body == "halt":
        h = event.halt
        at = f" at step {h.at_step}" if h.at_step >= 0 else ""
        return f"session {session!r}: run {h.run!r} halted{at}: {h.reason}"
    return f"session {session!r}: {event.alert.message}"


_TITLES = {"divergence": "Divergence", "halt": "Halt", "lost_run": "Run lost", "capture_failure": "Capture failing",
           "preflight": "Set-up differs"}
_ICONS = {"divergence": ":rotating_light:", "halt": ":octagonal_sign:", "lost_run": ":warning:",
          "capture_failure": ":warning:", "preflight": ":warning:"}


def slack_payload(event: pb.Event, server: str = "") -> dict[str, Any]:
    """A Slack incoming-webhook body for ``event``: ``text`` (the notification) and ``blocks``."""
    kind = event_kind(event)
    if kind is None:
        raise ValueError(f"no webhook payload for a {event.WhichOneof('body')} event")
    line = summary(event)
    fields = [f"*Session*\n{_code(event.session)}"]
    if kind == "divergence":
        d = event.divergence
        fields += [f"*Run*\n{_code(d.candidate_run)}", f"*Step / rank*\n{d.step} / {d.rank}",
                   f"*Where*\n{d.phase} of {_code(d.module or '(model)')}",
                   f"*Metric*\n{d.metric} {d.value:.3g} > {d.tolerance:.3g}"]
        if d.stage:
            fields.append(f"*Stage*\n{d.stage}")
    elif kind == "halt":
        fields += [f"*Run*\n{_code(event.halt.run)}",
                   f"*At step*\n{event.halt.at_step if event.halt.at_step >= 0 else 'next'}"]
    else:
        fields += [f"*Run*\n{_code(event.alert.run)}", f"*Rank*\n{event.alert.rank}"]
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": f"twinstep: {_TITLES[kind]}"}},
        {"type": "section", "text": {"type": "mrkdwn", "text": _escape(line)[:3000]}},
        {"type": "section", "fields": [{"type": "mrkdwn", "text": f[:2000]} for f in fields[:10]]},
    ]
    if server:
        blocks.append({"type": "context", "elements": [
            {"type": "mrkdwn", "text": f"`twinstep report {event.session} --server {server}`"}]})
    return {"text": f"{_ICONS[kind]} twinstep: {_escape(line)}", "blocks": blocks}


def _escape(text: str) -> str:
    """Slack's mrkdwn escapes: &, < and > (else they read as links or mentions)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _code(text: str) -> str:
    quoted = _escape(text).replace("`", "'")
    return f"`{quoted}`"


def _finite(value: float) -> float | str:
    """JSON has no inf or nan: those are the strings "inf", "-inf", "nan" (as in the report)."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value
