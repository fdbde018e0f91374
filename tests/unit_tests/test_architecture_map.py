"""ARCHITECTURE.md is the one map of the layout: every package folder is on it, and every folder it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAP = (ROOT / "ARCHITECTURE.md").read_text()
TOP = ("client", "server", "proto")


def package_folders() -> list[str]:
    """Every folder holding an ``__init__.py`` under the fixed top level, as ``client/runtime/capture/``."""
    found = set()
    for top in TOP:
        for init in (ROOT / top).rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                found.add(init.parent.relative_to(ROOT).as_posix() + "/")
    return sorted(found)


def named_folders(text: str) -> set[str]:
    """Folder paths the map names in full (``client/wire/``), in its prose and its layout block alike."""
    return set(re.findall(r"(?<![\w./-])((?:%s)/(?:[\w.-]+/)*)" % "|".join(TOP), text))


def test_the_layout_has_packages():
    folders = package_folders()
    assert "client/" in folders and "server/" in folders and "proto/twinstep/v1/" in folders, folders


def test_every_package_folder_is_on_the_map():
    named = named_folders(MAP)
    missing = [folder for folder in package_folders() if folder not in named]
    assert not missing, (f"ARCHITECTURE.md does not name these package folders: {missing}; "
                         "add each, by its full path, to its Layout section")


def test_every_folder_on_the_map_exists():
    stale = sorted(folder for folder in named_folders(MAP) if not (ROOT / folder).is_dir())
    assert not stale, f"ARCHITECTURE.md names folders that do not exist: {stale}"


def test_the_map_finds_what_it_looks_for():
    """The folder pattern reads full paths, not file names or dotted module names."""
    text = "`client/runtime/capture/` and client/wire/stats.py, twinstep.server.view, server/view/assets/x.js"
    assert named_folders(text) == {"client/runtime/capture/", "client/wire/", "server/view/assets/"}
