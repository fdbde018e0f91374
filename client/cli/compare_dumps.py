"""``twinstep compare-dumps A B``: two msprobe statistics dumps judged by twinstep's engine, offline.

A is the baseline, B the candidate.  Each is msprobe's dump_path (step{N}/rank{R}
directories), one rank directory, or one dump.json.  Both are converted to the
records a live run streams (twinstep.server.ingest.msprobe) and compared in
this process by the server's own Session (twinstep.server.offline): the same
alignment, tolerances, name mapping, first-divergence detection and report,
text or JSON (the schema of ``twinstep report --json``).  No server is needed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

EXAMPLES = """\
examples:
  twinstep compare-dumps dump_gpu dump_npu                       # msprobe dump_path of each run: every step and rank
  twinstep compare-dumps dump_gpu/step0/rank0 dump_npu/step0/rank0 --json > report.json
  twinstep compare-dumps gpu_run npu_run --mapping mapping.yaml --names gpu npu
  twinstep compare-dumps a/dump.json b/dump.json --layer-mapping layer_mapping.yaml --config tolerances.yaml

exit status: 0 aligned, 1 diverged or not fully compared, 2 a dump or option could not be read.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "compare-dumps", help="compare two msprobe statistics dumps (dump.json) with twinstep's engine",
        description="Compare two msprobe statistics dumps (task 'statistics', levels L0, L1 or mix) offline, "
                    "through the comparison engine and report of a live session: A is the baseline, B the "
                    "candidate. Each is a dump_path with step{N}/rank{R} directories, one such directory, or "
                    "one dump.json. See docs/msprobe.md for what is compared.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", metavar="A", help="the baseline's dump")
    parser.add_argument("b", metavar="B", help="the candidate's dump")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (twinstep report --schema)")
    parser.add_argument("--config", metavar="FILE",
                        help="server config YAML: tolerances, mapping, mapping_file, layer_mapping_file")
    parser.add_argument("--mapping", metavar="FILE",
                        help="name mapping YAML (candidate names -> baseline names; a file with a TopLayer key is "
                             "read as msprobe's layer_mapping)")
    parser.add_argument("--layer-mapping", metavar="FILE", help="an msprobe layer_mapping YAML (class-keyed)")
    parser.add_argument("--names", nargs=2, metavar=("BASELINE", "CANDIDATE"), default=("a", "b"),
                        help="run names in the report (default: a b)")
    return parser


def run(args: argparse.Namespace) -> int:
    from twinstep.server.errors import InputError
    from twinstep.server.ingest.msprobe import DumpError

    try:
        report = compare(args)
    except (DumpError, ValueError) as error:
        return _fail(str(error))
    except InputError as error:  # the converted records were refused: say which dump, what and where
        return _fail(f"the engine refused the converted records: {error.message}")
    except OSError as error:
        return _fail(f"cannot read {error.filename or 'a file'}: {error.strerror or error}")
    except Exception as error:  # never a traceback: say what happened and how to report it
        logging.getLogger("twinstep").debug("compare-dumps failed", exc_info=True)
        return _fail(f"internal error ({type(error).__name__}: {error}); please report it with the dumps' "
                     "first lines")
    from twinstep.server.report.render import render_text, report_to_dict

    if args.json:
        print(json.dumps(report_to_dict(report), indent=2))
    else:
        print(render_text(report))
    return 0 if report.status == "aligned" else 1


def compare(args: argparse.Namespace):
    """The Report of dump A (baseline) against dump B; DumpError or ValueError when one cannot be read."""
    from twinstep.server.ingest.msprobe import DumpRun
    from twinstep.server.offline import RecordedRun, compare_recorded

    config = _config(args)
    base_name, cand_name = args.names
    if base_name == cand_name:
        raise ValueError("--names: the two runs need different names")
    session = "compare-dumps"
    dumps = [DumpRun(args.a, session, base_name, baseline=True), DumpRun(args.b, session, cand_name, baseline=False)]
    runs = []
    for dump in dumps:
        print(f"reading {dump.describe()}", file=sys.stderr, flush=True)
        messages = dump.convert()
        notes = dump.notes()
        if dump is dumps[1] and dump.level != dumps[0].level:
            notes.append(f"dumped at level {dump.level}, the baseline at {dumps[0].level}: records of one level "
                         "only are listed as unmatched")
        runs.append(RecordedRun({rank: dump.hello(rank, notes) for rank in dump.ranks}, messages))
    server_log = logging.getLogger("twinstep.server")
    level = server_log.level
    server_log.setLevel(logging.ERROR)  # the report says it all; the session's alerts would repeat it
    try:
        return compare_recorded(runs, config, session)
    finally:
        server_log.setLevel(level)


def _config(args: argparse.Namespace):
    import pathlib

    import yaml

    from twinstep.server.compare.mapping import NameMapping, layer_mapping_from_dict
    from twinstep.server.config import ServerConfig, load_config

    config = load_config(args.config) if args.config else ServerConfig()
    config.halt.on_divergence = False
    if args.mapping:
        config.mapping = NameMapping.from_dict(_yaml(yaml, pathlib.Path(args.mapping)), f"--mapping {args.mapping}")
    if args.layer_mapping:
        config.mapping.layer_mapping = layer_mapping_from_dict(
            _yaml(yaml, pathlib.Path(args.layer_mapping)), f"--layer-mapping {args.layer_mapping}")
    return config


def _yaml(yaml, path):
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"cannot read {path}: {error}") from None


def _fail(message: str) -> int:
    print(f"twinstep compare-dumps: {message}", file=sys.stderr)
    return 2
