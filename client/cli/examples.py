"""The examples every ``twinstep COMMAND --help`` ends with.

Kept apart from the parser so each command module can add its own, and so the
tests can parse every example line with the real parser (an example that no
longer parses fails tests/unit_tests/test_cli_help.py).
"""

from __future__ import annotations

import argparse

EXAMPLES: dict[str, str] = {
    "serve": """\
  twinstep serve                                   # loopback, port 50051, sessions in memory
  twinstep serve --port 50051 --halt-on-divergence --config tolerances.yaml
  twinstep serve --host 0.0.0.0 --self-signed ./certs --operator-token s3cret --journal ./journal
  twinstep serve --http-port 8080                  # and the live dashboard at http://127.0.0.1:8080/
  twinstep serve --record recordings --record-budget 20000000000   # keep every session's streams
  twinstep serve --replay port=recordings:torch    # session 'port': its recorded torch run is the baseline""",
    "watch": """\
  twinstep watch demo                              # until every run of session 'demo' has ended
  twinstep watch demo --server 10.0.0.5:50051 --follow""",
    "report": """\
  twinstep report demo                             # the text report of session 'demo'
  twinstep report demo --json > demo.json          # the same, as JSON (schema: twinstep report --schema)
  twinstep report demo --html demo.html            # the dashboard's views in one file that opens offline
  twinstep report demo --csv demo-tables           # errors.csv (per module, phase, step) and curves.csv
  twinstep report --schema""",
    "mapping": """\
  twinstep mapping demo                            # the names the server matched automatically
  twinstep mapping demo --write mapping.yaml       # pin them: server config mapping_file: mapping.yaml""",
    "sessions": """\
  twinstep sessions
  twinstep sessions --json --server 10.0.0.5:50051""",
    "halt": """\
  twinstep halt demo --reason "stopping to fix the GELU port" --token $OPERATOR_TOKEN""",
    "demo": """\
  twinstep demo                                    # a porting bug found, both jobs halted
  twinstep demo --no-bug --steps 50                # a faithful port: aligned
  twinstep demo --bug lr --capture tensors
  twinstep demo --candidate mindspore               # a MindSpore port (pip install mindspore; numpy<2)
  twinstep demo --candidate paddle,mindspore --no-bug  # three-way: both ports against one torch baseline
  twinstep demo --http-port 8080                   # watch it in the dashboard (stays up on a terminal until Ctrl-C)""",
}


def add_examples(subparsers: argparse._SubParsersAction) -> None:
    """End each command's ``--help`` with its examples, kept as written (line breaks and all)."""
    for name, parser in subparsers.choices.items():
        text = EXAMPLES.get(name)
        if text and not parser.epilog:
            parser.epilog = "examples:\n" + text
            parser.formatter_class = argparse.RawDescriptionHelpFormatter
