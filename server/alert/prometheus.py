"""Prometheus metrics of the sessions a server holds, read on each scrape.

Nothing is counted twice: a custom collector reads each session's own state
(the same rows the report and the watchers' progress are built from) under
that session's lock, one session at a time and briefly, so a scrape never
holds up ingest for longer than one session's status takes to copy.

Names follow Prometheus conventions: the ``twinstep_`` prefix, ``_total`` on
counters, base units (bytes, seconds; steps and records are counts). Labels
are the session and run names and small bounded sets (reason, state, status,
role); never modules or steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest, make_asgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from twinstep.server.alert.webhooks import WebhookDispatcher
from twinstep.server.registry import SessionRegistry
from twinstep.server.session import Session
from twinstep.wire.progress import steps_behind

#: Run states and session verdicts, exported as one gauge per value (1 for the current one) so alert
#: rules can match on them; both sets are fixed by the server.
RUN_STATES = ("streaming", "finished", "halted", "lost")
SESSION_STATUSES = ("running", "diverged", "aligned", "incomplete", "waiting")
#: Drop reasons come from clients; past this many distinct ones per run the rest count as "other",
#: so a misbehaving client cannot grow the label set without bound.
MAX_DROP_REASONS = 16
_MAX_LABEL = 128


@dataclass
class _RunRow:
    """One run's numbers, copied under its session's lock."""

    name: str
    role: str
    framework: str
    state: str
    ranks: int
    last_step: int
    steps_received: int
    records_received: int
    steps_resent: int
    dropped: dict[str, int]
    capture_failed_steps: int
    capture_failed_records: int
    bytes_captured: int
    bytes_read: int
    steps_compared: int | None  # None: the baseline compares nothing itself
    diverged: bool
    preflight_warnings: int = 0  # set-up differences from the baseline that can change the numerics


@dataclass
class _SessionRow:
    name: str
    status: str
    halted: bool
    steps_compared: int
    held_bytes: int
    runs: list[_RunRow] = field(default_factory=list)


def read_session(session: Session) -> _SessionRow:
    """Copy what the metrics say of ``session``, at one moment (the Progress path's rows)."""
    view = session.metrics_view()
    rows, steps_received, declared = view.runs, view.steps_received, view.diverged
    preflight, compared = view.preflight_warnings, view.steps_compared_by
    out = _SessionRow(name=view.name, status=view.status, halted=view.halted, steps_compared=view.steps_compared,
                      held_bytes=view.held_bytes)
    for row in rows:
        role = "baseline" if row.baseline else "reference" if row.reference else "candidate"
        out.runs.append(_RunRow(
            name=row.name, role=role, framework=row.framework, state=row.state, ranks=row.ranks,
            last_step=row.last_step, steps_received=steps_received.get(row.name, 0),
            records_received=row.records_received, steps_resent=row.steps_resent,
            dropped=_bounded_reasons(dict(row.dropped_by_reason)),
            capture_failed_steps=sum(h.capture.failed_steps for h in row.health),
            capture_failed_records=sum(f.count for h in row.health for f in h.capture.failures),
            bytes_captured=row.capture_cost.bytes_captured, bytes_read=row.capture_cost.bytes_read,
            steps_compared=compared.get(row.name), diverged=row.name in declared,
            preflight_warnings=preflight.get(row.name, 0),
        ))
    return out


def _bounded_reasons(dropped: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for reason in sorted(dropped):
        key = reason[:_MAX_LABEL] if len(out) < MAX_DROP_REASONS - 1 or reason in out else "other"
        out[key] = out.get(key, 0) + dropped[reason]
    return out


class SessionCollector(Collector):
    """Reads every session of a registry on each scrape (no state of its own besides its timing)."""

    def __init__(self, registry: SessionRegistry, webhooks: WebhookDispatcher | None = None) -> None:
        self._registry = registry
        self._webhooks = webhooks

    def describe(self) -> Iterable[Metric]:
        return []  # unchecked: the families depend on what sessions hold at scrape time

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        rows = []
        for name in self._registry.names():
            session = self._registry.get(name)
            if session is not None:
                rows.append(read_session(session))
        families = _families(rows, self._registry.config.memory.budget_bytes)
        collect = GaugeMetricFamily("twinstep_metrics_collect_seconds",
                                    "Time this scrape took to read the sessions (their locks held one at a time)")
        collect.add_metric([], time.perf_counter() - started)
        yield from families
        if self._webhooks is not None:
            yield from _webhook_families(self._webhooks)
        yield collect


def _families(rows: list[_SessionRow], budget: int) -> list[Metric]:
    s, r = ["session"], ["session", "run"]
    sessions = GaugeMetricFamily("twinstep_sessions", "Sessions held in memory by this server")
    sessions.add_metric([], len(rows))
    held = GaugeMetricFamily("twinstep_server_held_bytes",
                             "Bytes of steps held for alignment, over every session in memory")
    held.add_metric([], sum(row.held_bytes for row in rows))
    budget_family = GaugeMetricFamily("twinstep_server_memory_budget_bytes",
                                      "memory_budget_bytes: past it, held steps of ended sessions are freed")
    budget_family.add_metric([], budget)

    status = GaugeMetricFamily("twinstep_session_status", "1 for the session's current verdict", labels=[*s, "status"])
    halts = CounterMetricFamily("twinstep_session_halts", "Halts of the session's runs (a session halts once)",
                                labels=s)
    compared = CounterMetricFamily("twinstep_session_steps_compared",
                                   "Steps compared on every rank, for the candidate that got furthest", labels=s)
    session_held = GaugeMetricFamily("twinstep_session_held_bytes", "Bytes of steps this session holds for alignment",
                                     labels=s)

    info = GaugeMetricFamily("twinstep_run_info", "1 per run; its role and framework as labels",
                             labels=[*r, "role", "framework"])
    state = GaugeMetricFamily("twinstep_run_state", "1 for the run's current state", labels=[*r, "state"])
    ranks = GaugeMetricFamily("twinstep_run_ranks", "Ranks (world size) the run declared", labels=r)
    last_step = GaugeMetricFamily("twinstep_run_last_step", "Highest step received from the run (-1: none yet)",
                                  labels=r)
    lag = GaugeMetricFamily("twinstep_run_lag_steps", "Steps this run is behind the session's furthest run "
                            "(absent before its first step)",
                            labels=r)
    steps = CounterMetricFamily("twinstep_run_steps_received", "Steps received, summed over the run's ranks",
                                labels=r)
    records = CounterMetricFamily("twinstep_run_records_received", "Records received, summed over the run's ranks",
                                  labels=r)
    resent = CounterMetricFamily("twinstep_run_steps_resent",
                                 "Steps sent again after a reconnect that the server already held (skipped)", labels=r)
    dropped = CounterMetricFamily("twinstep_run_dropped_steps",
                                  "Steps lost on the client or this server, by reason", labels=[*r, "reason"])
    failed_steps = CounterMetricFamily("twinstep_run_capture_failed_steps",
                                       "Steps whose capture failed as a whole on the client", labels=r)
    failed_records = CounterMetricFamily("twinstep_run_capture_failed_records",
                                         "Records (module or parameter) the client could not capture", labels=r)
    captured = CounterMetricFamily("twinstep_run_captured_bytes", "Bytes capture produced for the run", labels=r)
    read = CounterMetricFamily("twinstep_run_capture_read_bytes", "Bytes of tensors capture read for the run",
                               labels=r)
    run_compared = CounterMetricFamily("twinstep_run_steps_compared",
                                       "Steps of this candidate (or reference) compared on at least one rank", labels=r)
    divergences = CounterMetricFamily("twinstep_run_divergences",
                                      "First divergences declared for this candidate (0 or 1)", labels=r)
    preflight = GaugeMetricFamily("twinstep_run_preflight_warnings",
                                  "Differences of this candidate's training set-up from the baseline's that can "
                                  "change the numerics (docs/preflight.md)", labels=r)

    for row in rows:
        for value in SESSION_STATUSES:
            status.add_metric([row.name, value], float(row.status == value))
        halts.add_metric([row.name], float(row.halted))
        compared.add_metric([row.name], row.steps_compared)
        session_held.add_metric([row.name], row.held_bytes)
        behind = steps_behind([run.last_step for run in row.runs])  # as the dashboard and `twinstep watch` say it
        for run, lagging in zip(row.runs, behind):
            labels = [row.name, run.name]
            info.add_metric([*labels, run.role, run.framework], 1)
            for value in RUN_STATES:
                state.add_metric([*labels, value], float(run.state == value))
            ranks.add_metric(labels, run.ranks)
            last_step.add_metric(labels, run.last_step)
            if lagging is not None:  # no step yet: behind by no number
                lag.add_metric(labels, lagging)
            steps.add_metric(labels, run.steps_received)
            records.add_metric(labels, run.records_received)
            resent.add_metric(labels, run.steps_resent)
            for reason, count in run.dropped.items():
                dropped.add_metric([*labels, reason], count)
            failed_steps.add_metric(labels, run.capture_failed_steps)
            failed_records.add_metric(labels, run.capture_failed_records)
            captured.add_metric(labels, run.bytes_captured)
            read.add_metric(labels, run.bytes_read)
            if run.steps_compared is not None:
                run_compared.add_metric(labels, run.steps_compared)
                divergences.add_metric(labels, float(run.diverged))
                preflight.add_metric(labels, run.preflight_warnings)
    return [sessions, held, budget_family, status, halts, compared, session_held, info, state, ranks, last_step, lag,
            steps, records, resent, dropped, failed_steps, failed_records, captured, read, run_compared, divergences,
            preflight]


def _webhook_families(webhooks: WebhookDispatcher) -> list[Metric]:
    labels = ["receiver"]  # scheme://host:port of each configured receiver (never its path: it may hold a secret)
    deliveries = CounterMetricFamily("twinstep_webhook_deliveries", "Webhook events sent, or given up after retries",
                                     labels=[*labels, "outcome"])
    retries = CounterMetricFamily("twinstep_webhook_retries", "Webhook requests tried again (5xx, 408, 429, "
                                  "connection errors, timeouts)", labels=labels)
    dropped = CounterMetricFamily("twinstep_webhook_dropped", "Webhook events never tried: queue_full or shutdown",
                                  labels=[*labels, "reason"])
    queued = GaugeMetricFamily("twinstep_webhook_queued", "Webhook events waiting to be sent", labels=labels)
    for receiver in webhooks.receivers:
        counts = receiver.counts()
        label = receiver.name
        deliveries.add_metric([label, "sent"], counts["sent"])
        deliveries.add_metric([label, "failed"], counts["failed"])
        retries.add_metric([label], counts["retries"])
        for reason, count in counts["dropped"].items():
            dropped.add_metric([label, reason], count)
        queued.add_metric([label], counts["queued"])
    return [deliveries, retries, dropped, queued]


def metrics_registry(registry: SessionRegistry, webhooks: WebhookDispatcher | None = None) -> CollectorRegistry:
    """A dedicated CollectorRegistry holding only this server's metrics (no process globals)."""
    collectors = CollectorRegistry(auto_describe=False)
    collectors.register(SessionCollector(registry, webhooks))
    return collectors


def make_metrics_app(registry: SessionRegistry, webhooks: WebhookDispatcher | None = None) -> Callable:
    """An ASGI app answering Prometheus scrapes with the metrics of ``registry``'s sessions.

    ``webhooks`` (ServerHandle.webhooks) adds the webhook senders' counters.
    """
    return make_asgi_app(registry=metrics_registry(registry, webhooks))


def collect_text(registry: SessionRegistry, webhooks: WebhookDispatcher | None = None) -> bytes:
    """One scrape in the text exposition format (for tests and tools)."""
    return generate_latest(metrics_registry(registry, webhooks))
