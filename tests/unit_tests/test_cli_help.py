"""Every command's --help ends with examples, and every example parses with the real parser."""

from __future__ import annotations

import argparse

import pytest

from tests.cli_lines import parse_command_line, twinstep_lines
from twinstep.cli.main import build_parser


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("name", sorted(_commands()))
def test_help_ends_with_examples_that_parse(name, capsys):
    help_text = _commands()[name].format_help()
    assert "examples:" in help_text, f"twinstep {name} --help has no examples"
    lines = twinstep_lines(help_text.split("examples:", 1)[1])
    assert lines, f"twinstep {name} --help: no 'twinstep ...' example line"
    for line in lines:
        args = parse_command_line(line)
        assert args.command == name, f"example {line!r} runs {args.command}, not {name}"


def test_a_stale_example_is_caught():
    with pytest.raises(AssertionError, match="does not parse"):
        parse_command_line("twinstep serve --no-such-flag")
