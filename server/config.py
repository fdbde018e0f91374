"""Server settings: one nested, typed definition, from which the YAML file, the environment and
the flags of ``twinstep serve`` come (and the docs' table, and ``twinstep serve --show-config``).

Every setting is one field of a group below, declared once with ``setting(...)``: its default,
its help, its bounds, and what the sources need.  Its dotted name (``halt.on_divergence``) is
its YAML path, ``halt: {on_divergence: true}``; its variable is ``TWINSTEP_SERVER_HALT_ON_DIVERGENCE``
unless it keeps an older name (``TWINSTEP_JOURNAL``, ``TWINSTEP_TLS_CERT``, ...); its flag is
``--halt-on-divergence`` (the spellings of earlier releases are kept).  Order: flag, environment,
YAML file, default (twinstep.server._settings).  Config files of earlier releases, with flat keys
(``halt_on_divergence: true``), are still read the same way, with a warning naming the new spelling.

Constructing one in code::

    ServerConfig(halt=HaltConfig(on_divergence=True), window=WindowConfig(steps=4))

Hand-written dataclasses rather than pydantic (or pydantic-settings): the config is imported by
training-side tools too (``twinstep.compare`` in one process, compare-dumps), where a pydantic
dependency would meet the v1/v2 pins of users' ML environments; and what this definition needs
beyond typed fields (flag spellings kept from earlier releases, flat keys of older files read with
a warning, the source of every value, errors that name the flag or key and the dotted setting)
would be written by hand on top of it all the same.  The machinery is shared with attach's settings
(twinstep._settings; the server's names, file layout and flags are twinstep.server._settings).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

from twinstep.server._settings import Group, Resolved, build, read_mapping, resolve, setting
from twinstep.server.alert.webhook_config import FORMATS, WebhookConfig, webhooks_from_list
from twinstep.server.compare.mapping import NameMapping, layer_mapping_from_dict
from twinstep.server.compare.tolerance import ToleranceConfig

_SERVE = "twinstep serve"


def _session_token(value: list[str], dotted: str) -> None:
    from twinstep.server.security import parse_session_token

    for text in value:
        try:
            parse_session_token(text)
        except ValueError as error:
            raise ValueError(f"{dotted}: {error}") from None


def _replay_sources(value: dict[str, str], dotted: str) -> None:
    for session, source in value.items():
        if not session or not source:
            raise ValueError(f"{dotted}: expected SESSION=PATH[:RUN], e.g. port=recordings:torch")


@dataclass(kw_only=True, slots=True)
class ListenConfig(Group):
    """Where the gRPC server listens."""

    group: ClassVar[str] = "listen"
    flag_prefix: ClassVar[str] = ""

    host: str = setting("127.0.0.1", help="Interface to listen on (0.0.0.0 for all; beyond loopback the security "
                        "rules apply).", metavar="HOST", where=_SERVE)
    port: int = setting(50051, help="gRPC port (0: a free port). Embedded servers take serve()'s port argument.",
                        minimum=0, maximum=65535, metavar="PORT", where=_SERVE)


@dataclass(kw_only=True, slots=True)
class HaltConfig(Group):
    """What happens to the runs at a divergence."""

    group: ClassVar[str] = "halt"

    on_divergence: bool = setting(False, help="Send HALT to every process of every run of a session once its first "
                                  "divergence is declared (several candidates: each halts alone at its own, all halt "
                                  "with the last; docs/three-way.md).", legacy="halt_on_divergence")
    after_gap: bool = setting(True, help="With on_divergence: also halt on a divergence found after steps that were "
                              "never compared (it is the earliest among compared steps, and may have begun in the "
                              "gap). False holds such a divergence for the user to decide (twinstep halt); the report "
                              "and the alert say why.", legacy="halt_after_gap")
    prepare_timeout: float = setting(2.0, help="Seconds to wait for every rank's current step before naming the "
                                     "halt step.", minimum=0, unit="seconds", legacy="halt_prepare_timeout")
    bundle: bool = setting(False, help="With on_divergence: before halting, every run writes a reproducer bundle "
                           "of the divergent module (its inputs, parameters and output) at one step every rank can "
                           "still reach, and halts at the end of that step (a few steps later than a plain halt). "
                           "twinstep reproduce runs it (docs/zoom-and-reproduce.md).", legacy="bundle_on_halt")


@dataclass(kw_only=True, slots=True)
class WindowConfig(Group):
    """How far runs may drift apart before the server slows or drops."""

    group: ClassVar[str] = "window"

    steps: int = setting(256, help="Unmatched steps held per run and rank before the oldest is dropped (and the run "
                         "is slowed by credit).", minimum=1, unit="steps", legacy="window_steps")
    bytes: int = setting(1 << 30, help="Bytes of unmatched steps held per run and rank (tensor mode).", minimum=1,
                         unit="bytes", legacy="window_bytes")
    inflight_steps: int = setting(16, help="Steps a stream may send ahead of what the server has taken: bounds "
                                  "acknowledgement latency and the memory in gRPC's buffers when clients outpace the "
                                  "server (their outboxes then drop and count steps).", minimum=1, unit="steps",
                                  legacy="max_inflight_steps")


@dataclass(kw_only=True, slots=True)
class ComparisonConfig(Group):
    """How runs are compared (beyond the tolerances and the mapping)."""

    group: ClassVar[str] = "comparison"
    flag_prefix: ClassVar[str] = ""

    auto_mapping: bool = setting(True, help="When module names differ, align the runs' modules automatically (see "
                                 "twinstep mapping).", legacy="auto_mapping")
    noise_multiple: float = setting(3.0, help="With a reference rerun in the session, a candidate's tolerance is "
                                    "this multiple of the record's noise band.", minimum=0, legacy="noise_multiple")
    noise_floor: float = setting(0.1, help="With a reference rerun: the noise-band tolerance is never below "
                                 "this fraction of the default tolerance (a deterministic rerun has a band of 0).", minimum=0, legacy="noise_floor")
    drift_window: int = setting(1000, help="Steps averaged by the long-run loss and gradient-norm criteria.",
                                minimum=1, unit="steps", legacy="drift_window")
    layouts: str = setting("auto", help="How runs of several ranks line up (docs/layouts.md): auto compares rank "
                           "by rank when every run has the same parallel layout and merges each run's ranks per "
                           "logical tensor when they differ (TP=2 against TP=1, DP=4 against DP=2); ranks or "
                           "logical force one way.", choices=("auto", "ranks", "logical"), flag="--layouts")


@dataclass(kw_only=True, slots=True)
class DiagnosisConfig(Group):
    """What the server finds out by itself about a divergence."""

    group: ClassVar[str] = "diagnosis"
    flag_prefix: ClassVar[str] = ""

    trace_origins: bool = setting(True, help="Trace a divergence back to the step that caused it with no reference "
                                  "run (docs/origin.md): an update (or a parameter-free module) whose error stands "
                                  "clearly over what a faithful float32 pair shows, and grows, is named as the origin "
                                  "even while under every tolerance. Its floors were calibrated on float32 ports; "
                                  "false turns it off.", legacy="trace_origins")
    auto_zoom: bool = setting(False, help="After a divergence the session does not halt on, zoom in by itself "
                              "(docs/zoom-and-reproduce.md): the next auto_zoom_steps steps bring full tensors of the "
                              "divergent module and its neighbours (parent, siblings, children) from every run, the "
                              "same steps on every rank; the rest stays as attached.", legacy="auto_zoom")
    auto_zoom_steps: int = setting(3, help="Steps an auto_zoom lasts.", minimum=1, unit="steps",
                                   legacy="auto_zoom_steps")
    auto_ops: bool = setting(True, help="After a divergence the session does not halt on, whose culprit is a "
                             "module's own code (its output differs while its input and hooked children match, or a "
                             "module's input differs while its siblings before it match): every run captures that "
                             "module's operations in one call at one step all ranks can reach, and the report names "
                             "the first operation that differs and its line (docs/operations.md). One module, one "
                             "step: cheap.", legacy="auto_ops")


@dataclass(kw_only=True, slots=True)
class SessionsConfig(Group):
    """How long sessions, and runs that went away, are kept."""

    group: ClassVar[str] = "sessions"
    flag_prefix: ClassVar[str] = ""

    ttl: float = setting(3600.0, help="Seconds a session stays in memory after its last run ended; then only its "
                         "report is kept (in the journal, or in memory without one) and twinstep sessions still lists "
                         "it.", minimum=0, unit="seconds", flag="--session-ttl", legacy="session_ttl")
    reconnect_grace: float = setting(30.0, help="Seconds a run whose stream broke may take to reconnect (clients "
                                     "retry with backoff up to 10 s) before the other runs' steps it has not matched "
                                     "are released and the session's verdict can be told. It shows as lost at once; a "
                                     "rank that comes back resumes where the server's record of it ends.", minimum=0,
                                     unit="seconds", legacy="reconnect_grace")
    resume_grace: float = setting(120.0, help="After a restart, seconds a stream that was open may take to "
                                  "reconnect before its run is marked lost.", minimum=0, unit="seconds",
                                  legacy="resume_grace")
    max_archived: int = setting(1000, help="Without a journal: reports of sessions that left memory kept for "
                                "GetReport, oldest forgotten first.", minimum=1, legacy="max_archived")


@dataclass(kw_only=True, slots=True)
class JournalConfig(Group):
    """The journal that lets sessions survive a restart of the server."""

    group: ClassVar[str] = "journal"

    directory: str | None = setting(None, help="Directory of the journal (none: sessions live in memory only).",
                                    flag="--journal", env="TWINSTEP_JOURNAL", metavar="DIR", path=True,
                                    legacy="journal")
    sync: str = setting("normal", help="normal: a commit survives the server process dying; full: also a power loss "
                        "(an fsync per commit).", choices=("normal", "full"), legacy="journal_sync")


@dataclass(kw_only=True, slots=True)
class RecordingConfig(Group):
    """Record sessions, and replay a recording as a session's baseline (docs/recording.md)."""

    group: ClassVar[str] = "recording"

    directory: str | None = setting(None, help="Directory where every session's inputs are recorded, one compressed "
                                    "file per session, so that a later candidate can be compared against a recorded "
                                    "baseline (none: nothing is recorded).", flag="--record", metavar="DIR",
                                    path=True, legacy="record")
    budget_bytes: int = setting(10 << 30, help="Bytes the recordings in the directory may take: past it the oldest "
                                "finished recordings are deleted, then recordings still being written take no more "
                                "steps (each told in the log, counted, noted in the file).", minimum=1, unit="bytes",
                                flag="--record-budget", legacy="record_budget")
    replay: dict[str, str] = setting(default_factory=dict, help="Sessions whose baseline is a recording: SESSION=PATH"
                                     "[:RUN] (a recording file, or a directory holding recordings of that session: "
                                     "the newest; RUN: which recorded run, default its baseline), played at the pace "
                                     "of the live candidates that join the session (repeatable; adds to the file's).",
                                     flag="--replay", metavar="SESSION=PATH[:RUN]", path=True, merge=True,
                                     legacy="replay", check=_replay_sources)


