"""msprobe statistics dumps read as a run's stream: an input adapter for ``twinstep compare-dumps``.

msprobe (mindstudio-probe) writes, per step and rank, ``dump_path/step{N}/rank{R}/dump.json``
(``proc{PID}`` instead of ``rank{R}`` outside a process group).  Its ``data`` maps a
name to what one call saw, each tensor as ``{type, dtype, shape, Max, Min, Mean, Norm}``:

=====================================================  =====================================================
msprobe                                                twinstep record (phase, module or parameter, call)
=====================================================  =====================================================
``Module.{path}.{Class}.forward.{n}``: ``output``      forward of module ``path`` (type ``Class``), call n,
                                                       one slot per output tensor
... its first tensor of ``input_args``/``input_kwargs``   input (culprit evidence), slot 0
... ``parameters`` (L0, mix: as the module ran)        param of ``path.{name}`` at the *previous* step: the
                                                       parameters a step's forward reads are the ones the
                                                       previous step's update wrote (the first call's)
``Module.{path}.{Class}.backward.{n}``: ``input``      backward (gradient with respect to the outputs)
``Module.{path}.{Class}.parameters_grad.{n}``          grad of ``path.{name}``
``{Api}.{n}.forward`` / ``.backward`` (L1, mix:        forward / input / backward of module ``{Api}.{n}``
``Functional.linear.0``, ``Tensor.__add__.1``, ...)    (type ``{Api}``): each call is its own record, as
                                                       msprobe's own compare matches them by that name
=====================================================  =====================================================

Gradients with respect to a module's inputs (a backward entry's ``output``) are
not a twinstep phase and are left out; so is anything that is not a tensor.

Statistics.  twinstep compares mergeable statistics (twinstep.wire.stats): element
count, sum, sum of squares, min, max, max |x|, NaN and Inf counts, and the
centred sum m2.  From msprobe's four: count = the shape's product, sum = Mean x
count, sum of squares = Norm², min and max as they are, max |x| = max(|Min|,
|Max|), m2 = sum_sq - sum²/count (msprobe records no centred statistic; the
engine's metrics do not read m2).  So the statistics metrics (rms, mean,
extrema, shape) are computed exactly as for a live run, to float32 rounding
of msprobe's numbers.  Not computable: NaN and Inf *counts* (a NaN or Inf in
Max/Min/Mean/Norm only says one is present: the record carries presence, 1,
and no finite statistics, so ``nonfinite`` compares presence), and full-tensor
and sketch metrics (rel_l2, cosine, max_abs) which need the tensors.  msprobe
records no Mean or Norm for integer, bool and float64 tensors (or at its
"high" precision): those records cannot be compared and are counted, as are
the loss (msprobe has no loss record) and the last dumped step's parameters
after its update (no later forward read them); both runs' reports say so.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

from twinstep.wire import phases
from twinstep._version import PROTOCOL_VERSION, __version__
from twinstep.wire.codec import DTYPE_TO_WIRE
from twinstep.wire.inputs import call_inputs
from twinstep.v1 import twinstep_pb2 as pb

#: msprobe tasks whose dump.json holds statistics (the tensor task writes them beside its .pt files).
STATISTICS_TASKS = ("statistics", "tensor")
_MODULE = re.compile(
    r"^(?:Module|Cell)\.(?P<path>.+)\.(?P<cls>[^.]+)\.(?P<dir>forward|backward|parameters_grad)\.(?P<n>\d+)$")
_API = re.compile(r"^(?P<api>.+)\.(?P<n>\d+)\.(?P<dir>forward|backward)$")
_STEP_DIR = re.compile(r"^step(\d+)$")
_RANK_DIR = re.compile(r"^(rank|proc)(\d*)$")
_FRAMEWORKS = {"pytorch": "torch", "torch": "torch", "mindspore": "mindspore", "paddle": "paddle"}
#: dump.json files one dump may hold (a path given by mistake cannot make the reader walk a whole disk).
MAX_FILES = 100_000


class DumpError(ValueError):
    """A dump that cannot be compared: the message names the file and what is wrong."""


@dataclass(frozen=True)
class DumpFile:
    path: str
    step: int
    rank: int


def locate(path: str) -> list[DumpFile]:
    """The dump.json files of a dump root (step dirs), a rank dir, a step dir, or one dump.json; by (step, rank)."""
    if not os.path.exists(path):
        raise DumpError(f"{path}: no such file or directory")
    if os.path.isfile(path):
        return [DumpFile(path, *_step_and_rank(path))]
    if os.path.isfile(os.path.join(path, "dump.json")):
        file = os.path.join(path, "dump.json")
        return [DumpFile(file, *_step_and_rank(file))]
    found: list[DumpFile] = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        if "dump.json" in files:
            file = os.path.join(root, "dump.json")
            found.append(DumpFile(file, *_step_and_rank(file)))
            if len(found) > MAX_FILES:
                raise DumpError(f"{path}: more than {MAX_FILES} dump.json files; point at one dump's directory")
    if not found:
        raise DumpError(f"{path}: no dump.json below it; give msprobe's dump_path, a step{{N}}/rank{{R}} "
                        "directory or a dump.json")
    seen: dict[tuple[int, int], str] = {}
    for file in found:
        other = seen.setdefault((file.step, file.rank), file.path)
        if other != file.path:
            raise DumpError(f"{path}: two dumps of step {file.step}, rank {file.rank}: {other} and {file.path}; "
                            "point at one of them (or one dump_path)")
    return sorted(found, key=lambda f: (f.rank, f.step))


def _step_and_rank(file: str) -> tuple[int, int]:
    """From msprobe's layout .../step{N}/rank{R}/dump.json; 0 where the path does not say."""
    rank_dir = os.path.basename(os.path.dirname(os.path.abspath(file)))
    step_dir = os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(file))))
    rank_match = _RANK_DIR.match(rank_dir)
    rank = int(rank_match.group(2)) if rank_match and rank_match.group(1) == "rank" and rank_match.group(2) else 0
    step_match = _STEP_DIR.match(step_dir) if rank_match else _STEP_DIR.match(rank_dir)
    return (int(step_match.group(1)) if step_match else 0), rank


