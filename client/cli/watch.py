"""``twinstep watch SESSION``: a session's runs, errors and alerts, live.

On a terminal, a live view (rich): per run its step, steps per second, the
steps it is behind the furthest run (twinstep.wire.progress), dropped steps and capture failures; per candidate the
worst error over tolerance of its latest compared step in each stage
(forward, loss, backward, grad, param); the first divergence once it is
declared; the latest halts and alerts.  When stdout is not a terminal (a pipe,
a log file, CI), or with ``--plain``, one line per event as before (the
format tests and scripts read: :func:`format_event`).  Once every run has
ended, one line per candidate with its own verdict (:func:`verdict_lines`):
with several candidates (three-way sessions), each has its own.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from twinstep.wire.phases import STEP_ORDER
from twinstep.wire.progress import STEPS_BEHIND, step_words, steps_behind
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep")

EXAMPLES = """\
examples:
  twinstep watch demo                              # until every run of session 'demo' has ended
  twinstep watch demo --server 10.0.0.5:50051 --follow
  twinstep watch demo --plain | tee demo.log       # one line per event (also whenever stdout is not a terminal)
  twinstep watch port --plain                      # several candidates: one VERDICT line each at the end
"""

_ENDED = ("finished", "halted", "lost")
_RATE_WINDOW = 10.0
_KEPT_NOTICES = 8
_REPORT_TIMEOUT = 10.0



def origin_words(d: pb.Divergence) -> list[str]:
    """A divergence traced back to its origin: where its error first crossed a tolerance ([] otherwise)."""
    if not d.HasField("origin"):
        return []
    if not d.HasField("crossed"):
        return [f"traced back to its origin ({d.origin.rule}, {d.origin.ratio:.0f}x a faithful floor); "
                "no tolerance crossed yet"]
    c = d.crossed
    return [f"traced back to its origin ({d.origin.rule}, {d.origin.ratio:.0f}x a faithful floor); first crossed "
            f"a tolerance at step {c.step}, {c.phase} of {c.module or '(model)'!r}: {c.metric} {c.value:.3g} > "
            f"{c.tolerance:.3g}"]

def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from twinstep.cli.main import _server_arg

    watch = subparsers.add_parser(
        "watch", help="show a session's runs, errors and alerts live",
        description="Follow a session live: progress per run, the latest error per stage, the divergence,\n"
                    "halts and alerts. A live view on a terminal; one line per event otherwise (or with --plain).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    watch.add_argument("session")
    _server_arg(watch)
    watch.add_argument("--follow", action="store_true", help="keep watching after every run has ended")
    watch.add_argument("--plain", action="store_true",
                       help="one line per event, even on a terminal (the default when stdout is not one)")
    return watch


def run(args: argparse.Namespace) -> int:
    from twinstep.cli.main import _Client

    live = not args.plain and sys.stdout.isatty()
    if live:  # before connecting: the live view needs rich; --plain needs nothing more
        from twinstep.server.extras import LIVE_VIEW, require

        require(LIVE_VIEW, "twinstep watch's live view", hint=" (or --plain: one line per event)")
    with _Client(args) as client:
        events = client.stub.Watch(pb.WatchRequest(session=args.session), metadata=client.metadata)
        if live:
            LiveView(args.session, args.server).follow(events, args.follow)
            for line in verdict_lines(args.session, _final_report(client, args.session)):
                print(line, flush=True)
            return 0
        for event in events:
            line = format_event(event)
            if line:
                print(line, flush=True)
            if not args.follow and event.WhichOneof("body") == "progress" and all_ended(event.progress):
                for line in verdict_lines(args.session, _final_report(client, args.session)):
                    print(line, flush=True)
                return 0
    return 0


def _final_report(client, session: str) -> pb.Report | None:
    """The session's report once its runs have ended (None, with a warning, when the server cannot say)."""
    import grpc

    try:
        return client.stub.GetReport(pb.ReportRequest(session=session), timeout=_REPORT_TIMEOUT,
                                     metadata=client.metadata)
    except grpc.RpcError as e:
        logger.warning("twinstep watch: no final verdict per candidate (GetReport: %s); "
                       "run `twinstep report %s` for it", e.code().name, session)
        return None


def verdict_lines(session: str, report: pb.Report | None) -> list[str]:
    """One line per candidate: its own verdict against the baseline, and where it diverged first."""
    if report is None:
        return []
    lines = []
    for c in report.candidates:
        line = f"[{session}] VERDICT candidate {c.candidate_run!r} ({c.framework}): {c.status.upper()}"
        if c.HasField("first_divergence"):
            d = c.first_divergence
            line += f" at step {d.step} {_rank_words(d)}, {d.phase} of {d.module or '(model)'!r}"
        else:
            line += f" over {c.steps_compared} compared step(s)"
        if c.halted:
            line += " (halted)"
        if c.status == "incomplete" and c.status_reasons:
            line += f": {c.status_reasons[0]}" + (f" (and {len(c.status_reasons) - 1} more)"
                                                   if len(c.status_reasons) > 1 else "")
        lines.append(line)
    return lines


