#!/usr/bin/env python3
"""Write what is derived from the one definition of each side's settings.

    python scripts/gen_settings_docs.py                   # rewrite every generated part in place
    python scripts/gen_settings_docs.py --check           # change nothing; exit 1 and name what is stale
    python scripts/gen_settings_docs.py "server settings" # only that part (the names below)

Each part sits in a committed file between its markers; the text around it is the file's own:

- ``server settings``: the table of docs/server.md, from twinstep.server.config (between
  ``<!-- BEGIN generated: server settings -->`` and ``<!-- END generated: server settings -->``);
- ``attach settings``: the table of docs/attach.md, from twinstep.runtime.settings (between
  ``<!-- BEGIN generated: attach settings -->`` and ``<!-- END generated: attach settings -->``);
- ``attach keywords``: ``attach``'s keyword arguments in client/runtime/api.py (between
  ``# BEGIN generated: attach keywords`` and ``# END generated: attach keywords``), and their entries
  in attach's docstring (the lines after ``Args:`` up to ``optimizer:``).  Written out, rather than
  taken as ``**settings``, so that every IDE, ``help(twinstep.attach)`` and type checkers see each
  keyword, its type and its meaning.

tests/unit_tests/test_settings.py checks the attach parts are current, and
tests/unit_tests/test_server_settings.py the server's table.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import textwrap
from typing import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
API = "client/runtime/api.py"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def server_table() -> str:
    """One table per group of twinstep.server.config: YAML key, flag, variable, default, meaning."""
    from twinstep.server._settings import groups_of, settings_of
    from twinstep.server.config import ServerConfig

    out: list[str] = []
    sections = [(name, cls.__doc__ or name, settings_of(cls)) for name, cls in groups_of(ServerConfig)]
    sections.append(("top level", "Structured settings, in the YAML file only.", settings_of(ServerConfig)))
    for name, doc, items in sections:
        out.append(f"**{name}**: {_cell(doc.strip().splitlines()[0])}")
        out.append("")
        out.append("| setting | flag | environment | default | meaning |")
        out.append("|---|---|---|---|---|")
        for item in items:
            flag = f"`{item.flag}`" if item.flag else "-"
            if item.flag and item.kind == "flag":
                flag += f" / `--no-{item.flag[2:]}`"
            env = f"`{item.env}`" if item.env else "-"
            meaning = item.help
            if item.spec.legacy and item.spec.legacy != item.dotted:
                meaning += f" Flat key of earlier files: `{item.spec.legacy}`."
            if item.spec.where:
                meaning += f" Read by {item.spec.where} only."
            out.append(f"| `{item.dotted}` | {flag} | {env} | {_cell(item.default_text())} | {_cell(meaning)} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def attach_table() -> str:
    """One table per group of twinstep.runtime.settings: the setting (keyword and YAML key), its variable,
    its option, values, default, meaning."""
    from twinstep.runtime import settings

    out: list[str] = []
    for attribute, group_cls in settings.GROUPS:
        doc = (group_cls.__doc__ or attribute).strip().splitlines()[0]
        out += [f"**{attribute}**: {_cell(doc)}", "",
                "| setting | environment | `twinstep run` | values | default | meaning |", "|---|---|---|---|---|---|"]
        for item in settings.settings_of(group_cls):
            env = " then ".join(f"`{name}`" for name in (item.env, *item.spec.launcher))
            if item.option is None:
                option = "- (per process: the launcher's)" if item.spec.launcher else "-"
            elif item.kind == "flag":
                option = f"`{item.option}` / `--no-{item.option[2:]}`"
            else:
                option = f"`{item.option}`"
            default = item.default_text()
            default = default if default in ("(required)", "none") else f"`{default}`"
            out.append(f"| `{item.name}` | {env} | {option} | {_cell(item.accepted())} | {_cell(default)} | "
                       f"{_cell(item.help)} |")
        out.append("")
    out.append("A true/false setting is also read from `1`, `yes`, `on` and `0`, `no`, `off`. Besides these, "
               "`attach` takes `optimizer` (an argument only) and `config`, the YAML file of these settings "
               "(`TWINSTEP_CONFIG`, `twinstep run --config`).")
    return "\n".join(out) + "\n"


def attach_keywords() -> str:
    """attach's keyword parameters, group by group, each ``name: TYPE | None = None``."""
    from twinstep._settings import title
    from twinstep.runtime import settings

    lines = []
    for attribute, group_cls in settings.GROUPS:
        lines.append(f"    # {attribute}: {title(group_cls)}")
        for item in settings.settings_of(group_cls):
            lines.append(f"    {item.name}: {item.annotation} = None,")
    return "\n".join(lines) + "\n"


