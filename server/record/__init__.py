"""Record and replay: sessions kept on disk, and recorded runs compared again later.

- ``format.py``: the recording file (versioned, checksummed frames of journal entries; docs/recording.md);
- ``recorder.py``: ``twinstep serve --record DIR`` copies each session's accepted inputs into its own file;
- ``catalog.py``: which file and which run (``PATH[:RUN]``), found without reading the data;
- ``player.py``: a recorded run played into a live session as its baseline, at the candidates' pace;
- ``compare.py``: two recorded runs compared offline (``twinstep compare-recordings``);
- ``service.py``: what ``serve`` starts and stops for them.
"""

from twinstep.server.record.format import FORMAT_VERSION, RecordingError, RecordingReader, RecordingWriter

__all__ = ["FORMAT_VERSION", "RecordingError", "RecordingReader", "RecordingWriter"]