def all_ended(progress: pb.Progress) -> bool:
    return len(progress.runs) >= 2 and all(r.state in _ENDED for r in progress.runs)


def format_event(event: pb.Event) -> str:
    """One line for a watch event."""
    kind = event.WhichOneof("body")
    if kind == "progress":
        runs = " | ".join(
            f"{r.name}{'*' if r.baseline else ''}"
            + (f" ({r.layout_text})" if r.layout_text and r.layout_text != "1 rank" else "")
            + f" {step_words(r.last_step)}{',' if r.last_step < 0 else ''} {r.state}"
            + (f" dropped {r.dropped}" if r.dropped else "")
            + (f" capture-failures {failures}" if (failures := capture_failures(r)) else "")
            for r in event.progress.runs
        )
        return f"[{event.session}] {runs} | compared {event.progress.steps_compared}"
    if kind == "divergence":
        d = event.divergence
        return (
            f"[{event.session}] DIVERGENCE run {d.candidate_run!r} step {d.step} {_rank_words(d)} {d.phase} "
            f"{d.module or '(model)'!r}: {d.metric} {d.value:.3g} > {d.tolerance:.3g}"
            + (f"\n[{event.session}]   merged per logical tensor: {d.merged_from}" if d.merged_from else "")
            + (f"\n[{event.session}]   stage: {d.stage}" if d.stage else "")
            + "".join(f"\n[{event.session}]   {line}" for line in origin_words(d))
            + (f"\n[{event.session}]   AFTER A GAP (earliest among compared steps; not compared: {d.gaps_summary})"
               if d.after_gap else "")
        )
    if kind == "halt":
        h = event.halt
        at = f" at step {h.at_step}" if h.at_step >= 0 else ""
        return f"[{event.session}] HALT run {h.run!r}{at}: {h.reason}"
    if kind == "alert":
        return f"[{event.session}] {event.alert.level.upper()}: {event.alert.message}"
    return ""


def capture_failures(run: pb.RunStatus) -> int:
    """Records and whole steps the run could not capture, over its ranks."""
    return sum(sum(f.count for f in h.capture.failures) + h.capture.failed_steps for h in run.health)


# -- the live view ------------------------------------------------------------------------------------


@dataclass
class _Rate:
    """Steps per second of one run over the last few seconds."""

    samples: deque = field(default_factory=lambda: deque(maxlen=64))

    def add(self, now: float, step: int) -> None:
        if step >= 0 and (not self.samples or step != self.samples[-1][1]):
            self.samples.append((now, step))
        while len(self.samples) > 2 and now - self.samples[0][0] > _RATE_WINDOW:
            self.samples.popleft()

    def per_second(self, now: float, ended: bool) -> float | None:
        if len(self.samples) < 2:
            return None
        (t0, s0), (t1, s1) = self.samples[0], self.samples[-1]
        if not ended and now - t1 > _RATE_WINDOW:
            return 0.0  # nothing new for a while
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None


