"""``twinstep run``: attach to a training script without editing it.

The command is replaced by the training command (``exec``), with the settings
in ``TWINSTEP_*`` environment variables, twinstep's bootstrap first on
``PYTHONPATH`` and ``TWINSTEP_AUTO_ATTACH=1``.  Replacing the process rather
than starting a child is what opentelemetry-instrument and ddtrace-run do:
the exit code, signals (Ctrl-C, a scheduler's SIGTERM) and the process's
place under torchrun or a batch system are the training's own, with nothing
in between to forward or to outlive it.  See docs/zero-code.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from twinstep._settings import METAVARS, option_sections
from twinstep.runtime import settings

EXAMPLES = """\
examples:
  twinstep run --session port --run torch --baseline --server 127.0.0.1:50051 -- python train.py --lr 1e-3
  twinstep run --session port --run paddle --server 127.0.0.1:50051 -- python train_paddle.py
  twinstep run --config twinstep.yaml --run paddle -- python -m paddle.distributed.launch --nproc_per_node 8 train.py
  twinstep run --session port --run torch --baseline -- torchrun --nproc_per_node 8 train.py
  twinstep run --config twinstep.yaml --run torch --show-config    # where each setting comes from

Every option can also come from its environment variable (TWINSTEP_SESSION, TWINSTEP_RUN,
TWINSTEP_SERVER, TWINSTEP_CAPTURE, ...) or from the config file (--config, TWINSTEP_CONFIG):
options > environment > file > defaults.  The model is the first module, called with autograd
on, whose parameters an optimizer updates; a step ends when that optimizer's step() returns.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``twinstep run``; every attach setting with an option becomes one (twinstep.runtime.settings)."""
    parser = subparsers.add_parser(
        "run", help="run a training command with twinstep attached, without editing it",
        description="Run a training command (python, torchrun, python -m paddle.distributed.launch) with "
                    "twinstep attached to its model and optimizer, without editing the script.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE", help="YAML file of settings (default: $TWINSTEP_CONFIG)")
    parser.add_argument("--show-config", action="store_true",
                        help="print every setting, its value and where it comes from, and exit")
    for section, item in option_sections(parser, settings.AttachSettings, lambda s: s.option):
        _add_option(section, item)
    parser.add_argument("training", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS ...]",
                        help="the training command, after --")
    return parser


def _add_option(parser: argparse._ActionsContainer, item: settings.Setting) -> None:
    """The setting's option: its help's first sentence, its variable and its default."""
    assert item.option is not None
    help_text = f"{item.summary} (default: ${item.env}"
    help_text += f", else {item.default_text()})" if not item.spec.required and item.default is not None else ")"
    help_text = help_text.replace("%", "%%")
    if item.kind == "flag":
        parser.add_argument(item.option, dest=item.name, action=argparse.BooleanOptionalAction, default=None,
                            help=help_text)
    elif item.kind == "patterns":
        parser.add_argument(item.option, dest=item.name, action="append", metavar="PATTERN",
                            help=help_text + "; repeatable, or comma-separated")
    else:
        metavar = ("{" + ",".join(item.choices) + "}" if item.choices else item.spec.metavar
                   or METAVARS.get(item.kind, item.name.upper()))
        parser.add_argument(item.option, dest=item.name, metavar=metavar, help=help_text)


def child_environment(args: argparse.Namespace, base: dict[str, str] | None = None) -> dict[str, str]:
    """The training's environment: the options as TWINSTEP_* variables, the bootstrap first on PYTHONPATH."""
    from twinstep.runtime.autoattach import BOOTSTRAP_DIR, ENV_ACTIVE

    env = dict(os.environ if base is None else base)
    for item in settings.SETTINGS:
        value = getattr(args, item.name, None) if item.option else None
        if value is None:
            continue
        text = item.text(value)
        item.read(text, item.option)  # a bad option is named as the user wrote it
        env[item.env] = text
    if args.config:
        env[settings.ENV_CONFIG] = os.path.abspath(args.config)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != BOOTSTRAP_DIR]
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *paths])
    env[ENV_ACTIVE] = "1"
    return env


def check_before_start(chosen: settings.AttachSettings) -> None:
    """Refuse (ValueError: exit code 2) what ``attach`` would refuse inside the training, before it starts.

    ``attach`` checks the same in every process, but there a refusal only logs a line and the training
    runs on without twinstep, which is not what the command asked for.  Checked here: the settings
    together (roles, rank), the server's address, the TLS files (read), the token, the sender.  What can
    fail only later (a server down or not yet up, a token it refuses) stays fail-open: the training runs.
    """
    from twinstep.runtime.transport.security import ClientSecurity
    from twinstep.runtime.transport.shared_memory import AVAILABLE as SHARED_MEMORY_AVAILABLE
    from twinstep.runtime.transport.stream import check_target

    chosen.check()
    connection = chosen.connection
    check_target(connection.server or "")
    # As attach resolves them: an empty value means none, and the environment is not read again.
    ClientSecurity.resolve(token=connection.token or "", tls_ca=connection.tls_ca or "",
                           tls_client_cert=connection.tls_client_cert or "",
                           tls_client_key=connection.tls_client_key or "", insecure=connection.insecure)
    if chosen.transport.sender == "process" and not SHARED_MEMORY_AVAILABLE:
        raise ValueError("sender='process' needs shared memory files (os.memfd_create, Linux)")


def run(args: argparse.Namespace) -> int:
    command = list(args.training)
    if command[:1] == ["--"]:
        command = command[1:]
    env = child_environment(args)
    resolved = settings.resolve(environ=env)  # a bad setting stops here, before the training starts
    for item in settings.SETTINGS:
        if item.option and getattr(args, item.name, None) is not None:
            resolved.sources[item.name] = item.option
    if args.show_config:
        print(f"config file: {resolved.config_file or 'none'}")
        print(resolved.describe())
        return 0
    missing = [item.name for item in settings.SETTINGS if item.spec.required and not resolved.values[item.name]]
    if missing:
        raise ValueError(f"no {', no '.join(missing)} given: pass --{' --'.join(missing)}, set "
                         f"{', '.join(settings.BY_NAME[m].env for m in missing)}, or put them in the config file")
    check_before_start(resolved.settings)
    if not command:
        raise ValueError("no training command: twinstep run [OPTIONS] -- python train.py [ARGS]")
    values = resolved.values
    print(f"twinstep run: run {values['run']!r}{' (baseline)' if values['baseline'] else ''} of session "
          f"{values['session']!r} at {values['server']}, capture {values['capture']}: {shlex.join(command)}",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    try:
        if os.name != "posix":  # no exec there: run it and pass its exit code on
            import subprocess

            return subprocess.call(command, env=env)
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        print(f"twinstep run: {command[0]!r} was not found (is it on PATH?)", file=sys.stderr)
        return 127
    except PermissionError as error:
        print(f"twinstep run: cannot execute {command[0]!r}: {error.strerror}", file=sys.stderr)
        return 126
    return 0  # not reached: exec does not return