@dataclass(kw_only=True, slots=True)
class DashboardConfig(Group):
    """The live dashboard and /metrics over HTTP (docs/dashboard.md)."""

    group: ClassVar[str] = "dashboard"
    flag_prefix: ClassVar[str] = ""

    port: int | None = setting(None, help="Also serve the live dashboard and /metrics over HTTP on this port (0: a "
                               "free port; HTTPS with the server's TLS certificate, the same tokens).", minimum=0,
                               maximum=65535, flag="--http-port", metavar="PORT")
    host: str | None = setting(None, help="Interface of the dashboard (default: the gRPC host; the loopback rule "
                               "applies).", flag="--http-host", metavar="HOST")
    history_steps: int = setting(128, help="Dashboard history per candidate: the latest this many compared steps keep "
                                 "a column each in the heatmap and curves; older steps merge into at most as many "
                                 "coarser columns, each holding every module's worst record over its steps. A heatmap "
                                 "cell takes 9 bytes, so a candidate holds at most rows x 2 x history_steps x 9 bytes "
                                 "(1,500 rows at the default: 3.5 MB).", minimum=1, unit="steps",
                                 legacy="history_steps")
    history_rows: int = setting(20000, help="Heatmap rows (a module or parameter in one phase) kept per candidate; "
                                "rows past it are counted and shown as not kept. With history_steps, the bound on the "
                                "history's memory (20,000 rows: 46 MB).", minimum=1, legacy="history_rows")


