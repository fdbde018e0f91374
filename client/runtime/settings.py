"""Every setting of ``twinstep.attach``: one typed, grouped definition, and where each value comes from.

The definition.  A setting is one field of a group below (``IdentitySettings``, ``ConnectionSettings``,
...), declared once with ``setting(...)``: its type is the field's annotation, then its default,
its help, its bounds, and what a source needs beyond its name.  Its name is the same everywhere:
the keyword of ``attach``, the key of the YAML file, the option ``--<name>`` of ``twinstep run``
(but ``rank`` and ``world_size``, which the launcher sets per process) and, upper-cased after
``TWINSTEP_``, its environment variable.  From the fields come:

- ``attach``'s keyword arguments, written out in twinstep/runtime/api.py so that IDEs and type
  checkers see them (scripts/gen_settings_docs.py writes them; a test checks they are current);
- the environment variables and YAML keys that ``resolve`` reads;
- ``twinstep run``'s options and ``--show-config`` (twinstep.cli.run);
- the settings table of docs/attach.md (scripts/gen_settings_docs.py; a test checks it is current).

Where a value comes from, in this order:

1. the argument, when the call gives one (not None);
2. the environment variable ``TWINSTEP_<NAME>`` (``TWINSTEP_SESSION``, ``TWINSTEP_EVERY``, ...);
   ``rank`` and ``world_size`` then fall back to the launcher's ``RANK``/``WORLD_SIZE``
   (torchrun) or ``PADDLE_TRAINER_ID``/``PADDLE_TRAINERS_NUM`` (paddle.distributed.launch);
3. the YAML config file named by ``attach(config=...)`` or ``TWINSTEP_CONFIG``: its top-level
   keys, overridden by the section of this run under ``runs:``;
4. the default.

An empty environment variable counts as unset.  A value that cannot be read is a ValueError
naming the argument, the variable or the file and key, and the values it accepts: a bad setting
stops ``attach`` before any hook is installed, never later inside the training.

The YAML file keeps one flat key per setting, its name, as the keyword and the variable do: the
names are unique across groups, so the groups order the docs and ``--show-config`` and nothing
more (``capture`` is both a group and a setting).  A group written as a mapping is refused with
a message that says so.

Hand-written rather than pydantic-settings (or pydantic): this module is imported by every
training job and by ``twinstep run``'s launcher, which must stay a few small modules
(tests/unit_tests/test_autoattach.py), and a pydantic dependency in a training job would meet the
pins of users' ML environments.  What the sources need beyond typed fields would be written by hand
on top of it all the same: the launchers' rank variables, the per-run sections of one file, paths
relative to the file, the source of every value, and errors that name the variable or key.  The
server's settings are declared the same way (twinstep.server.config), on the same machinery
(twinstep._settings: the declaration, the readers of each kind, ``Resolved``); this module holds
attach's names, words and sources.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, Mapping

from twinstep import _settings
from twinstep._settings import Group, all_settings, build, bytes_text, groups_of, value_of
from twinstep._settings import settings_of  # noqa: F401  (for twinstep run and the docs generator)

logger = logging.getLogger("twinstep")

ENV_PREFIX = "TWINSTEP_"
#: Not a setting: the YAML file of settings (``attach(config=...)``, ``twinstep run --config``).
ENV_CONFIG = "TWINSTEP_CONFIG"

# The vocabularies of the modules that own them (tests/unit_tests/test_settings.py checks they agree);
# repeated here so that resolving settings (in `twinstep run`'s launcher too) imports no runtime.
CaptureMode = Literal["stats", "tensors", "lossy"]
Compression = Literal["auto", "zstd", "none"]
SenderKind = Literal["auto", "thread", "process"]
Precision = Literal["auto", "fp32", "tf32"]
CAPTURE_MODES: tuple[str, ...] = typing.get_args(CaptureMode)
COMPRESSIONS: tuple[str, ...] = typing.get_args(Compression)
SENDERS: tuple[str, ...] = typing.get_args(SenderKind)
PRECISIONS: tuple[str, ...] = typing.get_args(Precision)


# -- the declaration: twinstep._settings, with attach's names and rules ---------------------------


class Setting(_settings.Setting):
    """One setting of ``attach``: its name is its keyword, its YAML key and, upper-cased after
    ``TWINSTEP_``, its variable; its kind is text, flag, integer, bytes, seconds, choice or patterns."""

    env_prefix: ClassVar[str] = ENV_PREFIX
    bits: ClassVar[bool] = True  # attach(baseline=1)

    @property
    def key(self) -> str:
        """Its name: unique across groups (the keyword, the YAML key, the key of ``Resolved.sources``)."""
        return self.name

    @property
    def option(self) -> str | None:
        """``twinstep run``'s option, or None."""
        return "--" + self.name.replace("_", "-") if self.spec.option else None

    @property
    def annotation(self) -> str:
        """The type of attach's keyword, as written in its signature (None: not given)."""
        return {
            "text": "str", "flag": "bool", "integer": "int", "bytes": "int | str", "seconds": "float",
            "choice": "Literal[" + ", ".join(f'"{c}"' for c in self.choices) + "]", "patterns": "Sequence[str]",
            "pairs": "Mapping[str, str]",
        }[self.kind] + " | None"

    def takes(self) -> str:
        """A number's bounds are part of what it must be: integers are never negative (at least their
        minimum), sizes and timeouts positive."""
        bounded = {"integer": f"be an integer >= {self.spec.minimum or 0}", "seconds": "be a positive number of seconds",
                   "bytes": "be a positive number of bytes (e.g. 1073741824, 512MiB, 1GiB)"}
        return bounded.get(self.kind) or super().takes()

    def read(self, value: Any, where: str) -> Any:
        """A mapping's numbers (a YAML ``-1``, an argument's ``-1``) read as their text."""
        if self.kind == "pairs" and isinstance(value, Mapping):
            value = {k: str(v) if isinstance(v, int) and not isinstance(v, bool) else v for k, v in value.items()}
        return super().read(value, where)

    def verify(self, typed: Any, value: Any, where: str) -> None:
        """Out of bounds is refused in the same words as unreadable (``takes``); a setting's own check after."""
        if self.spec.validate is not None:
            try:
                self.spec.validate(typed)
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
        if self.kind == "integer":
            inside = typed >= (self.spec.minimum or 0)
        else:
            inside = self.kind not in ("bytes", "seconds") or typed > 0  # not NaN either
        if not inside:
            raise self.refusal(value, where)

    def given(self, value: Any) -> Any:
        """A group's field: read (an absent optional or required value stays None); errors name the keyword."""
        if value is None and (self.default is None or self.spec.required):
            return None
        return self.read(value, self.name)

    def argument(self, value: Any) -> Any:
        """An argument of ``attach`` (not None), typed and checked; errors name the keyword."""
        if self.kind == "patterns" and isinstance(value, str):
            raise ValueError(f"{self.name} takes a sequence of glob patterns, not a string "
                             f"(e.g. {self.name}=[{value!r}])")
        return self.read(value, self.name)

    def text(self, value: Any) -> str:
        """The value as its environment variable holds it (``twinstep run`` passes options on so)."""
        if isinstance(value, bool):
            return "1" if value else "0"
        if isinstance(value, (list, tuple)):
            return ",".join(value)
        if isinstance(value, Mapping):
            return " ".join(f"{k}={v}" for k, v in value.items())
        return str(value)

    def show(self, value: Any) -> str:
        if value is not None and not self.spec.secret and self.kind in ("bytes", "seconds"):
            return bytes_text(value) if self.kind == "bytes" else f"{value:g}"
        return super().show(value)

    def default_text(self) -> str:
        return "(required)" if self.spec.required else super().default_text()

    def accepted(self) -> str:
        """The values it accepts, in words (the docs' table)."""
        return {
            "flag": "true/false", "integer": f"integer >= {self.spec.minimum or 0}", "seconds": "seconds > 0",
            "bytes": "bytes: 1073741824, 512MiB, 2G", "choice": ", ".join(self.choices),
            "patterns": "glob patterns: a YAML list, or comma-separated",
            "pairs": f"a YAML mapping, or {self.spec.metavar or 'KEY=VALUE'} items separated by spaces",
        }.get(self.kind) or self.spec.metavar or "text"


