"""Where webhooks go and what they carry: one ``WebhookConfig`` per receiver.

From the server's YAML config (``webhooks:`` list) or ``twinstep serve
--webhook URL [--webhook-format json|slack]``.  Header values may name
environment variables (``Authorization: "Bearer ${ALERT_TOKEN}"``), so a
secret need not sit in the config file.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

#: The events a webhook can be sent for.
EVENTS = ("divergence", "halt", "lost_run", "capture_failure", "preflight")
FORMATS = ("json", "slack")
_KEYS = {"url", "format", "events", "headers", "timeout", "max_attempts", "queue_size"}
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(kw_only=True)
class WebhookConfig:
    url: str
    """http:// or https:// address the events are POSTed to."""
    format: str = "json"
    """"json": twinstep's own versioned payload (docs/alerts.md); "slack": a Slack incoming-webhook body
    ({"text": ..., "blocks": [...]}), which Mattermost, Rocket.Chat and Teams' Slack-compatible hooks take too."""
    events: tuple[str, ...] = EVENTS
    """Which events are sent (default: all of EVENTS)."""
    headers: dict[str, str] = field(default_factory=dict)
    """Extra request headers, e.g. {"Authorization": "Bearer ${TOKEN}"} (${NAME}: from the environment)."""
    timeout: float = 5.0
    """Seconds one request may take (connect, send, answer) before it counts as failed."""
    max_attempts: int = 5
    """Tries per event: retried on 5xx, 408, 429 and connection errors, with exponential backoff and jitter."""
    queue_size: int = 1000
    """Events waiting to be sent; past it the oldest waiting one is dropped (and counted)."""

    def __post_init__(self) -> None:
        parsed = urllib.parse.urlsplit(self.url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"webhook url must be an http:// or https:// address, got {self.url!r}")
        if self.format not in FORMATS:
            raise ValueError(f"webhook format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        unknown = [e for e in self.events if e not in EVENTS]
        if unknown or not self.events:
            raise ValueError(f"webhook events must be a non-empty list of {', '.join(EVENTS)}; unknown: {unknown}")
        if not self.timeout > 0:
            raise ValueError("webhook timeout must be positive")
        if self.max_attempts < 1 or self.queue_size < 1:
            raise ValueError("webhook max_attempts and queue_size must be at least 1")
        self.events = tuple(self.events)
        self.headers = {str(k): _expand(str(v), str(k)) for k, v in self.headers.items()}

    def __repr__(self) -> str:  # the url's path and the headers may hold secrets: never in logs
        return f"WebhookConfig({self.label}, format={self.format!r}, events={list(self.events)})"

    @property
    def label(self) -> str:
        """The url without its path or query (which may hold a secret, as Slack's do): for logs."""
        parsed = urllib.parse.urlsplit(self.url)
        return f"{parsed.scheme}://{parsed.netloc}"


def _expand(value: str, header: str) -> str:
    def variable(match: re.Match) -> str:
        name = match.group(1)
        if name not in os.environ:
            raise ValueError(f"webhook header {header!r} names ${{{name}}}, which is not set in the environment")
        return os.environ[name]

    return _ENV.sub(variable, value)


def webhooks_from_list(data: Any, where: str = "webhooks") -> list[WebhookConfig]:
    """Parse the config file's ``webhooks:`` list; ValueError naming the entry and option at fault."""
    if data is None:
        return []
    if not isinstance(data, list):
        raise ValueError(f"{where}: expected a list of {{url: ..., format: ...}} entries")
    out = []
    for i, entry in enumerate(data):
        at = f"{where}[{i}]"
        if isinstance(entry, str):
            entry = {"url": entry}
        if not isinstance(entry, dict):
            raise ValueError(f"{at}: expected a url or a mapping with url, format, events, headers")
        unknown = set(entry) - _KEYS
        if unknown:
            raise ValueError(f"{at}: unknown options {sorted(unknown)} (known: {sorted(_KEYS)})")
        if "url" not in entry:
            raise ValueError(f"{at}: url is required")
        kwargs: dict[str, Any] = {"url": str(entry["url"])}
        if "format" in entry:
            kwargs["format"] = str(entry["format"])
        if "events" in entry:
            events = entry["events"]
            if isinstance(events, str) or not isinstance(events, list):
                raise ValueError(f"{at}: events must be a list, e.g. [divergence, halt]")
            kwargs["events"] = tuple(str(e) for e in events)
        if "headers" in entry:
            if not isinstance(entry["headers"], dict):
                raise ValueError(f"{at}: headers must be a mapping of name: value")
            kwargs["headers"] = entry["headers"]
        for key, kind in (("timeout", float), ("max_attempts", int), ("queue_size", int)):
            if key in entry:
                try:
                    kwargs[key] = kind(entry[key])
                except (TypeError, ValueError):
                    raise ValueError(f"{at}: {key} must be a number, got {entry[key]!r}") from None
        try:
            out.append(WebhookConfig(**kwargs))
        except ValueError as exc:
            raise ValueError(f"{at}: {exc}") from None
    return out