@dataclass(kw_only=True, slots=True)
class AlertsConfig(Group):
    """Webhooks told of divergences, halts, lost runs and capture failures (docs/alerts.md)."""

    group: ClassVar[str] = "alerts"
    flag_prefix: ClassVar[str] = ""

    webhooks: list[WebhookConfig] = setting(default_factory=list, help="Receivers, each a url or a mapping with url, "
                                            "format, events, headers, timeout, max_attempts, queue_size.",
                                            legacy="webhooks", load=lambda raw, where, _: webhooks_from_list(raw, where))
    webhook_urls: list[str] = setting(default_factory=list, help="POST divergences, halts, lost runs and capture "
                                      "failures to these URLs too (repeatable; in the variable, separated by spaces).",
                                      flag="--webhook", metavar="URL")
    webhook_format: str = setting("json", help="Body of the webhook_urls POSTs: twinstep's JSON payload, or a Slack "
                                  "incoming-webhook message.", choices=FORMATS, flag="--webhook-format")

    def receivers(self) -> list[WebhookConfig]:
        """Every receiver: the ``webhooks`` entries, then one per ``webhook_urls`` address."""
        return [*self.webhooks, *(WebhookConfig(url=url, format=self.webhook_format) for url in self.webhook_urls)]


@dataclass(kw_only=True, slots=True)
class SecurityConfig(Group):
    """TLS and tokens (docs/security.md); twinstep.server.security enforces them."""

    group: ClassVar[str] = "security"
    flag_prefix: ClassVar[str] = ""

    tls_cert: str | None = setting(None, help="PEM certificate (chain) the server presents.", env="TWINSTEP_TLS_CERT",
                                   metavar="FILE", path=True)
    tls_key: str | None = setting(None, help="Its PEM private key.", env="TWINSTEP_TLS_KEY", metavar="FILE", path=True)
    tls_client_ca: str | None = setting(None, help="Require client certificates signed by this CA: mutual TLS.",
                                        env="TWINSTEP_TLS_CLIENT_CA", metavar="FILE", path=True)
    self_signed: str | None = setting(None, help="Use DIR/server.crt and DIR/server.key, generating a self-signed pair "
                                      "there first if absent (instead of tls_cert and tls_key).", metavar="DIR",
                                      path=True)
    operator_token: str | None = setting(None, help="Token that may do everything, halt included.",
                                         env="TWINSTEP_OPERATOR_TOKEN", metavar="TOKEN", secret=True)
    session_tokens: list[str] = setting(default_factory=list, help="Tokens for one session's jobs and watchers, "
                                        "SESSION=TOKEN (repeatable; adds to the tokens file's).",
                                        flag="--session-token", env="", metavar="SESSION=TOKEN", secret=True,
                                        check=_session_token)
    tokens_file: str | None = setting(None, help="File of SESSION=TOKEN lines, # comments.",
                                      env="TWINSTEP_TOKENS_FILE", metavar="FILE", path=True)
    insecure: bool = setting(False, help="Allow plaintext or no tokens on a non-loopback host (with a warning).",
                                    env="TWINSTEP_INSECURE")

    def build(self, host: str):
        """The server's ServerSecurity: files read, a self-signed pair generated if asked; ValueError naming why not."""
        from twinstep.server.security import ServerSecurity, parse_session_token, read_tokens_file, self_signed

        cert, key = self.tls_cert, self.tls_key
        if self.self_signed:
            cert_path, key_path = self_signed(self.self_signed, hosts=[host])
            cert, key = str(cert_path), str(key_path)
        tokens = read_tokens_file(self.tokens_file) if self.tokens_file else []
        tokens += [parse_session_token(text) for text in self.session_tokens]
        return ServerSecurity(tls_cert=cert, tls_key=key, tls_client_ca=self.tls_client_ca,
                              operator_token=self.operator_token, session_tokens=tokens, insecure=self.insecure)