@dataclass(frozen=True)
class Spec(_settings.Spec):
    """What a field's ``setting(...)`` says besides its type and default (twinstep._settings.Spec), and:"""

    setting_type = Setting

    required: bool = False
    """``attach`` refuses to start without it (it has no default)."""
    option: bool = True
    """``twinstep run`` has an option for it (not for what differs between the processes of one job)."""
    launcher: tuple[str, ...] = ()
    """Launchers' variables read after ``TWINSTEP_<NAME>`` (torchrun's, paddle.distributed.launch's)."""
    validate: Callable[[Any], Any] | None = None
    """Raises ValueError for a value of the right kind that the setting cannot take (in words naming it)."""


def setting(default: Any, *, help: str, **spec: Any) -> Any:
    """A field of a settings group: its default, its help, and the rest of ``Spec``."""
    return _settings.declare(Spec(help=help, **spec), default)


# -- the settings ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class IdentitySettings(Group):
    """Which run of which comparison session this process is."""

    group: ClassVar[str] = "identity"

    session: str | None = setting(None, required=True, help="""
        Comparison session name; every run of a comparison names the same one.""")
    run: str | None = setting(None, required=True, help="""
        This training's name within the session (e.g. torch, paddle).""")
    baseline: bool = setting(False, help="""
        This run is the one the others are judged against.""")
    reference: bool = setting(False, help="""
        This run is a rerun of the baseline (determinism off, or another precision) that measures
        its own noise: candidates are then judged against multiples of each record's noise band
        (docs/three-way.md).""")
    precision: Precision = setting("auto", help="""
        Arithmetic of this run's float32 matrix products: fp32, tf32, or auto, which asks the
        framework (TF32 on GPUs unless disabled). Float32 records of a tf32 run are judged with
        looser tf32 tolerances.""")
    rank: int = setting(0, minimum=0, option=False, launcher=("RANK", "PADDLE_TRAINER_ID"), help="""
        This process's rank within its run. Without TWINSTEP_RANK: torchrun's RANK or
        paddle.distributed.launch's PADDLE_TRAINER_ID.""")
    world_size: int = setting(1, minimum=1, option=False, launcher=("WORLD_SIZE", "PADDLE_TRAINERS_NUM"), help="""
        Processes (ranks) of this run. Without TWINSTEP_WORLD_SIZE: WORLD_SIZE or
        PADDLE_TRAINERS_NUM.""")