def read_dump(file: str) -> dict[str, Any]:
    """A dump.json parsed and checked: a statistics dump with a ``data`` mapping."""
    try:
        with open(file, "rb") as f:
            raw = f.read()
    except OSError as error:
        raise DumpError(f"{file}: cannot read it ({error.strerror or error})") from None
    try:
        dump = json.loads(raw)
    except UnicodeDecodeError:
        raise DumpError(f"{file}: not a text file, so not msprobe's dump.json") from None
    except json.JSONDecodeError as error:
        where = f"line {error.lineno}, column {error.colno}"
        if error.pos >= len(raw.rstrip()) - 1:
            raise DumpError(f"{file}: the JSON ends early at {where} ({error.msg}): the file is truncated "
                            "(was the dump interrupted, or the copy incomplete?)") from None
        raise DumpError(f"{file}: not valid JSON at {where}: {error.msg}") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("data"), dict):
        raise DumpError(f"{file}: not msprobe's dump.json (expected an object with a 'data' object)")
    task = dump.get("task")
    if task not in STATISTICS_TASKS:
        raise DumpError(f"{file}: msprobe task {task!r}; compare-dumps reads dumps that hold statistics "
                        f"(task {' or '.join(map(repr, STATISTICS_TASKS))}): dump again with task 'statistics'")
    return dump


# -- one dump.json as records ------------------------------------------------------------


@dataclass
class Record:
    phase: int
    name: str
    """Module name, or parameter name for grad and param."""
    module: str
    module_type: str
    call: int
    slot: int
    dtype: str
    shape: tuple[int, ...]
    stats: tuple[int, float, float, float, float, float, int, int, float]
    """count, sum, sum_sq, min, max, abs_max, nan_count, inf_count, m2 (twinstep.wire.stats.FIELDS)."""