class LiveView:
    """What the watcher has heard so far, drawn as one rich renderable."""

    def __init__(self, session: str, server: str) -> None:
        self.session = session
        self.server = server
        self.progress = pb.Progress()
        self.divergences: list[pb.Divergence] = []
        self.notices: deque[tuple[float, str, str]] = deque(maxlen=_KEPT_NOTICES)
        self.rates: dict[str, _Rate] = {}
        self.halted = False

    def add(self, event: pb.Event, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        kind = event.WhichOneof("body")
        if kind == "progress":
            self.progress = event.progress
            for run in event.progress.runs:
                self.rates.setdefault(run.name, _Rate()).add(now, run.last_step)
        elif kind == "divergence":
            self.divergences.append(event.divergence)
        elif kind == "halt":
            self.halted = True
            h = event.halt
            at = f" at step {h.at_step}" if h.at_step >= 0 else ""
            self.notices.append((event.time, "halt", f"run {h.run!r}{at}: {h.reason}"))
        elif kind == "alert":
            self.notices.append((event.time, event.alert.level, event.alert.message))

    def follow(self, events, follow: bool) -> int:
        from rich.console import Console
        from rich.live import Live

        console = Console()
        with Live(self.render(), console=console, refresh_per_second=4, transient=False) as live:
            for event in events:
                self.add(event)
                live.update(self.render())
                if not follow and event.WhichOneof("body") == "progress" and all_ended(event.progress):
                    return 0
        return 0

    def render(self):
        from rich.console import Group
        from rich.panel import Panel
        from rich.table import Table
        from rich.text import Text

        now = time.monotonic()
        status = "diverged" if self.divergences else "halted" if self.halted else \
            "ended" if all_ended(self.progress) else \
            "waiting" if self.progress.runs and all(r.state in _ENDED for r in self.progress.runs) else "running"
        style = {"diverged": "bold red", "halted": "bold red", "ended": "bold green"}.get(status, "bold")
        title = Text.assemble(("twinstep watch ", "bold"), (self.session, "bold cyan"), f"  {self.server}  ",
                              (status.upper(), style), f"  compared {self.progress.steps_compared} step(s)")
        parts: list = [title]

        runs = Table(expand=False, box=None, pad_edge=False, header_style="bold")
        for column in ("run", "role", "state", "step", "steps/s", STEPS_BEHIND, "dropped", "capture failures", "layout"):
            runs.add_column(column, justify="left" if column in ("run", "role", "state", "layout") else "right")
        behind = steps_behind([r.last_step for r in self.progress.runs])
        for r, lag in zip(self.progress.runs, behind):
            role = "baseline" if r.baseline else "reference" if r.reference else "candidate"
            rate = self.rates.get(r.name, _Rate()).per_second(now, r.state in _ENDED)
            state_style = {"streaming": "green", "finished": "", "halted": "red", "lost": "bold red"}.get(r.state, "")
            dropped = ", ".join(f"{n} {why}" for why, n in sorted(r.dropped_by_reason.items())) or str(r.dropped)
            failures = capture_failures(r)
            runs.add_row(r.name, role, Text(r.state, style=state_style),
                         str(r.last_step) if r.last_step >= 0 else step_words(r.last_step),
                         "-" if rate is None else f"{rate:.1f}", "-" if lag is None else str(lag),
                         Text(dropped, style="yellow" if r.dropped else ""),
                         Text(str(failures), style="yellow" if failures else ""), r.layout_text or f"{r.ranks} rank(s)")
        parts.append(Panel(runs, title="runs", title_align="left"))

        if self.progress.stages:
            stages = Table(expand=False, box=None, pad_edge=False, header_style="bold")
            stages.add_column("run")
            stages.add_column("step", justify="right")
            for phase in STEP_ORDER:
                stages.add_column(phase, justify="right")
            stages.add_column("worst")
            by_run: dict[str, dict[str, pb.StageError]] = {}
            for stage in self.progress.stages:
                by_run.setdefault(stage.run, {})[stage.phase] = stage
            for run, found in by_run.items():
                worst = max(found.values(), key=lambda s: s.ratio)
                cells = [_ratio_text(found[p].ratio) if p in found else Text("-", style="dim") for p in STEP_ORDER]
                stages.add_row(run, str(worst.step), *cells,
                               f"{worst.phase} {worst.module or '(model)'} ({worst.metric})")
            parts.append(Panel(stages, title="latest error / tolerance per stage (above 1: beyond tolerance)",
                               title_align="left"))

        for d in self.divergences:
            text = Text.assemble(
                (f"run {d.candidate_run!r} step {d.step} {_rank_words(d)}: ", "bold"),
                f"{d.phase} of {d.module or '(model)'!r}",
                f" (candidate {d.candidate_module!r})" if d.candidate_module and d.candidate_module != d.module else "",
                f"\n{d.metric} {d.value:.3g} > tolerance {d.tolerance:.3g}",
                f"\nmerged per logical tensor: {d.merged_from}" if d.merged_from else "",
                f"\nstage: {d.stage}" if d.stage else "",
                "".join(f"\n{line}" for line in origin_words(d)),
                (f"\nafter a gap: not compared {d.gaps_summary}", "yellow") if d.after_gap else "")
            parts.append(Panel(text, title="DIVERGENCE", title_align="left", border_style="red"))

        if self.notices:
            notes = Text()
            for i, (when, level, message) in enumerate(self.notices):
                clock = time.strftime("%H:%M:%S", time.localtime(when)) if when else "--:--:--"
                colour = {"halt": "bold red", "error": "red", "warning": "yellow"}.get(level, "")
                notes.append(("\n" if i else "") + f"{clock} ")
                notes.append(f"{level.upper()}: {message}", style=colour)
            parts.append(Panel(notes, title="halts and alerts", title_align="left"))
        return Group(*parts)


def _ratio_text(ratio: float):
    from rich.text import Text

    label = "inf" if math.isinf(ratio) else f"{ratio:.2g}"
    style = "bold red" if ratio > 1 else "yellow" if ratio > 0.5 else "green"
    return Text(label, style=style)


def _rank_words(d) -> str:
    """"rank 3", or "every rank merged" when the runs' layouts differ and their ranks were merged."""
    return "every rank merged" if d.merged_from else f"rank {d.rank}"