@dataclass(frozen=True, kw_only=True)
class ConnectionSettings(Group):
    """How this process reaches the comparison server (docs/security.md)."""

    group: ClassVar[str] = "connection"

    server: str | None = setting(None, required=True, metavar="HOST:PORT", help="""
        Address of the comparison server, host:port (gRPC's unix:PATH too).""")
    token: str | None = setting(None, secret=True, metavar="TOKEN", help="""
        The session's (or the operator's) token, sent as 'authorization: Bearer TOKEN'. A server
        that refuses it ends capture with one error log; training continues. An empty argument
        means none.""")
    tls_ca: str | None = setting(None, path=True, metavar="FILE", help="""
        PEM file of the CA, or of the server's self-signed certificate, to trust (none: the
        system's CAs).""")
    tls_client_cert: str | None = setting(None, path=True, metavar="FILE", help="""
        PEM client certificate, for a server that asks for one (mutual TLS); with tls_client_key.""")
    tls_client_key: str | None = setting(None, path=True, metavar="FILE", help="""
        Its PEM private key.""")
    insecure: bool = setting(False, help="""
        Plaintext to a server that is not on a loopback address. Without TLS settings a loopback
        server is reached in plaintext and any other one over TLS.""")


@dataclass(frozen=True, kw_only=True)
class CaptureSettings(Group):
    """What is recorded, and at which steps."""

    group: ClassVar[str] = "capture"

    capture: CaptureMode = setting("stats", help="""
        What is sent of each tensor: stats (statistics), tensors (plus the full tensor, lossless)
        or lossy (plus the full tensor quantised within the error the server's tolerances allow:
        no verdict changes, fewer bytes).""")
    include: tuple[str, ...] = setting(("*",), help="""
        Glob patterns over module names selecting what is hooked ('' is the whole model).""")
    exclude: tuple[str, ...] = setting((), help="""
        Glob patterns over module names to leave out.""")
    every: int = setting(1, minimum=1, help="""
        Capture every N-th step; a step that is not captured runs with no hook attached.""")
    start_step: int = setting(0, minimum=0, help="""
        The number of the first step recorded: a run resumed from a checkpoint, or attached after
        some steps, numbers its steps as the baseline does. The server reports the steps before it
        as not compared.""")
    backward: bool = setting(True, help="""
        Record gradients with respect to module outputs.""")
    sketch: bool = setting(False, help="""
        Also send a count-sketch of every floating tensor (1 KiB each), from which the server
        estimates rel_l2 and cosine of whole tensors.""")
    stats_workers: int = setting(1, minimum=0, help="""
        Threads computing the statistics of CPU tensors while the training computes (they release
        the GIL: give them a free core); 0 computes them in the hooks, on the training thread.""")