@dataclass(kw_only=True, slots=True)
class LimitsConfig(Group):
    """Bounds that keep one server serving many sessions."""

    group: ClassVar[str] = "limits"
    flag_prefix: ClassVar[str] = ""

    max_workers: int = setting(256, help="gRPC handler threads: each training process and each watcher holds one.",
                               minimum=4, legacy="max_workers")
    max_message_bytes: int = setting(256 << 20, help="Largest client message accepted; larger ones end that stream "
                                     "with RESOURCE_EXHAUSTED.", minimum=1, unit="bytes", legacy="max_message_bytes")
    max_sessions: int = setting(64, help="Sessions one server holds; a stream naming one more is refused with "
                                "RESOURCE_EXHAUSTED.", minimum=1, legacy="max_sessions")
    max_runs_per_session: int = setting(16, help="Runs (baseline, references, candidates) one session holds; one more "
                                        "is refused with RESOURCE_EXHAUSTED.", minimum=1, legacy="max_runs_per_session")


@dataclass(kw_only=True, slots=True)
class MemoryConfig(Group):
    """The memory held for alignment, and how the allocator treats what is freed."""

    group: ClassVar[str] = "memory"

    budget_bytes: int = setting(8 << 30, help="Server-wide bound on the steps held for alignment, over every session. "
                                "Past it, the held steps of sessions whose runs have all ended are freed, least "
                                "recently active first (their reports stay); sessions still streaming keep their own "
                                "per-rank windows (window.steps, window.bytes).", minimum=1, unit="bytes",
                                legacy="memory_budget_bytes")
    release_freed: bool = setting(False, help="Let the allocator return freed memory to the OS: a smaller resident "
                                  "size after bursts, at the cost of page faults on every tensor piece (see "
                                  "twinstep.server.memory).", flag="--release-freed-memory", where=_SERVE)