@dataclass
class StepDump:
    step: int
    rank: int
    records: list[Record] = field(default_factory=list)
    parameters: list[Record] = field(default_factory=list)
    """Parameters as this step's forward read them: the previous step's param records."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Tensors left out, by reason."""
    tensors: int = 0
    with_statistics: int = 0
    """Tensors seen, and those carrying any of Max/Min/Mean/Norm."""
    level: str = ""
    framework: str = ""
    task: str = ""

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def read_step(file: DumpFile) -> StepDump:
    """One dump.json as twinstep records (see the module docstring for the mapping)."""
    dump = read_dump(file.path)
    out = StepDump(file.step, file.rank, level=str(dump.get("level") or ""), task=str(dump.get("task")),
                   framework=_framework(dump))
    for key, entry in dump["data"].items():
        if not isinstance(entry, dict):
            out.skip("entries that are not objects")
            continue
        module = _MODULE.match(key)
        api = None if module else _API.match(key)
        if module:
            name, module_type, direction = module.group("path"), module.group("cls"), module.group("dir")
        elif api:
            name, module_type, direction = f"{api.group('api')}.{api.group('n')}", api.group("api"), api.group("dir")
        else:
            out.skip("entries whose names are not msprobe's module or API names")
            continue
        call = int(module.group("n")) if module else 0
        if direction == "forward":
            for slot, leaf in enumerate(_tensors(entry.get("output"))):
                _add(out, phases.FORWARD, name, name, module_type, call, slot, leaf)
            inputs = _first_input(entry.get("input_args"), entry.get("input_kwargs"))
            if inputs:
                _add(out, phases.INPUT, name, name, module_type, call, 0, inputs[0])
            if call == 0 and isinstance(entry.get("parameters"), dict):
                for local, leaf in entry["parameters"].items():
                    for tensor in _tensors(leaf)[:1]:
                        _add(out, phases.PARAM, f"{name}.{local}", name, module_type, 0, 0, tensor, into=out.parameters)
        elif direction == "backward":
            for slot, leaf in enumerate(_tensors(entry.get("input"))):  # gradients w.r.t. the module's outputs
                _add(out, phases.BACKWARD, name, name, module_type, call, slot, leaf)
        else:  # parameters_grad
            for local, leaf in entry.items():
                for tensor in _tensors(leaf)[:1]:
                    _add(out, phases.GRAD, f"{name}.{local}", name, module_type, 0, 0, tensor)
    if out.tensors and not out.with_statistics:
        raise DumpError(f"{file.path}: its {out.tensors} tensors carry no statistics (no Max/Min/Mean/Norm): "
                        "msprobe's summary_mode 'xor' records checksums only; dump again with summary_mode "
                        "'statistics'")
    return out


_NO_MEAN = "tensors with no Mean/Norm in msprobe's dump (integer, bool or float64, or precision 'high')"
_OVERFLOW = "tensors whose Mean or Norm overflowed float32 in msprobe's dump"
_BAD_DTYPE = "tensors of a dtype twinstep does not compare"
_EMPTY = "empty tensors"
_NO_STATS = "tensors without statistics"


def _tensors(value: Any) -> list[dict[str, Any]]:
    """The tensor entries of an msprobe value, depth first (nested lists, tuples and keyword dicts)."""
    if isinstance(value, dict):
        if "dtype" in value and "shape" in value and "Tensor" in str(value.get("type", "Tensor")):
            return [value]
        found: list[dict[str, Any]] = []
        for item in value.values():
            found.extend(_tensors(item))
        return found
    if isinstance(value, (list, tuple)):
        found = []
        for item in value:
            found.extend(_tensors(item))
        return found
    return []


def _first_input(args: Any, kwargs: Any) -> list[dict[str, Any]]:
    """The call's first input, as capture takes it (twinstep.wire.inputs): the first tensor among the
    positional arguments, else among the keyword arguments, in call order (a dump holds no signature)."""
    positional = tuple(args) if isinstance(args, (list, tuple)) else () if args is None else (args,)
    keywords = kwargs if isinstance(kwargs, dict) else {}
    return _tensors(list(call_inputs(positional, keywords)))[:1]


