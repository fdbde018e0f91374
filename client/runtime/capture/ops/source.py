"""The source line that made a call: the first frame outside the framework and twinstep's capture code.

Only ``twinstep/runtime/capture`` is skipped, not all of twinstep: the demo models
(``twinstep.tools.demo``) are user code as far as a report is concerned.
"""

from __future__ import annotations

import linecache
import os
import sys

import twinstep

#: Longest line text sent.
MAX_CODE = 200
_CAPTURE = os.path.join(os.path.dirname(twinstep.__file__), "runtime", "capture") + os.sep


class SourceFinder:
    """Finds, for a call made now, the user's (or a library's) line that made it; cached per code location."""

    def __init__(self, framework_dir: str) -> None:
        """``framework_dir``: the framework package's folder (calls made inside it are its own)."""
        self._skip = (framework_dir.rstrip(os.sep) + os.sep, _CAPTURE)
        self._text: dict[tuple[str, int], str] = {}

    def caller(self) -> tuple[str, int, str]:
        """(file, line, the line's text) of the nearest frame outside the skipped folders; ("", 0, "") if none."""
        frame = sys._getframe(1)
        skip = self._skip
        while frame is not None:
            filename = frame.f_code.co_filename
            if not filename.startswith(skip):
                line = frame.f_lineno
                key = (filename, line)
                text = self._text.get(key)
                if text is None:
                    text = self._text[key] = linecache.getline(filename, line).strip()[:MAX_CODE]
                return filename, line, text
            frame = frame.f_back
        return "", 0, ""