@dataclass(kw_only=True, slots=True)
class SyncConfig(Group):
    """Weight sync and batch sync: what the server holds for candidates (docs/weight-sync.md, records-and-batches.md)."""

    group: ClassVar[str] = "sync"
    flag_prefix: ClassVar[str] = ""

    weights_budget_bytes: int = setting(4 << 30, help="Bytes of baselines' initial parameters held for candidates "
                                        "that attach with init_from_baseline, over every session. Past it the oldest "
                                        "publication is dropped; a baseline whose parameters alone exceed it is "
                                        "refused with a clear error (raise it for large models).", minimum=1,
                                        unit="bytes", legacy="weights_budget_bytes")
    batch_buffer_bytes: int = setting(512 << 20, help="Bytes of published batches one session holds for its "
                                      "candidates. Past it, batches a candidate already took go first, then the "
                                      "oldest; a candidate asking for a dropped step is told so at once. A baseline "
                                      "far ahead of its candidates needs more (or lockstep).", minimum=1,
                                      unit="bytes", legacy="batch_buffer_bytes")
    batch_max_bytes: int = setting(48 << 20, help="Largest batch (tensor bytes, before compression) one PublishBatch "
                                   "may carry; larger ones are refused with a clear error and counted. Under the "
                                   "server's 64 MiB limit on one message it sends.", minimum=1, unit="bytes",
                                   legacy="batch_max_bytes")


@dataclass(kw_only=True, slots=True)
class ShardingConfig(Group):
    """The comparison spread over processes as Ray actors, for many ranks (docs/scale.md)."""

    group: ClassVar[str] = "sharding"
    flag_prefix: ClassVar[str] = ""

    shards: int = setting(0, help="Comparator shards (Ray actors), each comparing its share of every session's ranks "
                          "behind the one address clients attach to; 0: the whole comparison in this process.",
                          minimum=0, where=_SERVE)
    ray_address: str | None = setting(None, help="A running Ray cluster to start the shards on (e.g. auto, or "
                                      "HOST:6379); none: a local Ray instance started and stopped with the server.",
                                      where=_SERVE)
    key: str = setting("rank", help="What a shard owns: rank gives rank r of every run of a session to shard "
                       "r modulo shards (runs of one parallel layout); session gives a whole session to one shard (runs "
                       "of different layouts, whose ranks are merged).", choices=("rank", "session"),
                       flag="--shard-by", where=_SERVE)
    ray_cpus: int = setting(0, help="CPUs a local Ray instance declares (0: the machine's, at least one per shard); "
                            "each shard asks for one.", minimum=0, where=_SERVE)
    poll_interval: float = setting(0.25, help="Seconds between the coordinator's polls of the shards: the delay a "
                                   "divergence found on a shard waits before the session declares it.", minimum=0.01,
                                   unit="s", flag="--shard-poll", where=_SERVE)


def _load_tolerances(raw: Any, where: str, base_dir: pathlib.Path) -> ToleranceConfig:
    return ToleranceConfig.from_dict(raw, where)


def _load_mapping(raw: Any, where: str, base_dir: pathlib.Path) -> NameMapping:
    return NameMapping.from_dict(raw, where)