def _add(out: StepDump, phase: int, name: str, module: str, module_type: str, call: int, slot: int,
         leaf: dict[str, Any], into: list[Record] | None = None) -> None:
    """Append one tensor's record, or count why it cannot be compared."""
    out.tensors += 1
    dtype = str(leaf.get("dtype", "")).rsplit(".", 1)[-1].lower()
    shape = leaf.get("shape")
    if not any(key in leaf for key in ("Max", "Min", "Mean", "Norm")):
        out.skip(_NO_STATS)
        return
    out.with_statistics += 1
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        out.skip(_NO_STATS)
        return
    if dtype not in DTYPE_TO_WIRE:
        out.skip(_BAD_DTYPE)
        return
    count = math.prod(shape)
    if count == 0:
        out.skip(_EMPTY)
        return
    values = [leaf.get(key) for key in ("Max", "Min", "Mean", "Norm")]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        out.skip(_NO_MEAN)
        return
    hi, lo, mean, norm = (float(v) for v in values)
    if math.isfinite(hi) and math.isfinite(lo):  # torch.max/min propagate NaN and Inf: every element is finite
        if not (math.isfinite(mean) and math.isfinite(norm)):
            out.skip(_OVERFLOW)
            return
        total, sum_sq = mean * count, norm * norm
        m2 = max(sum_sq - total * (total / count), 0.0)
        stats = (count, total, sum_sq, lo, hi, max(abs(lo), abs(hi)), 0, 0, m2)
    else:  # a NaN or an Inf is present; msprobe's numbers say neither how many nor anything of the finite rest
        nan = math.isnan(hi) or math.isnan(lo)
        stats = (count, 0.0, 0.0, 0.0, 0.0, 0.0, int(nan), int(not nan), 0.0)
    (out.records if into is None else into).append(
        Record(phase, name, module, module_type, call, slot, dtype, tuple(shape), stats))


# -- a whole dump as a run's stream ----------------------------------------------------------


