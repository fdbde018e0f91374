"""Server configuration: defaults, YAML file, and command-line overrides."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import Any

import yaml

from twinstep.server.alert.webhook_config import WebhookConfig, webhooks_from_list
from twinstep.server.compare.mapping import NameMapping, layer_mapping_from_dict
from twinstep.server.compare.tolerance import ToleranceConfig


@dataclass(kw_only=True)
class ServerConfig:
    window_steps: int = 256
    """Unmatched steps held per run and rank before the oldest is dropped (and the run is slowed by credit)."""
    window_bytes: int = 1 << 30
    """Bytes of unmatched steps held per run and rank (tensor mode)."""
    halt_on_divergence: bool = False
    """Send HALT to every process of every run of a session once its first divergence is declared."""
    halt_after_gap: bool = True
    """With halt_on_divergence: also halt on a divergence found after steps that were never compared
    (it is the earliest among compared steps, and may have begun in the gap).  False holds such a
    divergence for the user to decide (``twinstep halt``); the report and the alert say why."""
    halt_prepare_timeout: float = 2.0
    """Seconds to wait for every rank's current step before naming the halt step."""
    tolerances: ToleranceConfig = field(default_factory=ToleranceConfig)
    mapping: NameMapping = field(default_factory=NameMapping)
    max_workers: int = 256
    """gRPC handler threads: each training process and each watcher holds one."""
    auto_mapping: bool = True
    """When module names differ, align the runs' modules automatically (see twinstep mapping)."""
    noise_multiple: float = 3.0
    """With a reference rerun in the session, a candidate's tolerance is this multiple of the record's noise band."""
    noise_floor: float = 0.1
    """... but never below this fraction of the default tolerance (a deterministic rerun has a band of 0)."""
    drift_window: int = 1000
    """Steps averaged by the long-run loss and gradient-norm criteria (the seeds ask for at least 1000)."""
    max_message_bytes: int = 256 << 20
    """Largest client message accepted; larger ones end that stream with RESOURCE_EXHAUSTED."""
    max_sessions: int = 64
    """Sessions one server holds; a stream naming one more is refused with RESOURCE_EXHAUSTED."""
    max_runs_per_session: int = 16
    """Runs (baseline, references, candidates) one session holds; one more is refused with RESOURCE_EXHAUSTED."""
    memory_budget_bytes: int = 8 << 30
    """Server-wide bound on the steps held for alignment, over every session.  Past it, the held steps of
    sessions whose runs have all ended are freed, least recently active first (their reports stay);
    sessions still streaming keep their own per-rank windows (window_steps, window_bytes)."""
    max_inflight_steps: int = 16
    """Steps a stream may send ahead of what the server has taken: bounds acknowledgement latency and the
    memory in gRPC's buffers when clients outpace the server (their outboxes then drop and count steps)."""
    reconnect_grace: float = 30.0
    """Seconds a run whose stream broke may take to reconnect (clients retry with backoff up to 10 s) before
    the other runs' steps it has not matched are released and the session's verdict can be told.  It shows
    as ``lost`` at once; a rank that comes back resumes where the server's record of it ends."""
    journal: str | None = None
    """Directory of the journal that lets sessions survive a restart (None: sessions live in memory only)."""
    journal_sync: str = "normal"
    """"normal": a commit survives the server process dying; "full": also a power loss (an fsync per commit)."""
    record: str | None = None
    """Directory where every session's inputs are recorded, one compressed file per session, so that a later
    candidate can be compared against a recorded baseline (docs/recording.md); None: nothing is recorded."""
    record_budget: int = 10 << 30
    """Bytes the recordings in ``record`` may take: past it the oldest finished recordings are deleted, then
    recordings still being written take no more steps (each told in the log, counted, noted in the file)."""
    replay: dict[str, str] = field(default_factory=dict)
    """Sessions whose baseline is a recording: session name -> ``PATH[:RUN]`` (a recording file, or a directory
    holding recordings of that session: the newest; RUN: which recorded run, default its baseline).  The
    recording is played at the pace of the live candidates that join the session (docs/recording.md)."""
    session_ttl: float = 3600.0
    """Seconds a session stays in memory after its last run ended; then only its report is kept (in the
    journal, or in memory without one) and ``twinstep sessions`` still lists it."""
    resume_grace: float = 120.0
    """After a restart, seconds a stream that was open may take to reconnect before its run is marked lost."""
    max_archived: int = 1000
    """Without a journal: reports of sessions that left memory kept for GetReport, oldest forgotten first."""
    history_steps: int = 128
    """Dashboard history per candidate (twinstep.server.view.history): the latest this many compared steps
    keep a column each in the heatmap and curves; older steps merge into at most as many coarser columns,
    each holding every module's worst record over its steps.  A heatmap cell takes 9 bytes, so a candidate
    holds at most rows x 2 x history_steps x 9 bytes (1,500 rows at the default: 3.5 MB)."""
    history_rows: int = 20000
    """Heatmap rows (a module or parameter in one phase) kept per candidate; rows past it are counted and
    shown as not kept.  With history_steps, the bound on the history's memory (20,000 rows: 46 MB)."""
    webhooks: list[WebhookConfig] = field(default_factory=list)
    """Receivers POSTed to on divergence, halt, lost run and capture failure (docs/alerts.md)."""
    weights_budget_bytes: int = 4 << 30
    """Weight sync (docs/weight-sync.md): bytes of baselines' initial parameters held for candidates that
    attach with init_from_baseline, over every session.  Past it the oldest publication is dropped; a
    baseline whose parameters alone exceed it is refused with a clear error (raise it for large models)."""
    auto_zoom: bool = False
    """After a divergence the session does not halt on, zoom in by itself (docs/zoom-and-reproduce.md): the next
    ``auto_zoom_steps`` steps bring full tensors of the divergent module and its neighbours (parent, siblings,
    children) from every run, the same steps on every rank; the rest stays as attached."""
    auto_zoom_steps: int = 3
    """Steps an auto_zoom lasts."""
    trace_origins: bool = True
    """Trace a divergence back to the step that caused it with no reference run (docs/origin.md): an update (or a
    parameter-free module) whose error stands clearly over what a faithful float32 pair shows, and grows, is named
    as the origin even while under every tolerance.  Its floors were calibrated on float32 ports; false turns it off."""
    auto_ops: bool = True
    """After a divergence the session does not halt on, whose culprit is a module's own code (its output differs
    while its input and hooked children match, or a module's input differs while its siblings before it match):
    every run captures that module's operations in one call at one step all ranks can reach, and the report names
    the first operation that differs and its line (docs/operations.md).  One module, one step: cheap."""
    bundle_on_halt: bool = False
    """With halt_on_divergence: before halting, every run writes a reproducer bundle of the divergent module
    (its inputs, parameters and output) at one step every rank can still reach, and halts at the end of that
    step (a few steps later than a plain halt).  ``twinstep reproduce`` runs it (docs/zoom-and-reproduce.md)."""
    batch_buffer_bytes: int = 512 << 20
    """Batch sync (docs/records-and-batches.md): bytes of published batches one session holds for its
    candidates.  Past it, batches a candidate already took go first, then the oldest; a candidate asking
    for a dropped step is told so at once.  A baseline far ahead of its candidates needs more (or lockstep)."""
    batch_max_bytes: int = 48 << 20
    """Largest batch (tensor bytes, before compression) one PublishBatch may carry; larger ones are refused
    with a clear error and counted.  Under the server's 64 MiB limit on one message it sends."""

    def __post_init__(self) -> None:
        if self.window_steps < 1:
            raise ValueError("window_steps must be at least 1")
        if self.window_bytes < 1:
            raise ValueError("window_bytes must be positive")
        if self.max_workers < 4:
            raise ValueError("max_workers must be at least 4")
        if self.journal_sync not in ("normal", "full"):
            raise ValueError(f"journal_sync must be 'normal' or 'full', not {self.journal_sync!r}")
        if self.session_ttl < 0 or self.resume_grace < 0 or self.reconnect_grace < 0:
            raise ValueError("session_ttl, resume_grace and reconnect_grace must not be negative")
        if self.record_budget < 1:
            raise ValueError("record_budget must be at least 1")
        for name in ("max_sessions", "max_runs_per_session", "memory_budget_bytes", "max_archived", "weights_budget_bytes",
                     "max_inflight_steps", "history_steps", "history_rows", "batch_buffer_bytes", "batch_max_bytes",
                     "auto_zoom_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


_KEYS = {"window_steps", "window_bytes", "halt_on_divergence", "halt_after_gap", "halt_prepare_timeout", "tolerances", "mapping", "mapping_file", "layer_mapping_file", "max_workers", "max_message_bytes", "noise_multiple", "noise_floor", "drift_window", "auto_mapping", "max_sessions", "max_runs_per_session", "memory_budget_bytes", "journal", "journal_sync", "session_ttl", "resume_grace", "max_archived", "max_inflight_steps", "reconnect_grace", "history_steps", "history_rows", "webhooks", "weights_budget_bytes", "batch_buffer_bytes", "batch_max_bytes", "auto_zoom", "auto_zoom_steps", "bundle_on_halt"}

_KEYS |= {"record", "record_budget", "replay"}  # record and replay (docs/recording.md)
_KEYS |= {"auto_ops"}  # operations inside a module (docs/operations.md)
_KEYS |= {"trace_origins"}  # a divergence traced back to its origin (docs/origin.md)


def load_config(path: str | pathlib.Path) -> ServerConfig:
    """Read a YAML config; raises ValueError naming the file and option at fault."""
    path = pathlib.Path(path)
    data = _read_yaml(path, "config") or {}
    return config_from_dict(data, base_dir=path.parent, where=str(path))


def _read_yaml(path: pathlib.Path, what: str) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read {what} {path}: {exc}") from None


def config_from_dict(data: Any, base_dir: pathlib.Path = pathlib.Path("."), where: str = "config") -> ServerConfig:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping at the top level")
    unknown = set(data) - _KEYS
    if unknown:
        raise ValueError(f"{where}: unknown options {sorted(unknown)} (known: {sorted(_KEYS)})")
    mapping_data = data.get("mapping")
    if "mapping_file" in data:
        mapping_data = _read_yaml(base_dir / str(data["mapping_file"]), f"{where}: mapping_file")
    mapping = NameMapping.from_dict(mapping_data, f"{where}: mapping")
    if "layer_mapping_file" in data:
        path = base_dir / str(data["layer_mapping_file"])
        mapping.layer_mapping = layer_mapping_from_dict(
            _read_yaml(path, f"{where}: layer_mapping_file"), f"{where}: layer_mapping_file {path}"
        )
    kwargs: dict[str, Any] = {
        "tolerances": ToleranceConfig.from_dict(data.get("tolerances"), f"{where}: tolerances"),
        "mapping": mapping,
    }
    for key, kind in (("window_steps", int), ("window_bytes", int), ("halt_prepare_timeout", float), ("max_workers", int), ("max_message_bytes", int), ("noise_multiple", float), ("noise_floor", float), ("drift_window", int), ("max_sessions", int), ("max_runs_per_session", int), ("memory_budget_bytes", int), ("session_ttl", float), ("resume_grace", float), ("max_archived", int), ("max_inflight_steps", int), ("reconnect_grace", float), ("history_steps", int), ("history_rows", int), ("weights_budget_bytes", int), ("batch_buffer_bytes", int), ("batch_max_bytes", int), ("auto_zoom_steps", int)):
        if key in data:
            try:
                kwargs[key] = kind(data[key])
            except (TypeError, ValueError):
                raise ValueError(f"{where}: {key} must be a number, got {data[key]!r}") from None
    if "journal" in data and data["journal"] is not None:
        kwargs["journal"] = str(base_dir / str(data["journal"]))
    if "journal_sync" in data:
        kwargs["journal_sync"] = str(data["journal_sync"])
    kwargs.update(_record_options(data, base_dir, where))
    if "webhooks" in data:
        kwargs["webhooks"] = webhooks_from_list(data["webhooks"], f"{where}: webhooks")
    for key in ("halt_on_divergence", "halt_after_gap", "auto_mapping", "auto_zoom", "bundle_on_halt", "auto_ops",
                "trace_origins"):
        if key in data:
            if not isinstance(data[key], bool):
                raise ValueError(f"{where}: {key} must be true or false")
            kwargs[key] = data[key]
    try:
        return ServerConfig(**kwargs)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _record_options(data: dict, base_dir: pathlib.Path, where: str) -> dict[str, Any]:
    """record, record_budget and replay from a config file (paths relative to the file)."""
    out: dict[str, Any] = {}
    if data.get("record") is not None:
        out["record"] = str(base_dir / str(data["record"]))
    if "record_budget" in data:
        try:
            out["record_budget"] = int(data["record_budget"])
        except (TypeError, ValueError):
            raise ValueError(f"{where}: record_budget must be a number of bytes, got {data['record_budget']!r}") from None
    replay = data.get("replay")
    if replay is not None:
        if not isinstance(replay, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in replay.items()):
            raise ValueError(f"{where}: replay must map session names to recordings (SESSION: PATH[:RUN])")
        out["replay"] = {session: str(base_dir / source) for session, source in replay.items()}
    return out