@dataclass(frozen=True, kw_only=True)
class TransportSettings(Group):
    """How steps travel to the server, and what is held while it is behind or away."""

    group: ClassVar[str] = "transport"

    sender: SenderKind = setting("auto", help="""
        Where full tensors are encoded and sent: thread (a thread of this process), process (a
        sender process reading the tensor copies from shared memory, so its work never holds this
        process's GIL) or auto (process for tensors and lossy capture of a model on the CPU where
        shared memory exists, else thread). Statistics always use a thread.""")
    compression: Compression = setting("auto", help="""
        Lossless compression of full tensors: zstd, none, or auto (zstd, except for a dtype it
        shrinks by under 10%, such as float32 activations). Use zstd over slow links.""")
    max_queue_steps: int = setting(256, minimum=1, help="""
        Steps held while the server is behind or away; the oldest are dropped (and counted) beyond
        it.""")
    max_queue_bytes: int = setting(1 << 30, unit="bytes", help="""
        Bytes held while the server is behind or away; the oldest steps are dropped (and counted)
        beyond it.""")


@dataclass(frozen=True, kw_only=True)
class PacingSettings(Group):
    """Whether a faster run waits for the others."""

    group: ClassVar[str] = "pacing"

    lockstep: int = setting(0, minimum=0, help="""
        If N > 0, step() waits while this run leads the slowest other run by N steps (opt-in: it
        slows the faster training).""")
    lockstep_timeout: float = setting(300.0, unit="seconds", help="""
        Longest single lockstep wait, in seconds; past it the run warns and gives up lockstep.""")


@dataclass(frozen=True, kw_only=True)
class WeightSettings(Group):
    """Starting candidates from the baseline's initial parameters (docs/weight-sync.md)."""

    group: ClassVar[str] = "weights"

    share_weights: bool = setting(False, help="""
        Baseline: copy the initial parameters at attach and upload them to the server (in the
        background; rank 0 only) for candidates that attach with init_from_baseline. Costs one host
        copy of the model until the upload is done.""")
    init_from_baseline: bool = setting(False, help="""
        Candidate (or reference): before the first step, load the baseline's initial parameters,
        converted by the server to this run's names, layouts and fused modules; all or nothing
        (a WeightSyncError, the model untouched, when they cannot be loaded).""")
    init_timeout: float = setting(300.0, unit="seconds", help="""
        Longest wait for the baseline's weights, in seconds.""")


@dataclass(frozen=True, kw_only=True)
class BatchSettings(Group):
    """Feeding candidates the baseline's inputs (docs/records-and-batches.md)."""

    group: ClassVar[str] = "batches"

    publish_batches: bool = setting(False, help="""
        Baseline: publish the inputs of the model's first call in every step, for candidates that
        sync batches.""")
    sync_batches: bool = setting(False, help="""
        Candidate: call the model, on its first call of every step, with the inputs the baseline
        published for that step and rank (waiting up to batch_timeout; a BatchSyncError past it).""")
    batch_timeout: float = setting(300.0, unit="seconds", help="""
        Longest wait for the baseline's batch of a step, in seconds.""")


@dataclass(frozen=True, kw_only=True)
class ReproduceSettings(Group):
    """What the server may ask this process to write (docs/zoom-and-reproduce.md)."""

    group: ClassVar[str] = "reproduce"

    bundle_dir: str = setting("twinstep-bundles", path=True, metavar="DIR", help="""
        The folder reproducer bundles are written to when the server asks for them (a halt with the
        server's halt.bundle, or twinstep zoom --bundle).""")


_DIM = re.compile(r"[+-]?\d+")