class DumpRun:
    """One dump (every step and rank it holds) as the messages a training's streams would send.

    ``convert()`` reads every file and returns, per rank, the Manifest deltas
    and StepRecords in step order, each step's parameters taken from the next
    dumped step's forward (see the module docstring); ``notes()`` then says
    what the dump could not give.  ``hello(rank, warnings)`` is that rank's Hello.
    The converted records (about 100 bytes each) are held, not the JSON.
    """

    def __init__(self, path: str, session: str, run: str, baseline: bool) -> None:
        self.path = path
        self.session = session
        self.run = run
        self.baseline = baseline
        self.files = locate(path)
        self.ranks = sorted({f.rank for f in self.files})
        self.steps = sorted({f.step for f in self.files})
        first = read_dump(self.files[0].path)
        self.task = str(first.get("task"))
        self.level = str(first.get("level") or "")
        self.framework = _framework(first)
        self.skipped: dict[str, int] = {}
        self.records = 0
        self.params_unplaced = 0
        """Parameter records of a step whose previous step is not in the dump (its first, or after a gap)."""
        self._last_without_params: set[int] = set()

    @property
    def world_size(self) -> int:
        return max(self.ranks) + 1

    def describe(self) -> str:
        return (f"{self.path}: msprobe {self.task} dump, level {self.level or '?'}, {self.framework or '?'}, "
                f"step(s) {_ranges(self.steps)}, {len(self.ranks)} rank(s)")

    def hello(self, rank: int, warnings: list[str]) -> pb.Hello:
        steps = sorted({f.step for f in self.files if f.rank == rank}) or [0]
        return pb.Hello(
            protocol_version=PROTOCOL_VERSION, session=self.session, run=self.run, baseline=self.baseline,
            framework=self.framework or "unknown", rank=rank, world_size=self.world_size, host="",
            client_version=__version__, capture="stats", every=_common_stride(steps), start_step=steps[0],
            environment={"source": "msprobe dump", "path": os.path.abspath(self.path), "msprobe_task": self.task,
                         "msprobe_level": self.level},
            warnings=warnings,
        )

    def convert(self) -> dict[int, list[pb.Manifest | pb.StepRecords]]:
        """Every rank's messages; DumpError when a file cannot be read, or no file holds a comparable tensor."""
        messages = {rank: list(self._messages(rank)) for rank in self.ranks}
        if not self.records:
            raise DumpError(f"{self.path}: none of its {len(self.files)} dump.json files holds a tensor twinstep can "
                            "compare (empty 'data': did the dump start after the forward, or cover no module?)")
        return messages

    def notes(self) -> list[str]:
        """What this dump cannot give the comparison, in sentences (after ``convert``)."""
        notes = ["msprobe records no loss: the loss phase is not compared"]
        if self._last_without_params:
            steps = ", ".join(map(str, sorted(self._last_without_params)))
            notes.append(f"parameters after the update of step {steps} are not in the dump (msprobe records "
                         "parameters as the next step's forward reads them): not compared")
        if self.params_unplaced:
            notes.append(f"{self.params_unplaced} parameter records read by the forward of a step whose previous step "
                         "is not in the dump (the first dumped step reads the weights it started from): not compared")
        for reason, count in sorted(self.skipped.items()):
            notes.append(f"{count} {reason}: not compared")
        return notes

    def _messages(self, rank: int) -> Iterator[pb.Manifest | pb.StepRecords]:
        modules: dict[str, int] = {}
        parameters: dict[str, int] = {}
        pending: StepDump | None = None
        for file in (f for f in self.files if f.rank == rank):
            current = read_step(file)
            self._check_like_first(file, current)
            for reason, count in current.skipped.items():
                self.skipped[reason] = self.skipped.get(reason, 0) + count
            if pending is not None and current.step == pending.step + 1:
                pending.records.extend(current.parameters)
            else:
                self.params_unplaced += len(current.parameters)
            if pending is not None:
                yield from self._encode(pending, modules, parameters)
            pending = current
        if pending is not None:
            if pending.parameters:  # this level records parameters, but no later step read this one's update
                self._last_without_params.add(pending.step)
            yield from self._encode(pending, modules, parameters)

    def _check_like_first(self, file: DumpFile, step: StepDump) -> None:
        if step.level != self.level or step.framework != self.framework:
            raise DumpError(f"{file.path}: level {step.level!r}, framework {step.framework!r}, but "
                            f"{self.files[0].path} says level {self.level!r}, framework {self.framework!r}: "
                            "one dump's files must come from one msprobe configuration")

    def _encode(self, dump: StepDump, modules: dict[str, int], parameters: dict[str, int]
                ) -> Iterator[pb.Manifest | pb.StepRecords]:
        """The manifest delta (new modules and parameters) and the step's records, grouped by phase."""
        manifest = pb.Manifest()
        records = sorted(dump.records, key=lambda r: _PHASE_ORDER[r.phase])  # stable: production order kept
        self.records += len(records)
        columns = pb.StepRecords(rank=dump.rank, step=dump.step)
        for record in records:
            if record.module not in modules:
                modules[record.module] = len(modules)
                manifest.modules.add(id=modules[record.module], name=record.module, type=record.module_type)
            if record.phase in phases.PARAM_PHASES:
                target = parameters.get(record.name)
                if target is None:
                    target = parameters[record.name] = len(parameters)
                    manifest.parameters.add(id=target, name=record.name, module=record.module,
                                            module_type=record.module_type, shape=record.shape,
                                            dtype=DTYPE_TO_WIRE[record.dtype])
            else:
                target = modules[record.module]
            columns.phase.append(record.phase)
            columns.target.append(target)
            columns.call_index.append(record.call)
            columns.slot.append(record.slot)
            columns.dtype.append(DTYPE_TO_WIRE[record.dtype])
            columns.ndim.append(len(record.shape))
            columns.dims.extend(record.shape)
            count, total, sum_sq, lo, hi, abs_max, nan, inf, m2 = record.stats
            stats = columns.stats
            stats.count.append(count)
            stats.sum.append(total)
            stats.sum_sq.append(sum_sq)
            stats.min.append(lo)
            stats.max.append(hi)
            stats.abs_max.append(abs_max)
            stats.nan_count.append(nan)
            stats.inf_count.append(inf)
            stats.m2.append(m2)
        if manifest.modules or manifest.parameters:
            yield manifest
        yield columns


#: Records go out grouped by phase in the order a step produces them (as the capture client sends them).
_PHASE_ORDER = {phases.FORWARD: 0, phases.LOSS: 1, phases.BACKWARD: 2, phases.GRAD: 3, phases.PARAM: 4,
                phases.INPUT: 5}


def _framework(dump: dict[str, Any]) -> str:
    """twinstep's name of the dump's framework ("pytorch" is "torch"), or msprobe's own word for another."""
    named = str(dump.get("framework") or "")
    return _FRAMEWORKS.get(named.lower(), named)


def _common_stride(steps: list[int]) -> int:
    """``every`` of the dumped steps: their common divisor when all are its multiples (0, 10, 20), else 1."""
    stride = 0
    for step in steps:
        stride = math.gcd(stride, step)
    return stride if stride > 1 else 1


def _ranges(steps: list[int]) -> str:
    if not steps:
        return "none"
    parts, start, prev = [], steps[0], steps[0]
    for step in steps[1:] + [None]:  # type: ignore[list-item]
        if step is not None and step == prev + 1:
            prev = step
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if step is not None:
            start = prev = step
    return ", ".join(parts)
