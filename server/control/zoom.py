"""Live capture control of one session: zoom windows, auto-zoom after a divergence, bundles on halt.

A zoom tells every run to capture some modules differently over a window of
steps (full tensors instead of statistics, say), from one step on, the same
step on every rank of every run.  That step is chosen ahead of every rank
(:mod:`twinstep.server.control.steps`), so each gets the command before it
gets there; a run that joins later is told on joining.  Three things ask
for one:

- an operator, through the Zoom RPC (``twinstep zoom``);
- the session itself after a divergence it does not halt on, with
  ``auto_zoom``: the divergent module and its neighbours (parent, siblings,
  children) in full tensors for ``auto_zoom_steps`` steps, the rest in
  statistics;
- a halt on a divergence with ``bundle_on_halt``: every run writes a
  reproducer bundle of the divergent module at the zoom's step, and halts
  at the end of that step;
- the session after a divergence whose culprit is a module's own code, with
  ``auto_ops``: every run captures that module's operations in one call at
  one step (``ops_module``), and server/ops names the first that differs.

The windows are the session's state (:class:`ZoomWindows`, kept by its core,
which names each run's modules and queues the commands); this coordinator
asks the runs where they are and decides when.  Step queries are awaited on
the asking thread (the RPC's, or a thread of its own for the session's
decisions), never under the session's lock.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import grpc

from twinstep.server.control import names as module_names
from twinstep.server.control.steps import StepQuery
from twinstep.server.connection import Connection
from twinstep.server.report.zoom import what_words
from twinstep.v1 import twinstep_pb2 as pb

if TYPE_CHECKING:
    from twinstep.server.detect.first_divergence import Candidate
    from twinstep.server.session import Session
    from twinstep.server.session.core import SessionCore

PerRun = Callable[["SessionCore", str, pb.ZoomSpec], pb.ZoomSpec]
"""A window in one run's own names, from the session's state (called by the core, under the session's lock)."""

logger = logging.getLogger("twinstep.server")

CAPTURES = ("tensors", "lossy", "stats")
#: Windows one session remembers (the report lists them; a joining run is told the ones not yet over).
MAX_WINDOWS = 256
MAX_STEPS = 100_000
_MAX_PATTERNS = 64
_MAX_TEXT = 1000
_MAX_STEP = 1 << 53


class ZoomRefused(Exception):
    """A zoom request that cannot be carried out: a status code and what to do instead."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Window:
    spec: pb.ZoomSpec
    origin: str
    per_run: dict[str, pb.ZoomSpec] = field(default_factory=dict)
    runs: list[str] = field(default_factory=list)
    """The runs told (those with an open stream then)."""
    state: str = "sent"
    """"sent", or why it was not ("not asked: ...")."""
    captured: dict[str, list[int]] = field(default_factory=dict)
    """Per run: the first and last step it delivered carrying what the window asked."""

    def asked_by(self, step: int) -> bool:
        """``step`` is one of the window's (within it, on its cadence)."""
        spec = self.spec
        return spec.first_step <= step <= spec.last_step and (step - spec.first_step) % max(spec.every, 1) == 0

    def carried(self, tensors: bool, ops_zoom: int) -> bool:
        """A step of the window carried what it asked: full tensors, or this window's operations."""
        spec = self.spec
        if spec.ops_module and ops_zoom == spec.id:
            return True
        if spec.capture in ("tensors", "lossy") and spec.modules:
            return tensors
        return not spec.ops_module  # statistics or sketches: any step of the window


class ZoomWindows:
    """The zoom windows one session remembers (state only: its core holds them)."""

    def __init__(self) -> None:
        self._windows: list[Window] = []
        self._next_id = 1

    def open(self, spec: pb.ZoomSpec, origin: str) -> Window:
        """Number ``spec`` and keep it (the latest MAX_WINDOWS)."""
        spec.id = self._next_id
        self._next_id += 1
        window = Window(spec=spec, origin=origin)
        self._windows.append(window)
        del self._windows[:-MAX_WINDOWS]
        return window

    def not_asked(self, spec: pb.ZoomSpec, origin: str, why: str) -> Window:
        """Keep a window the session decided on but did not ask of any run (the report says why)."""
        window = self.open(spec, origin)
        window.state = f"not asked: {why}"
        return window

    def delivered(self, run: str, step: int, tensors: bool, ops_zoom: int) -> None:
        """``run`` delivered ``step`` (with full tensors, with the operations ``ops_zoom`` asked): note the
        windows it ran."""
        for window in self._windows:
            if (window.state == "sent" and run in window.per_run and window.asked_by(step)
                    and window.carried(tensors, ops_zoom)):
                seen = window.captured.setdefault(run, [step, step])
                seen[0], seen[1] = min(seen[0], step), max(seen[1], step)

    def told_to(self, run: str) -> list[pb.ZoomSpec]:
        """What a stream of ``run`` that joins now is told: the run's recent windows."""
        return [spec for spec in (w.per_run.get(run) for w in self._windows[-16:]) if spec is not None]

    def to_proto(self) -> list[pb.ZoomWindow]:
        return [pb.ZoomWindow(spec=w.spec, origin=w.origin, runs=w.runs, state=w.state,
                              captured=[pb.ZoomCapture(run=run, first_step=first, last_step=last)
                                        for run, (first, last) in w.captured.items()])
                for w in self._windows]


def zoom_command(spec: pb.ZoomSpec) -> pb.ServerMessage:
    return pb.ServerMessage(command=pb.Command(kind=pb.Command.ZOOM, zoom=spec, reason=spec.reason,
                                               at_step=spec.first_step))


def told_alert(spec: pb.ZoomSpec, origin: str, runs: list[str]) -> pb.Event:
    """The watchers' line for a window told."""
    steps = (f"step {spec.first_step}" if spec.first_step == spec.last_step
             else f"steps {spec.first_step}-{spec.last_step}")
    bundle = f", a reproducer bundle of {spec.bundle_module!r}" if spec.bundle_module else ""
    if spec.ops_module and spec.modules:
        bundle += f", the operations of {spec.ops_module!r}"
    return pb.Event(alert=pb.AlertNotice(level="info", message=(
        f"zoom #{spec.id} ({origin}): {what_words(spec)}, {steps}{bundle}; told: {', '.join(runs) or 'no run'}")))


def not_asked_alert(window: Window) -> pb.Event:
    """The watchers' line for a window the session decided on and did not ask (window.state says why)."""
    return pb.Event(alert=pb.AlertNotice(level="info", message=(
        f"zoom #{window.spec.id} ({window.origin}): {what_words(window.spec)}: {window.state}")))


class ZoomCoordinator:
    """How a session's zoom windows are chosen: step queries to the runs, on the asking thread or one of its own."""

    def __init__(self, session: str, timeout: float) -> None:
        self.session = session
        self.steps = StepQuery(timeout)

    # -- asked by an operator ---------------------------------------------------------------

    def request(self, session: "Session", request: pb.ZoomRequest) -> pb.ZoomResponse:
        """Carry out a Zoom RPC: raises ZoomRefused with the code and the reason."""
        patterns = list(request.modules)
        if not patterns and not request.ops_module:
            raise ZoomRefused(grpc.StatusCode.INVALID_ARGUMENT, "which modules? give --module PATTERN (a glob over "
                              "the baseline's module names, '' is the whole model) or --ops MODULE")
        if len(request.ops_module) > _MAX_TEXT or any(c in request.ops_module for c in "*?["):
            raise ZoomRefused(grpc.StatusCode.INVALID_ARGUMENT, "--ops takes one module's exact name (the baseline's, "
                              "e.g. layers.0.attn), not a pattern")
        if len(patterns) > _MAX_PATTERNS or any(len(p) > _MAX_TEXT for p in patterns) or len(request.reason) > _MAX_TEXT:
            raise ZoomRefused(grpc.StatusCode.INVALID_ARGUMENT, f"at most {_MAX_PATTERNS} module patterns and a "
                              f"reason, each of at most {_MAX_TEXT} characters")
        capture = request.capture or "tensors"
        if capture not in CAPTURES:
            raise ZoomRefused(grpc.StatusCode.INVALID_ARGUMENT, f"capture must be one of {', '.join(CAPTURES)}, "
                              f"got {capture!r}")
        steps, every = request.steps or 1, request.every or 1
        if steps > MAX_STEPS or every > steps:
            raise ZoomRefused(grpc.StatusCode.INVALID_ARGUMENT, f"steps must be 1 to {MAX_STEPS} and every at most "
                              f"steps; got steps {steps}, every {every}")
        bundle = ""
        if request.bundle:
            if len(patterns) != 1 or not patterns[0] or any(c in patterns[0] for c in "*?["):
                raise ZoomRefused(grpc.StatusCode.INVALID_ARGUMENT, "a bundle is of one module: give its exact "
                                  "name once (--module layers.1.mlp.act), not a pattern nor the whole model")
            bundle = patterns[0]
        if request.HasField("from_step") and not 0 <= request.from_step < _MAX_STEP:
            raise ZoomRefused(grpc.StatusCode.INVALID_ARGUMENT, f"from_step must be from 0 to {_MAX_STEP - 1}, "
                              f"got {request.from_step}")
        conns = session.open_streams()
        if not conns:
            raise ZoomRefused(grpc.StatusCode.FAILED_PRECONDITION, f"no run of session {self.session!r} is "
                              "streaming: a zoom changes what running trainings capture")
        reach = self.steps.reach([c for c, _ in conns])
        first = reach.earliest
        if request.HasField("from_step"):
            if request.from_step < reach.earliest:
                raise ZoomRefused(grpc.StatusCode.FAILED_PRECONDITION, (
                    f"step {request.from_step} is too close: the furthest rank is at step {reach.furthest}, so "
                    f"step {reach.earliest} is the earliest every rank can still apply a zoom at; ask for a later "
                    "step, or leave --from-step out to get the earliest"))
            first = request.from_step
        spec = pb.ZoomSpec(modules=patterns, capture=capture, sketch=request.sketch, every=every, first_step=first,
                           last_step=first + steps - 1, bundle_module=bundle, divergent_step=-1,
                           reason=request.reason or "asked by an operator", ops_module=request.ops_module)
        window = session.tell_zoom(spec, "operator", _operator_spec)
        logger.info("session %s: zoom #%d %s in %s, steps %d-%d%s (runs %s)", self.session, window.spec.id,
                    ", ".join(patterns), capture, spec.first_step, spec.last_step,
                    f", bundle of {bundle!r}" if bundle else "", ", ".join(window.runs))
        return pb.ZoomResponse(first_step=spec.first_step, last_step=spec.last_step, runs=window.runs,
                               id=window.spec.id)

    # -- the session's own decisions ------------------------------------------------------------

    def after_divergence(self, session: "Session", found: "Candidate", steps: int) -> None:
        """auto_zoom: full tensors of the divergent module and its neighbours, on a thread of its own."""
        threading.Thread(target=self._safely, args=(self._auto, session, found, steps),
                         name="twinstep-auto-zoom", daemon=True).start()

    def ops_after_divergence(self, session: "Session", found: "Candidate", module: str, candidate_module: str) -> None:
        """auto_ops: every run captures ``module``'s operations at one step all can reach, on a thread of its own."""
        threading.Thread(target=self._safely, args=(self._auto_ops, session, found, module, candidate_module),
                         name="twinstep-auto-ops", daemon=True).start()

    def _auto_ops(self, session: "Session", found: "Candidate", module: str, candidate_module: str) -> None:
        comparison = found.comparison
        spec = pb.ZoomSpec(capture="tensors", every=1, first_step=-1, last_step=-1, ops_module=module,
                           divergent_step=comparison.step,
                           reason=f"auto_ops: divergence at step {comparison.step} in the code of {module!r}")
        why = _why_not(session, found)
        if why is not None:
            window = session.skip_zoom(spec, "auto-ops", why)
            logger.info("session %s: auto_ops #%d after the divergence at step %d: %s", self.session, window.spec.id,
                        comparison.step, window.state)
            return
        conns = session.open_streams()
        at_step = self.steps.reach([c for c, _ in conns]).earliest
        spec.first_step = spec.last_step = at_step

        def per_run(core: "SessionCore", run: str, spec: pb.ZoomSpec) -> pb.ZoomSpec:
            out = pb.ZoomSpec()
            out.CopyFrom(spec)
            out.ops_module = (candidate_module if run == comparison.candidate_run
                              else _candidate_name(core, run, module))
            return out

        window = session.tell_zoom(spec, "auto-ops", per_run)
        logger.info("session %s: auto_ops #%d after the divergence at step %d: the operations of %r at step %d (%s)",
                    self.session, window.spec.id, comparison.step, module, at_step, _runs_words(window.runs))

    def halt_with_bundle(self, session: "Session", found: "Candidate", reason: str) -> None:
        """bundle_on_halt: every run writes a bundle of the divergent module, then halts (the session decided, once)."""
        threading.Thread(target=self._safely, args=(self._bundle_and_halt, session, found, reason),
                         name="twinstep-bundle-halt", daemon=True).start()

    def _auto(self, session: "Session", found: "Candidate", steps: int) -> None:
        row, comparison = found.row, found.comparison
        base_module = module_names.module_of(row.phase, row.name)
        spec = pb.ZoomSpec(capture="tensors", every=1, first_step=-1, last_step=-1, divergent_step=comparison.step,
                           reason=f"auto_zoom: divergence at step {comparison.step}, {row.phase} of "
                                  f"{row.name or 'the whole model'!r}")
        baseline = session.baseline or ""
        spec.modules.extend(module_names.escape(n) for n in module_names.neighbourhood(
            base_module, session.module_names(baseline))[:module_names.MAX_NAMES])
        why = _why_not(session, found)
        if why is not None:
            window = session.skip_zoom(spec, "auto", why)
            logger.info("session %s: auto_zoom #%d after the divergence at step %d: %s", self.session, window.spec.id,
                        comparison.step, window.state)
            return
        reach = self.steps.reach([c for c, _ in session.open_streams()])
        spec.first_step, spec.last_step = reach.earliest, reach.earliest + max(steps, 1) - 1

        def per_run(core: "SessionCore", run: str, spec: pb.ZoomSpec) -> pb.ZoomSpec:
            own = _run_module(core, run, base_module, found)
            names = _module_names(core, run)
            out = pb.ZoomSpec()
            out.CopyFrom(spec)
            out.ClearField("modules")
            out.modules.extend(module_names.escape(n) for n in module_names.neighbourhood(own, names)
                               [:module_names.MAX_NAMES])
            return out

        window = session.tell_zoom(spec, "auto", per_run)
        logger.info("session %s: auto_zoom #%d after the divergence at step %d: %s in full tensors, steps %d-%d (%s)",
                    self.session, window.spec.id, comparison.step,
                    ", ".join(m or "the whole model" for m in spec.modules), spec.first_step, spec.last_step,
                    _runs_words(window.runs))

    def _bundle_and_halt(self, session: "Session", found: "Candidate", reason: str) -> None:
        at_step = None
        try:
            at_step = self._tell_bundles(session, found)
        finally:  # whatever became of the bundles, the session halts
            if at_step is not None:
                reason += (f"; each run writes a reproducer bundle of the divergent module at step {at_step} "
                           "(twinstep reproduce)")
            session.halt(reason, at_step=at_step)

    def _tell_bundles(self, session: "Session", found: "Candidate") -> int | None:
        """Tell every run to write a bundle at a step all ranks can reach; that step (None: no bundle)."""
        row, comparison = found.row, found.comparison
        base_module = module_names.module_of(row.phase, row.name)
        conns = session.open_streams() if base_module else []  # a loss divergence has no module to bundle
        if not conns:
            return None
        at_step = self.steps.reach([c for c, _ in conns]).earliest
        spec = pb.ZoomSpec(modules=[module_names.escape(base_module)], capture="tensors", every=1,
                           first_step=at_step, last_step=at_step, bundle_module=base_module,
                           divergent_step=comparison.step,
                           reason=f"reproducer bundle of the divergence at step {comparison.step}")

        def per_run(core: "SessionCore", run: str, spec: pb.ZoomSpec) -> pb.ZoomSpec:
            own = _run_module(core, run, base_module, found)
            out = pb.ZoomSpec()
            out.CopyFrom(spec)
            out.ClearField("modules")
            out.modules.append(module_names.escape(own))
            out.bundle_module = own
            return out

        session.tell_zoom(spec, "halt", per_run)
        return at_step

    def ack(self, conn: Connection, ack: pb.HaltAck) -> bool:
        """An answer to a step query (True), or to something else (a halt's)."""
        return self.steps.ack(ack, conn.stream_id)

    def _safely(self, job: Callable[..., None], *args: object) -> None:
        try:
            job(*args)
        except Exception:  # a background decision must not die silently, nor take the session with it
            logger.exception("session %s: live capture control failed", self.session)


# -- a window in each run's own names (called by the session core, under its coordinator's lock) ----------


def _operator_spec(core: "SessionCore", run: str, spec: pb.ZoomSpec) -> pb.ZoomSpec:
    """An operator's patterns, in a run's own names (see names.for_candidate)."""
    state = core.runs[run]
    if state.reference:
        return spec
    mapping = _mapping(core, run)
    out = pb.ZoomSpec()
    out.CopyFrom(spec)
    out.ClearField("modules")
    out.modules.extend(module_names.for_candidate(list(spec.modules), _module_names(core, run), mapping.to_baseline))
    if spec.bundle_module:
        out.bundle_module = _candidate_name(core, run, spec.bundle_module)
    if spec.ops_module:
        out.ops_module = _candidate_name(core, run, spec.ops_module)
    return out


def _module_names(core: "SessionCore", run: str) -> list[str]:
    return core.module_names(run)


def _mapping(core: "SessionCore", run: str):
    state = core.runs[run]
    rank = min(state.ranks) if state.ranks else 0
    manifest = state.ranks[rank].manifest if state.ranks else None
    if manifest is None:
        return core.mappings.user
    return core.mappings.for_run(run, rank, lambda: {n: t for n, t in manifest.modules.values()},
                                 len(manifest.modules))


def _candidate_name(core: "SessionCore", run: str, base_name: str) -> str:
    """The run's module its mapping pairs with the baseline's ``base_name`` (the same name when none does)."""
    mapping = _mapping(core, run)
    for name in _module_names(core, run):
        if mapping.to_baseline(name) == base_name:
            return name
    return base_name


def _run_module(core: "SessionCore", run: str, base_module: str, found: "Candidate") -> str:
    """The divergent module in ``run``'s own names."""
    state = core.runs.get(run)
    if state is None or state.baseline or state.reference:
        return base_module
    if run == found.comparison.candidate_run and found.row.candidate_name:
        return module_names.module_of(found.row.phase, found.row.candidate_name)
    return _candidate_name(core, run, base_module)


def _why_not(session: "Session", found: "Candidate") -> str | None:
    """Why a zoom after ``found`` would bring nothing to compare: its candidate or the baseline no longer streams."""
    streaming = {run for _, run in session.open_streams()}
    candidate, baseline = found.comparison.candidate_run, session.baseline or ""
    gone = [run for run in (candidate, baseline) if run not in streaming]
    if not gone:
        return None
    names = " and ".join(f"the baseline {run!r}" if run == baseline else f"run {run!r}" for run in gone)
    after = " and ".join(str(session.last_step(run)) for run in gone)
    return (f"{names} had ended (after step{'s' if len(gone) > 1 else ''} {after}) before the divergence was declared, "
            f"so no step of {'them' if len(gone) > 1 else 'it'} could be captured")


def _runs_words(runs: list[str] | tuple[str, ...]) -> str:
    """"runs a, b", or why none was told (every run had ended before the window was opened)."""
    return f"runs {', '.join(runs)}" if runs else "no run still streaming: every run had ended"