def parse_tensor_parallel_split(mapping: Mapping[str, str]) -> dict[str, tuple[int | None, int | None]]:
    """``tensor_parallel_split`` read: {pattern: (the dimension its outputs are split along, its input's)}.

    Each value is ``DIM`` (or ``output=DIM``), ``input=DIM``, or both separated by a comma; a
    pattern that names parameters takes ``DIM``, the parameter's own dimension.  ValueError
    (without the setting's name: the caller says where) for anything else.
    """
    out: dict[str, tuple[int | None, int | None]] = {}
    for pattern, text in mapping.items():
        dims: dict[str, int] = {}
        for item in str(text).split(","):
            key, sep, dim = item.strip().rpartition("=")
            key = key.strip() if sep else "output"
            if key not in ("output", "input") or key in dims or not _DIM.fullmatch(dim.strip()):
                raise ValueError(f"{pattern!r}: {text!r} is not a dimension DIM, output=DIM or input=DIM "
                                 "(both: output=DIM,input=DIM)")
            dims[key] = int(dim)
        out[pattern] = (dims.get("output"), dims.get("input"))
    return out


@dataclass(frozen=True, kw_only=True)
class LayoutSettings(Group):
    """Where this rank sits in its training's parallel layout (docs/layouts.md)."""

    group: ClassVar[str] = "layout"

    layout_detect: bool = setting(True, help="""
        Find this rank's place in its training's parallel layout, and what each record holds of its
        logical tensor: torch's DTensors and tensor-parallel API, DistributedDataParallel (a process
        group larger than the tensor-parallel one), Megatron-core, paddle's fleet. Off: the records
        are sent as whole tensors, unless the sizes below declare a layout.""")
    tensor_parallel: int = setting(0, minimum=0, help="""
        Declares the tensor-parallel size (0: not declared). Declaring any size replaces detection:
        the ranks are derived from the global rank, tensor fastest, then data, then pipeline
        (Megatron's order), unless given.""")
    data_parallel: int = setting(0, minimum=0, help="""
        Declares the data-parallel size (0: the world size divided by the tensor and pipeline
        sizes, when one of those is declared).""")
    pipeline_parallel: int = setting(0, minimum=0, help="""
        Declares the pipeline-parallel size (0: not declared).""")
    tensor_parallel_rank: int | None = setting(None, minimum=0, option=False, help="""
        This process's tensor-parallel rank (none: derived from its rank).""")
    data_parallel_rank: int | None = setting(None, minimum=0, option=False, help="""
        This process's data-parallel rank (none: derived from its rank).""")
    pipeline_parallel_rank: int | None = setting(None, minimum=0, option=False, help="""
        This process's pipeline stage (none: derived from its rank).""")
    tensor_parallel_split: dict[str, str] | None = setting(
        None, metavar="PATTERN=DIM", validate=parse_tensor_parallel_split, help="""
        For layers twinstep cannot see through: glob patterns over module names, each with the
        dimension along which tensor parallelism splits the module's outputs (DIM, e.g. -1),
        its input (input=DIM) or both (-1,input=-1); a pattern over parameter names takes the
        parameter's split dimension. Each rank holds block tensor_parallel_rank of
        tensor_parallel along it.""")


