"""How twinstep's lines reach a training's log: once each, in its own words, whatever the framework did to logging.

The training side logs on the ``twinstep`` logger, each line starting with "twinstep: ".  Left to Python's
defaults, its informational lines (a zoom the server asked for, operations captured, weights loaded) would
never show, and a framework that configures the root logger rewrites the rest: paddle installs a root
handler at INFO whose format prefixes every line with a time, a level and twinstep's own file and line.

So ``attach`` gives the ``twinstep`` logger a handler of its own (INFO and up, the line as it is, to the
process's current stderr) and the level INFO when none was set.  Records still propagate to the root logger,
so the training's own file handlers and test harnesses get them too; only the root's console handlers that
write to stderr or stdout (paddle's, a ``logging.basicConfig()``) are told to skip the records twinstep has
already written, so each line shows once.  A ``twinstep`` logger the training configured itself (one with
handlers) is left as it is; an embedded server's lines (``twinstep.server``) go where they went before.
"""

from __future__ import annotations

import logging
import sys

_NAME = "twinstep"
_HANDLER = "twinstep-console"
_SHOWN = "_twinstep_shown"


class _Console(logging.StreamHandler):
    """The line as it is, to the stderr of the moment (a test harness may have replaced it since)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.set_name(_HANDLER)
        self.setFormatter(logging.Formatter("%(message)s"))
        self.addFilter(_training_side)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ sets it
        pass

    def emit(self, record: logging.LogRecord) -> None:
        _quiet_root_consoles()  # a framework imported after attach may have added one since
        super().emit(record)
        setattr(record, _SHOWN, True)


def _training_side(record: logging.LogRecord) -> bool:
    """The training side's records; an embedded server's only where Python's last resort would have shown them
    (a warning or worse, the root logger without handlers: this handler's presence keeps the last resort away)."""
    if not (record.name == "twinstep.server" or record.name.startswith("twinstep.server.")):
        return True
    return record.levelno >= logging.WARNING and not logging.getLogger().handlers


def _not_shown(record: logging.LogRecord) -> bool:
    """For the root's console handlers: a record twinstep has written already is not written again."""
    return not getattr(record, _SHOWN, False)


def install() -> None:
    """Give the ``twinstep`` logger its console handler (see the module docstring); idempotent."""
    log = logging.getLogger(_NAME)
    if not any(handler.get_name() == _HANDLER for handler in log.handlers):
        if log.handlers:
            return  # configured by the training: its choice
        log.addHandler(_Console())
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    _quiet_root_consoles()


def _quiet_root_consoles() -> None:
    """The root logger's handlers that write to the console skip what twinstep's own handler wrote."""
    for handler in logging.getLogger().handlers:
        stream = getattr(handler, "stream", None)
        if stream in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__) and _not_shown not in handler.filters:
            handler.addFilter(_not_shown)
