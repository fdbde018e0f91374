"""The test command's disk policy: which environments go when the next leg's build would not fit.

CI once failed half-way through building a leg when four environments and pip's cache filled the disk;
the runner now removes tested legs' environments first and, if still short, builds after the current
leg's tests.  These tests give it a small pretend disk (the free space is the one input faked).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def runner(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("twinstep_test_runner", ROOT / "tests" / "envs" / "run.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "ROOT", tmp_path)
    (tmp_path / ".venvs").mkdir()
    return module


def _venv(root: Path, name: str, megabytes: int) -> Path:
    path = root / ".venvs" / name
    path.mkdir()
    with open(path / "lib.so", "wb") as f:  # sparse: its size counts, not its blocks
        f.truncate(megabytes << 20)
    return path


def _disk(monkeypatch, runner, total_gb: float) -> None:
    """Free space: ``total_gb`` less what the environments under .venvs hold."""
    def free() -> float:
        held = sum(f.stat().st_size for f in (runner.ROOT / ".venvs").rglob("*") if f.is_file())
        return total_gb - held / 2**30
    monkeypatch.setattr(runner, "_free_gb", free)


def test_the_tested_legs_go_first_come_first_gone_until_the_next_leg_fits(runner, monkeypatch, capsys):
    first, second = _venv(runner.ROOT, "first", 300), _venv(runner.ROOT, "second", 300)
    _disk(monkeypatch, runner, total_gb=1.0)  # 0.41 GB free
    leg = runner.Leg("next", "", (), disk_gb=0.6)
    tested = ["first", "second"]
    assert runner._make_room(leg, tested, testing=None)
    assert not first.exists() and second.exists() and tested == ["second"]
    assert "removed .venvs/first" in capsys.readouterr().out


def test_a_leg_that_fits_removes_nothing(runner, monkeypatch, capsys):
    first = _venv(runner.ROOT, "first", 100)
    _disk(monkeypatch, runner, total_gb=10.0)
    assert runner._make_room(runner.Leg("next", "", (), disk_gb=2.0), ["first"], testing="other")
    assert first.exists() and capsys.readouterr().out == ""


def test_still_short_the_build_waits_for_the_leg_under_test_then_goes_ahead_with_a_warning(runner, monkeypatch,
                                                                                               capsys):
    _venv(runner.ROOT, "testing_now", 300)
    _disk(monkeypatch, runner, total_gb=0.5)
    leg = runner.Leg("next", "", (), disk_gb=0.4)
    assert not runner._make_room(leg, [], testing="testing_now")
    assert "builds once leg testing_now's tests end" in capsys.readouterr().out
    # its tests ended: its environment goes and the build starts
    assert runner._make_room(leg, ["testing_now"], testing=None)
    assert not (runner.ROOT / ".venvs" / "testing_now").exists()
    # nothing left to remove: build anyway, and say so
    _disk(monkeypatch, runner, total_gb=0.1)
    assert runner._make_room(leg, [], testing=None)
    assert "WARNING" in capsys.readouterr().out


def test_an_existing_environment_counts_towards_its_own_rebuild(runner, monkeypatch):
    """A stale environment is removed by its rebuild, so only the difference must be free."""
    _venv(runner.ROOT, "next", 500)
    other = _venv(runner.ROOT, "other", 100)
    _disk(monkeypatch, runner, total_gb=0.8)  # 0.21 GB free; the leg needs 0.6, holds 0.49
    assert runner._make_room(runner.Leg("next", "", (), disk_gb=0.6), ["other"], testing=None)
    assert other.exists()


# -- which legs run what -------------------------------------------------------------------------------------


@pytest.fixture
def table():
    spec = importlib.util.spec_from_file_location("twinstep_test_table", ROOT / "tests" / "envs" / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_every_integration_module_has_its_row_and_every_row_its_module(table):
    """A new module must say where it runs (or it would run nowhere); a row must name a file that exists."""
    modules = {path.name for path in (ROOT / "tests" / "integration").glob("test_*.py")}
    files = {key.split("::")[0] for key in table.INTEGRATION}
    assert modules == files, f"without a row: {sorted(modules - files)}; without a module: {sorted(files - modules)}"
    legs = {leg.name for leg in table.LEGS}
    for key, row in table.INTEGRATION.items():
        assert row.legs and set(row.legs) <= legs and row.why, key
        assert not row.quick or "latest" in row.legs, f"{key}: the quick loop runs the latest leg"


def test_each_leg_runs_its_rows_and_the_quick_loop_a_part_of_latest(table):
    for leg in table.LEGS:
        tiers = dict(leg.tiers)
        assert tiers["unit"] == ("tests/unit_tests",)
        chosen = tiers["integration"]
        assert chosen and all(path.startswith("tests/integration/test_") for path in chosen)
        assert chosen == tuple(f"tests/integration/{key}" for key, row in table.INTEGRATION.items()
                               if leg.name in row.legs)
    latest = dict(table.LEGS[0].tiers)["integration"]
    quick = table.integration("latest", quick=True)
    assert "tests/integration/test_end_to_end.py" in quick and set(quick) < set(latest)
    assert "x: runs in that leg" in table.table()