@dataclass(frozen=True, kw_only=True)
class AttachSettings:
    """Every setting of one ``attach``, by group: ``settings.capture.every``, ``settings.connection.server``."""

    identity: IdentitySettings = field(default_factory=IdentitySettings)
    connection: ConnectionSettings = field(default_factory=ConnectionSettings)
    capture: CaptureSettings = field(default_factory=CaptureSettings)
    transport: TransportSettings = field(default_factory=TransportSettings)
    pacing: PacingSettings = field(default_factory=PacingSettings)
    weights: WeightSettings = field(default_factory=WeightSettings)
    batches: BatchSettings = field(default_factory=BatchSettings)
    reproduce: ReproduceSettings = field(default_factory=ReproduceSettings)
    layout: LayoutSettings = field(default_factory=LayoutSettings)

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> "AttachSettings":
        """From values by setting name (the rest: defaults); each is checked by its group."""
        unknown = set(values) - set(BY_NAME)
        if unknown:
            raise ValueError(f"unknown twinstep settings {sorted(unknown)} (known: {', '.join(BY_NAME)})")
        return build(cls, values)

    def value(self, name: str) -> Any:
        return value_of(self, BY_NAME[name])

    def as_dict(self) -> dict[str, Any]:
        """Every setting's value by name, in the definition's order."""
        return {item.name: self.value(item.name) for item in SETTINGS}

    def replace(self, **changes: Any) -> "AttachSettings":
        """A copy with some settings changed, by name."""
        return AttachSettings.from_values({**self.as_dict(), **changes})

    def check(self) -> None:
        """What one setting alone cannot say: the values ``attach`` needs, and the roles' settings."""
        identity, batches, weights = self.identity, self.batches, self.weights
        if not self.connection.server:
            raise ValueError(f"twinstep.attach needs server='host:port', the {BY_NAME['server'].env} environment "
                             f"variable or server: in the config file ({ENV_CONFIG})")
        if not identity.session or not identity.run:
            raise ValueError("twinstep.attach needs a non-empty session and run name: session=/run= arguments, "
                             f"TWINSTEP_SESSION/TWINSTEP_RUN, or session:/run: in the config file ({ENV_CONFIG})")
        if batches.publish_batches and not identity.baseline:
            raise ValueError("publish_batches is the baseline's (baseline=True); a candidate syncs with "
                             "sync_batches=True")
        if batches.sync_batches and identity.baseline:
            raise ValueError("sync_batches is a candidate's: the baseline publishes its batches "
                             "(publish_batches=True)")
        if weights.share_weights and not identity.baseline:
            raise ValueError("share_weights is the baseline's (baseline=True); a candidate loads the baseline's "
                             "weights with init_from_baseline=True")
        if weights.init_from_baseline and identity.baseline:
            raise ValueError("init_from_baseline is for candidates and references: the baseline shares its weights "
                             "(share_weights=True)")
        if not identity.rank < identity.world_size:
            raise ValueError(f"rank {identity.rank} is outside world size {identity.world_size}")
        self._check_layout()

    def _check_layout(self) -> None:
        """Declared sizes must tile the world, and declared ranks fit their sizes."""
        layout, world = self.layout, self.identity.world_size
        tp, dp, pp = layout.tensor_parallel, layout.data_parallel, layout.pipeline_parallel
        if not (tp or dp or pp):
            return
        declared = f"tensor_parallel={tp or 1} x data_parallel={dp or 'the rest'} x pipeline_parallel={pp or 1}"
        if dp and (tp or 1) * dp * (pp or 1) != world or not dp and world % ((tp or 1) * (pp or 1)):
            raise ValueError(f"the declared layout ({declared}) does not tile world size {world}")
        for rank_name, size in (("tensor_parallel_rank", tp or 1), ("pipeline_parallel_rank", pp or 1),
                                ("data_parallel_rank", dp or world // ((tp or 1) * (pp or 1)))):
            rank = getattr(layout, rank_name)
            if rank is not None and rank >= size:
                raise ValueError(f"{rank_name} {rank} is outside its size {size} ({declared})")


#: The groups, in order: (attribute of AttachSettings, group class).
GROUPS: tuple[tuple[str, type], ...] = tuple(groups_of(AttachSettings))
#: Every setting of ``attach``, group by group.
SETTINGS: tuple[Setting, ...] = all_settings(AttachSettings)  # type: ignore[assignment]
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
if len(BY_NAME) != len(SETTINGS):  # one name is the keyword, the variable and the YAML key: unique across groups
    raise TypeError("two attach settings share a name")
#: Parameters of attach that are not settings: objects of the training, or the file; never read from a file.
ARGUMENT_ONLY = frozenset({"model", "config", "optimizer"})
#: Keys of a config file: every setting, plus ``runs`` (a section per run name).
FILE_KEYS = frozenset(BY_NAME) | {"runs"}


# -- resolving: arguments > environment > launcher > file > default -------------------------------


class Resolved(_settings.Resolved):
    """Every setting's value (``settings``), and where each came from by name (for messages and
    ``twinstep run --show-config``, whose lines are group, name, value and source)."""

    header = ("GROUP", "SETTING", "VALUE", "SOURCE")

    @property
    def settings(self) -> AttachSettings:
        return self.config

    @property
    def values(self) -> dict[str, Any]:
        """Every setting's value by name."""
        return self.settings.as_dict()

    def row(self, item: _settings.Setting) -> tuple[str, ...]:
        return (item.group, *super().row(item))


def resolve(arguments: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
            config: str | None = None) -> Resolved:
    """Every attach setting: arguments (not None) > environment > config file > default.

    ``config`` names the YAML file (else ``$TWINSTEP_CONFIG``).  Raises ValueError naming the
    argument, the variable, or the file and key, of a value that cannot be read.
    """
    arguments = {k: v for k, v in (arguments or {}).items() if v is not None}
    env = os.environ if environ is None else environ
    unknown = set(arguments) - set(BY_NAME)
    if unknown:
        raise ValueError(f"unknown twinstep settings {sorted(unknown)} (known: {', '.join(BY_NAME)})")
    path = config or env.get(ENV_CONFIG) or None
    where_path = "config=" if config else ENV_CONFIG + "="
    file_values: dict[str, Any] = {}
    file_sources: dict[str, str] = {}
    if path:
        run = arguments.get("run") or env.get(BY_NAME["run"].env) or None
        file_values, file_sources = _read_file(path, run, f"{where_path}{path}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for item in SETTINGS:
        name = item.name
        if name in arguments:
            values[name], sources[name] = item.argument(arguments[name]), "argument"
            continue
        found = item.from_environment(env) or _from_launcher(item, env)
        if found is not None:
            values[name], sources[name] = found
            continue
        if name in file_values:
            values[name], sources[name] = file_values[name], file_sources[name]
            continue
        sources[name] = "default"
    return Resolved(AttachSettings.from_values(values), sources, path)


def _from_launcher(item: Setting, env: Mapping[str, str]) -> tuple[int, str] | None:
    """rank / world_size from torchrun's or paddle.distributed.launch's variables (a bad one is warned and skipped)."""
    for variable in item.spec.launcher:
        value = env.get(variable)
        if value is None or value == "":
            continue
        try:
            return item.read(value, variable), variable
        except ValueError:
            logger.warning("twinstep: ignoring %s=%r (not an integer >= %d)", variable, value, item.spec.minimum or 0)
    return None


def _read_file(path: str, run: str | None, where: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The file's common settings, overridden by ``runs: {RUN: {...}}``; typed, with relative paths made absolute."""
    import yaml  # only a job that has a config file pays for it

    file = pathlib.Path(path)
    try:
        data = yaml.safe_load(file.read_text())
    except OSError as exc:
        raise ValueError(f"{where}: cannot read the twinstep config file: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: not valid YAML: {exc}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping of settings at the top level, got {type(data).__name__}")
    _check_keys(data, FILE_KEYS, where)
    runs = data.get("runs") or {}
    if not isinstance(runs, dict) or not all(isinstance(v, dict) or v is None for v in runs.values()):
        raise ValueError(f"{where}: runs must map each run name to a mapping of its settings")
    for name, section in runs.items():  # a typo in any run's section is caught by every run
        _check_keys(section or {}, frozenset(BY_NAME) - {"run"}, f"{where}: runs.{name}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    common = {k: v for k, v in data.items() if k != "runs"}
    if run is None:
        run = common.get("run") if isinstance(common.get("run"), str) else None
    sections: list[tuple[str, dict[str, Any]]] = [("", common)]
    if run is not None and runs.get(run):
        sections.append((f"runs.{run}.", runs[run]))
    for prefix, section in sections:
        for key, raw in section.items():
            if raw is None:  # `key:` with no value: as if absent
                continue
            item = BY_NAME[key]
            if isinstance(raw, dict) and key in _GROUP_NAMES:  # `capture: {every: 2}`
                raise ValueError(f"{where}: {prefix}{key}: settings are flat keys of the file: write "
                                 f"{', '.join(map(str, raw))} at the top level (the {key} setting itself takes "
                                 f"{item.accepted()})")
            value = item.read(raw, f"{where}: {prefix}{key}")
            values[key], sources[key] = item.relative(value, file.parent.resolve()), f"{path}: {prefix}{key}"
    return values, sources


_GROUP_NAMES = frozenset(name for name, _ in GROUPS)


def _check_keys(section: Mapping[str, Any], known: frozenset[str], where: str) -> None:
    unknown = [k for k in section if k not in known]
    if not unknown:
        return
    grouped = sorted(str(k) for k in unknown if k in _GROUP_NAMES)
    hint = (f"; settings are flat keys of the file, not grouped: write {grouped[0]}'s settings "
            f"({', '.join(s.name for s in SETTINGS if s.group == grouped[0])}) at the top level") if grouped else ""
    raise ValueError(f"{where}: unknown settings {sorted(map(str, unknown))} (known: {', '.join(sorted(known))}){hint}")