def docstring_args() -> str:
    """The docstring's entry of each keyword: its help and default."""
    from twinstep.runtime import settings

    out = []
    for item in settings.SETTINGS:
        tail = " Required." if item.spec.required else f" Default: {item.default_text()}."
        out.extend(textwrap.wrap(f"{item.name}: {item.help}{tail}", width=100, initial_indent=" " * 8,
                                 subsequent_indent=" " * 12, break_on_hyphens=False))
    return "\n".join(out) + "\n"


def _between(text: str, begin: str, end: str, body: str, what: str) -> str:
    """``text`` with ``body`` between the line ``begin`` (a regular expression) and ``end``; ValueError without them."""
    found = re.compile(f"({begin})(.*?)({end})", re.S)
    if not found.search(text):
        raise ValueError(f"{what}: its markers were not found")
    return found.sub(lambda m: m.group(1) + body + m.group(3), text, count=1)


def render(page_text: str, name: str, table: str) -> str:
    """A docs page with the table between its ``<!-- BEGIN generated: NAME -->`` markers."""
    return _between(page_text, rf"<!-- BEGIN generated: {re.escape(name)} -->\n",
                    rf"<!-- END generated: {re.escape(name)} -->", table, f"'<!-- BEGIN generated: {name} -->'")


def render_api(text: str) -> str:
    """api.py with attach's generated keywords and docstring entries current."""
    text = _between(text, r"    # BEGIN generated: attach keywords\n", r"    # END generated: attach keywords\n",
                    attach_keywords(), f"{API} (attach keywords)")
    return _between(text, r"\ndef attach\(.*?\n    Args:\n", r"        optimizer: ", docstring_args(),
                    f"{API} (attach's docstring)")


#: part -> (file, the file's text -> that text with the part current).
PARTS: dict[str, tuple[str, Callable[[str], str]]] = {
    "server settings": ("docs/server.md", lambda text: render(text, "server settings", server_table())),
    "attach settings": ("docs/attach.md", lambda text: render(text, "attach settings", attach_table())),
    "attach keywords": (API, render_api),
}


def stale(*names: str) -> list[str]:
    """The parts (all, or ``names``) whose generated text differs from the definitions."""
    out = []
    for name in names or PARTS:
        path, render_part = PARTS[name]
        text = (ROOT / path).read_text()
        if render_part(text) != text:
            out.append(name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write the settings tables of the docs and attach's keywords "
                                                 "from the definitions of the settings")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a generated part is stale")
    parser.add_argument("parts", nargs="*", metavar="PART", help=f"which parts (default: all: {', '.join(PARTS)})")
    args = parser.parse_args(argv)
    for name in args.parts:
        if name not in PARTS:
            parser.error(f"no part {name!r} (parts: {', '.join(PARTS)})")
    out = stale(*args.parts)
    for name in out:
        path, render_part = PARTS[name]
        if not args.check:
            target = ROOT / path
            target.write_text(render_part(target.read_text()))
        print(("stale: " if args.check else "wrote ") + f"{path} ({name})")
    return 1 if args.check and out else 0


if __name__ == "__main__":
    sys.exit(main())
