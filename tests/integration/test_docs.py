"""The docs/ pages are true: their Python examples run, their command lines parse.

Each page's ```python blocks, joined in order, run as one script in a fresh
process in an empty directory (CPU only, 120 s); every `twinstep ...` line of a
```bash block parses with the real argument parser.  Blocks that cannot run
on such a machine (GPUs, clusters) are written as ```text.

The pages' scripts are independent, and each mostly keeps one core busy: they
run side by side, as many at a time as there are cores (at most four).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

from tests.cli_lines import parse_command_line, twinstep_lines

DOCS = Path(__file__).resolve().parents[2] / "docs"
#: Pages that must exist, one per feature.
REQUIRED = ("getting-started", "torch", "paddle", "trainers", "distributed", "tolerances", "mapping", "security",
            "dashboard")
#: A page whose examples need libraries not every environment has says so:
#: ``<!-- docs-test needs: transformers paddleformers -->``; without them its examples are skipped.
_NEEDS = re.compile(r"<!-- docs-test needs: ([\w. ]+) -->")
_BLOCK = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)


def blocks(page: Path, language: str) -> list[str]:
    return [body for lang, body in _BLOCK.findall(page.read_text()) if lang == language]


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def missing_needs(page: Path) -> list[str]:
    """The libraries a page's examples need (``docs-test needs:``) that this environment lacks."""
    needs = _NEEDS.search(page.read_text())
    return [name for name in needs.group(1).split() if importlib.util.find_spec(name) is None] if needs else []


def run_examples(page: Path, directory: Path) -> subprocess.CompletedProcess:
    script = directory / f"docs_example_{page.stem.replace('-', '_')}.py"  # never a module's name (torch.py)
    script.write_text("\n\n".join(blocks(page, "python")))
    return subprocess.run([sys.executable, str(script)], cwd=directory, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def examples(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future]]:
    """The examples of every page this run selected, started together (one a core, at most four), each in an
    empty directory of its own: by page, the script's outcome to come."""
    selected = [item.callspec.params["page"] for item in request.session.items
                if item.originalname == "test_python_examples_run"]
    pool = ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)))
    yield {page.stem: pool.submit(run_examples, page, tmp_path_factory.mktemp(page.stem))
           for page in selected if not missing_needs(page)}
    pool.shutdown(cancel_futures=True)


def test_every_feature_has_a_page():
    missing = [name for name in REQUIRED if not (DOCS / f"{name}.md").exists()]
    assert not missing, f"docs/ lacks pages: {missing}"


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.stem)
def test_command_lines_parse(page):
    fences = [line for line in page.read_text().splitlines() if line.startswith("```")]
    assert len(fences) % 2 == 0, f"docs/{page.name}: a code block is not closed"
    for body in blocks(page, "bash"):
        for line in twinstep_lines(body):
            parse_command_line(line)


@pytest.mark.parametrize("page", [p for p in pages() if blocks(p, "python")], ids=lambda p: p.stem)
def test_python_examples_run(page, examples):
    missing = missing_needs(page)
    if missing:
        pytest.skip(f"docs/{page.name}'s examples need {', '.join(missing)}, not installed in this environment")
    out = examples[page.stem].result()
    assert out.returncode == 0, f"docs/{page.name}'s examples failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
