"""Live capture control on the training side: the zoom windows the server sent, applied at their steps.

The server sends a zoom (Command ZOOM) for a step ahead of every rank; the
sender thread hands it here, and the training thread reads it at each step
boundary: which steps are captured (a window's cadence adds steps the run's
own ``every`` skips), and, for the step starting, which modules' records carry
full tensors or sketches (:class:`StepZoom`, read by the recorder's hooks).
A zoom that arrives after its first step has begun applies from the next
step, with one warning; the server's report shows the steps that really
carried full tensors.  A window's ``bundle_module`` asks for a reproducer
bundle of that module at the window's first step (twinstep.tools.reproduce); its
``ops_module``, that module's operations in its first call of that step
(twinstep.runtime.capture.ops).

What a run attached with ``capture="stats"`` can switch to: full tensors
(lossless: a stats run has no error budget, so "lossy" is sent lossless) and
sketches, carried by its thread sender; host buffers are allocated the first
time.  Only modules that attach hooks (its ``include``/``exclude``) can be
zoomed.
"""

from __future__ import annotations

import fnmatch
import logging
import threading
from typing import Any, Callable

from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep")

#: Windows a run keeps (the newest); older ones are forgotten.
MAX_WINDOWS = 64


class StepZoom:
    """What one step captures beyond attach's settings, per module name (the recorder asks per record)."""

    def __init__(self, windows: list[pb.ZoomSpec]) -> None:
        self.tensor_patterns = tuple(p for w in windows if w.capture in ("tensors", "lossy") for p in w.modules)
        self.sketch_patterns = tuple(p for w in windows if w.sketch for p in w.modules)
        self._cache: dict[str, tuple[bool, bool]] = {}

    @property
    def wants_tensors(self) -> bool:
        return bool(self.tensor_patterns)

    @property
    def wants_sketches(self) -> bool:
        return bool(self.sketch_patterns)

    def _lookup(self, module: str) -> tuple[bool, bool]:
        found = self._cache.get(module)
        if found is None:
            found = (any(fnmatch.fnmatchcase(module, p) for p in self.tensor_patterns),
                     any(fnmatch.fnmatchcase(module, p) for p in self.sketch_patterns))
            self._cache[module] = found
        return found

    def tensors(self, module: str) -> bool:
        """The records of ``module`` (a parameter: its owner) carry full tensors this step."""
        return self._lookup(module)[0]

    def sketch(self, module: str) -> bool:
        return self._lookup(module)[1]


def zoom_words(spec: pb.ZoomSpec) -> str:
    """What a window asks of this run, at which steps, and who asked, in words for the training's log:
    "full tensors of the whole model at step 12, asked by the server after the divergence at step 3"."""
    modules = ", ".join(m or "the whole model" for m in spec.modules[:8]) + \
        (f" and {len(spec.modules) - 8} more" if len(spec.modules) > 8 else "")
    what = []
    if spec.modules:
        kind = "full tensors" if spec.capture in ("tensors", "lossy") else "sketches" if spec.sketch else "statistics"
        what.append(f"{kind} of {modules}" + (" with sketches" if spec.sketch and kind == "full tensors" else ""))
    if spec.bundle_module:
        what.append(f"a reproducer bundle of {spec.bundle_module!r}")
    if spec.ops_module:
        what.append(f"the operations of {spec.ops_module!r}" + ("" if spec.modules else " in its first call"))
    steps = (f"step {spec.first_step}" if spec.first_step == spec.last_step
             else f"steps {spec.first_step}-{spec.last_step}")
    if spec.every > 1:
        steps = f"every {_ordinal(spec.every)} step of {steps}"
    if spec.divergent_step >= 0:
        who = f"asked by the server after the divergence at step {spec.divergent_step}"
    else:
        who = "asked by an operator" + (f": {spec.reason}" if spec.reason and spec.reason != "asked by an operator"
                                        else "")
    return f"{' and '.join(what) or 'nothing more'} at {steps}, {who}"


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


class CaptureControl:
    """The zoom windows of one rank: added on the sender thread, read on the training thread."""

    def __init__(self, run: str, rank: int, current_step: Callable[[], int]) -> None:
        self.run = run
        self.rank = rank
        self._current_step = current_step
        self._lock = threading.Lock()
        self._windows: dict[int, pb.ZoomSpec] = {}
        self._bundles: dict[int, pb.ZoomSpec] = {}  # bundles asked for and not yet armed, by window id
        self._ops: dict[int, pb.ZoomSpec] = {}  # operation captures asked for and not yet armed, by window id
        self._seen: set[int] = set()

    def add(self, spec: pb.ZoomSpec) -> None:
        """A ZOOM command (sender thread): remembered once per id; told again after a reconnect, ignored."""
        now = self._current_step()
        with self._lock:
            if spec.id in self._seen:
                return
            self._seen.add(spec.id)
            if spec.last_step < now:
                return  # over before this rank got it (a run that joined late is told every window)
            self._windows[spec.id] = spec
            while len(self._windows) > MAX_WINDOWS:
                del self._windows[min(self._windows)]
            if spec.bundle_module:
                self._bundles[spec.id] = spec
            if spec.ops_module:
                self._ops[spec.id] = spec
        late = spec.first_step <= now
        # Information, unless it came late: then this rank captures less than asked.
        level = logging.WARNING if late else logging.INFO
        logger.log(level, "twinstep: run %r rank %d: zoom #%d from the server: %s%s", self.run, self.rank, spec.id,
                   zoom_words(spec),
                   f" (arrived at step {now}: applied from step {now + 1} on this rank)" if late else "")

    def _applying(self, step: int) -> list[pb.ZoomSpec]:
        with self._lock:
            return [w for w in self._windows.values()
                    if w.first_step <= step <= w.last_step and (step - w.first_step) % max(w.every, 1) == 0]

    def captures(self, step: int) -> bool:
        """A window asks for this step (even if the run's own ``every`` skips it)."""
        return bool(self._windows) and bool(self._applying(step))

    def plan(self, step: int) -> StepZoom | None:
        """What the step starting now captures beyond attach's settings (None: nothing more)."""
        if not self._windows:
            return None
        windows = self._applying(step)
        with self._lock:  # windows over for good are forgotten
            for key in [k for k, w in self._windows.items()
                        if w.last_step < step and k not in self._bundles and k not in self._ops]:
                del self._windows[key]
        return StepZoom(windows) if windows else None

    def bundles_due(self, step: int) -> list[pb.ZoomSpec]:
        """Bundles to capture in the step starting now: asked for it, or for a step that had begun (late)."""
        if not self._bundles:
            return []
        with self._lock:
            due = [spec for spec in self._bundles.values() if spec.first_step <= step]
            for spec in due:
                del self._bundles[spec.id]
        return due


    def ops_due(self, step: int) -> list[pb.ZoomSpec]:
        """Operation captures to arm in the step starting now (asked for it, or for a step that had begun: late)."""
        if not self._ops:
            return []
        with self._lock:
            due = [spec for spec in self._ops.values() if spec.first_step <= step]
            for spec in due:
                del self._ops[spec.id]
        return due


def module_lookup(backend: Any, model: Any) -> Callable[[str], Any | None]:
    """name -> module of ``model`` (looked up when a bundle is asked, not before)."""
    def find(name: str) -> Any | None:
        for found, module in backend.named_modules(model):
            if found == name:
                return module
        return None

    return find
