"""Command lines as written in help texts and docs, parsed by the real parser (shared by the help and docs tests)."""

from __future__ import annotations

import argparse
import shlex

from twinstep.cli.main import build_parser


def twinstep_lines(text: str) -> list[str]:
    """The `twinstep ...` command lines of a text, without prompts, comments, redirections and pipes."""
    lines = []
    for line in text.splitlines():
        line = line.split("  #", 1)[0].strip()
        if line.startswith("$ "):
            line = line[2:]
        if line.startswith("twinstep "):
            lines.append(line.split(" > ", 1)[0].split(" | ", 1)[0].split(" & ", 1)[0].rstrip(" &"))
    return lines


def parse_command_line(line: str) -> argparse.Namespace:
    """Parse one `twinstep ...` line as the shell would pass it (environment variables as placeholders)."""
    words = [w.replace("$", "") for w in shlex.split(line)][1:]
    try:
        return build_parser().parse_args(words)
    except SystemExit as exit:  # argparse's way of refusing
        raise AssertionError(f"does not parse: {line!r}") from exit
