"""What ``serve`` starts for recording and replay (ServerConfig.recording.directory, .replay), and stops with the server."""

from __future__ import annotations

import itertools
import logging
from typing import Iterable

from twinstep.server.config import ServerConfig
from twinstep.server.errors import InputError
from twinstep.server.journal.entries import Entry
from twinstep.server.journal.store import SessionJournal
from twinstep.server.record.catalog import find, scan, split_source
from twinstep.server.record.format import RecordingError
from twinstep.server.record.player import RecordingPlayer
from twinstep.server.record.recorder import Recorder
from twinstep.server.registry import SessionRegistry
from twinstep.server.session import Session

logger = logging.getLogger("twinstep.server")


class RecordService:
    """The server's recorder (``--record``) and recording players (``--replay``)."""

    def __init__(self, recorder: Recorder | None, players: dict[str, RecordingPlayer]) -> None:
        self.recorder = recorder
        self.players = players

    def stop_players(self, timeout: float = 1.0) -> None:
        """Stop feeding recordings into sessions (first, while the sessions still take inputs)."""
        for player in self.players.values():
            player.stop(timeout=timeout)

    def stop(self, grace: float = 2.0) -> None:
        """End every recording with what the sessions took (after the streams have ended)."""
        self.stop_players(timeout=min(grace, 1.0))
        if self.recorder is not None:
            self.recorder.stop(timeout=grace)


def start(registry: SessionRegistry, config: ServerConfig) -> RecordService | None:
    """Start recording every session and playing the configured recordings; ValueError when one cannot be read."""
    if not config.recording.directory and not config.recording.replay:
        return None
    recorder = None
    if config.recording.directory:
        recorder = Recorder(config.recording.directory, config.recording.budget_bytes)
        registry.add_session_listener(lambda session: recorder.attach(session, _history(registry, session)))
        logger.info("recording every session in %s (budget %d bytes)", recorder.directory, recorder.budget)
    players = {}
    try:
        for session, source in config.recording.replay.items():
            players[session] = start_replay(registry, session, source)
            if recorder is not None:
                recorder.protected.add(players[session].path.resolve())
    except BaseException:
        RecordService(recorder, players).stop(grace=0.5)
        raise
    return RecordService(recorder, players)


def start_replay(registry: SessionRegistry, session: str, source: str) -> RecordingPlayer:
    """Play ``source`` (``PATH[:RUN]``) as the baseline of ``session``; ValueError naming what is wrong."""
    path, run_name = split_source(source)
    try:
        index = scan(find(path, session))
        run = index.run(run_name)
    except RecordingError as error:
        raise ValueError(f"replay of session {session!r}: {error}") from None
    try:
        target = registry.get_or_create(session)
    except InputError as error:
        raise ValueError(f"replay of session {session!r}: {error.message}") from None
    if index.problem:
        logger.warning("session %s: the recording will be played up to where it is damaged: %s", session,
                       index.problem)
    return RecordingPlayer(target, index.path, run).start()


def _history(registry: SessionRegistry, session: Session) -> Iterable[Entry] | None:
    """A session restored from the journal: the inputs it took before this server, to record first."""
    journal = session.journal
    if registry.store is None or not isinstance(journal, SessionJournal) or journal.last_seq <= 0:
        return None
    last = journal.last_seq
    return itertools.takewhile(lambda entry: entry.seq <= last, registry.store.entries(journal.session_id))