def _mapping_file(raw: Any, where: str, base_dir: pathlib.Path, values: dict[str, Any]) -> dict[str, Any]:
    """``mapping_file: FILE``: the mapping in a file of its own (over ``mapping:``)."""
    return {"mapping": NameMapping.from_dict(_read_yaml(base_dir / str(raw), where), where)}


def _layer_mapping_file(raw: Any, where: str, base_dir: pathlib.Path, values: dict[str, Any]) -> dict[str, Any]:
    """``layer_mapping_file: FILE``: an msprobe layer_mapping file, class-keyed, as is (added to the mapping)."""
    path = base_dir / str(raw)
    mapping = values.get("mapping") or NameMapping()
    mapping.layer_mapping = layer_mapping_from_dict(_read_yaml(path, where), f"{where} {path}")
    return {"mapping": mapping}


def _read_yaml(path: pathlib.Path, where: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read {where} {path}: {exc}") from None


@dataclass(kw_only=True, slots=True)
class ServerConfig:
    """Every setting of the server, in groups (each group's fields: twinstep.server._settings.setting)."""

    listen: ListenConfig = field(default_factory=ListenConfig)
    halt: HaltConfig = field(default_factory=HaltConfig)
    window: WindowConfig = field(default_factory=WindowConfig)
    comparison: ComparisonConfig = field(default_factory=ComparisonConfig)
    diagnosis: DiagnosisConfig = field(default_factory=DiagnosisConfig)
    sessions: SessionsConfig = field(default_factory=SessionsConfig)
    journal: JournalConfig = field(default_factory=JournalConfig)
    recording: RecordingConfig = field(default_factory=RecordingConfig)
    dashboard: DashboardConfig = field(default_factory=DashboardConfig)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    tolerances: ToleranceConfig = setting(default_factory=ToleranceConfig, help="Per phase and metric, with overrides "
                                          "by module name (docs/tolerances.md).", load=_load_tolerances)
    mapping: NameMapping = setting(default_factory=NameMapping, help="Candidate module names to baseline names: exact, "
                                   "prefix, regex, fused, permuted (docs/mapping.md). Also from mapping_file: FILE, "
                                   "and layer_mapping_file: FILE (an msprobe layer_mapping file).", load=_load_mapping)

    #: YAML keys that are not settings but fill one: (raw, where, folder, values so far) -> {dotted: value}.
    file_only_keys: ClassVar[dict[str, Any]] = {"mapping_file": _mapping_file, "layer_mapping_file": _layer_mapping_file}

    @staticmethod
    def reconcile(values: dict[str, Any], sources: dict[str, str]) -> None:
        """security.self_signed and tls_cert/tls_key exclude each other: the higher source wins; one source: error."""
        if "security.self_signed" not in values:
            return
        cert = [k for k in ("security.tls_cert", "security.tls_key") if k in values]
        if not cert:
            return
        mine, theirs = _rank(sources["security.self_signed"]), max(_rank(sources[k]) for k in cert)
        if mine == theirs:
            raise ValueError("--self-signed and --tls-cert/--tls-key are exclusive "
                             "(security.self_signed, security.tls_cert and security.tls_key)")
        for key in cert if mine > theirs else ["security.self_signed"]:
            values.pop(key)
            sources.pop(key)


def _rank(source: str) -> int:
    return 3 if source.startswith("--") else 2 if source.startswith("TWINSTEP_") else 1


def load_config(path: str | pathlib.Path) -> ServerConfig:
    """Read a YAML config (no environment, no flags); raises ValueError naming the file and option at fault."""
    path = pathlib.Path(path)
    data = _read_yaml(path, "config") or {}
    return config_from_dict(data, base_dir=path.parent, where=str(path))


def config_from_dict(data: Any, base_dir: pathlib.Path = pathlib.Path("."), where: str = "config") -> ServerConfig:
    """A config from parsed YAML (nested groups; flat keys of older files too): ValueError naming the option."""
    values, _ = read_mapping(data, ServerConfig, base_dir, where)
    try:
        return build(ServerConfig, values)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def resolve_config(flags: dict[str, Any] | None = None, environ: Any = None, config_file: str | None = None) -> Resolved:
    """Every setting from ``flags`` (dotted name -> command-line text), the environment, the YAML file, defaults."""
    return resolve(ServerConfig, flags, environ, config_file)
