"""``twinstep serve``: the comparison server in this process, until SIGINT or SIGTERM.

Its flags come from the server's one definition of settings (twinstep.server.config):
each setting's flag, over its environment variable, over the YAML file of ``--config``,
over its default.  Values are read and checked there, not here.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

from twinstep.server._settings import ENV_CONFIG, add_flag, add_flags, all_settings, flags_given
from twinstep.server.config import ServerConfig


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    serve = sub.add_parser("serve", help="run the comparison server")
    serve.add_argument("--config", metavar="FILE",
                       help=f"YAML file of settings, in their groups (halt: {{on_divergence: true}}, tolerances:, "
                            f"mapping:, ...; docs/server.md) (default: ${ENV_CONFIG})")
    serve.add_argument("--show-config", action="store_true",
                       help="print every setting, its value and where it came from (flag, variable, file, default), "
                            "and exit")
    add_flags(serve, ServerConfig)
    return serve


def add_server_flag(parser: argparse.ArgumentParser, dotted: str, help: str | None = None) -> None:
    """One setting's flag on another command that embeds a server (``twinstep demo --http-port``)."""
    add_flag(parser, next(s for s in all_settings(ServerConfig) if s.dotted == dotted), help)


def server_flag(args: argparse.Namespace, dotted: str):
    """That flag's value, read and checked by its setting; None when the command line did not give it."""
    item = next(s for s in all_settings(ServerConfig) if s.dotted == dotted)
    raw = vars(args).get(dotted)
    return None if raw is None else item.read(raw, item.flag or dotted)


def resolved(args: argparse.Namespace, environ=None):
    """The settings of this command line (twinstep.server._settings.Resolved: config and sources)."""
    from twinstep.server.config import resolve_config

    return resolve_config(flags_given(args, ServerConfig), environ, args.config)


def run(args: argparse.Namespace) -> int:
    from twinstep.server import serve
    from twinstep.server.memory import retain_freed_memory

    settings = resolved(args)
    config = settings.config
    if args.show_config:
        print(f"config file: {settings.config_file or '-'}")
        print(settings.describe())
        return 0
    security = config.security.build(config.listen.host)
    if not config.memory.release_freed:
        retain_freed_memory()  # this process is the server's own
    if config.sharding.shards > 0:
        return _run_sharded(config, security)
    handle = serve(port=config.listen.port, host=config.listen.host, config=config, security=security)
    host = config.listen.host
    print(f"twinstep server listening on {host}:{handle.port}"
          f" ({'TLS' if handle.tls else 'plaintext'}{', tokens required' if security.operator_token or security.session_tokens else ''})",
          flush=True)
    if handle.http_url:
        print(f"dashboard: {handle.http_url}", flush=True)
    if config.journal.directory:
        restored = handle.registry.names()
        print(f"journal: {handle.registry.store.directory if handle.registry.store else config.journal.directory}"
              + (f" (restored: {', '.join(restored)})" if restored else ""), flush=True)
    if handle.recording is not None:
        _print_recording(handle.recording)
    if config.security.self_signed:
        print(f"clients trust this server with: export TWINSTEP_TLS_CA={os.path.abspath(security.tls_cert or '')}",
              flush=True)
    _wait_for_signal()
    handle.stop(grace=2.0)
    return 0


def _run_sharded(config, security) -> int:
    """``--shards N``: the front here, the shards on Ray (docs/scale.md)."""
    from twinstep.server.shards import serve_sharded

    if config.dashboard.port is not None or config.recording.directory or config.recording.replay:
        raise ValueError("a sharded server (--shards) serves no dashboard and records nothing yet: leave out "
                         "--http-port, --record and --replay (docs/scale.md)")
    handle = serve_sharded(port=config.listen.port, host=config.listen.host, config=config, security=security)
    tokens = ", tokens required" if security.operator_token or security.session_tokens else ""
    print(f"twinstep server listening on {config.listen.host}:{handle.port}"
          f" ({'TLS' if handle.tls else 'plaintext'}{tokens}; {handle.shards.count} shard(s) by "
          f"{config.sharding.key} on {handle.shards.runtime})", flush=True)
    for index, address in enumerate(handle.shard_addresses()):
        print(f"twinstep shard {index}: pid {handle.coordinator.pids[index]} at {address}", flush=True)
    print(f"journal: {handle.journal} (one folder per shard)", flush=True)
    _wait_for_signal()
    handle.stop(grace=2.0)
    return 0


def _wait_for_signal() -> None:
    stop = {"requested": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["requested"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stop["requested"]:
        time.sleep(0.2)


def _print_recording(service) -> None:
    if service.recorder is not None:
        print(f"recording every session in {service.recorder.directory}", flush=True)
    for session, player in service.players.items():
        print(f"session {session}: baseline {player.run.name!r} played from {player.path}", flush=True)
