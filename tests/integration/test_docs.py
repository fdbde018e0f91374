"""The docs/ pages are true: their Python examples run, their command lines parse.

Each page's ```python blocks, joined in order, run as one script in a fresh
process in an empty directory (CPU only, 120 s); every `twinstep ...` line of a
```bash block parses with the real argument parser.  Blocks that cannot run
on such a machine (GPUs, clusters) are written as ```text.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_lines import parse_command_line, twinstep_lines

DOCS = Path(__file__).resolve().parents[2] / "docs"
#: The pages issue 16 asks for, one per feature.
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
def test_python_examples_run(page, tmp_path):
    needs = _NEEDS.search(page.read_text())
    missing = [name for name in needs.group(1).split() if importlib.util.find_spec(name) is None] if needs else []
    if missing:
        pytest.skip(f"docs/{page.name}'s examples need {', '.join(missing)}, not installed in this environment")
    script = tmp_path / f"docs_example_{page.stem.replace('-', '_')}.py"  # never a module's name (torch.py)
    script.write_text("\n\n".join(blocks(page, "python")))
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"docs/{page.name}'s examples failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
