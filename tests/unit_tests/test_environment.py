"""Supported ranges, the attach-time word when a library is outside them, and server addresses."""

from __future__ import annotations

import logging
import re
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import numpy as np
import pytest
import torch

import twinstep
from twinstep.runtime import environment
from twinstep.wire import stats
from twinstep.runtime.transport.stream import check_target

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text, parsed", [
    ("2.13.0+cpu", (2, 13, 0)), ("1.26.4", (1, 26, 4)), ("3.0.0rc1", (3, 0, 0)), ("0.60", (0, 60)),
    ("2.4.1.post3", (2, 4, 1)), ("3.13.0", (3, 13, 0)), ("", ()),
])
def test_versions_are_compared_by_their_release_numbers(text, parsed):
    assert environment.parse_version(text) == parsed


def test_a_library_outside_its_range_is_named_with_the_range():
    assert environment.check("numpy", "1.26.4") is None
    assert environment.check("numpy", "2.4.6") is None
    sentence = environment.check("numpy", "1.23.5")
    assert sentence is not None and sentence.startswith("numpy 1.23.5 is outside") and "numpy>=1.26,<3" in sentence
    assert environment.check("torch", "2.3.1") is not None and environment.check("torch", "2.13.0+cpu") is None
    assert environment.check("paddle", "2.6.2") is not None and environment.check("paddle", "3.3.1") is None


def test_the_ranges_are_the_ones_pyproject_declares():
    """One set of numbers: what attach checks is what pip is told (and what README states)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~ ]", spec, maxsplit=1)[0]: spec for spec in project["dependencies"]}
    for library in ("numpy", "grpcio", "protobuf", "zstandard", "numba"):
        supported = environment.SUPPORTED[library]
        assert declared[library].replace(" ", "") == f"{library}{supported.describe()}", library
    assert project["requires-python"] == environment.SUPPORTED["python"].describe()
    extras = {spec.split(">=")[0]: spec for specs in project["optional-dependencies"].values() for spec in specs}
    assert extras["torch"] == f"torch{environment.SUPPORTED['torch'].describe()}"
    assert extras["paddlepaddle"] == f"paddlepaddle{environment.SUPPORTED['paddle'].describe()}"
    readme = (ROOT / "README.md").read_text()
    for library, supported in environment.SUPPORTED.items():
        assert f"{library}{supported.describe()}" in readme.replace(" ", ""), library


def test_attach_warns_once_per_library_and_tells_the_server(monkeypatch, caplog, server):
    monkeypatch.setattr(environment, "_warned", set())
    real = environment.installed_version
    monkeypatch.setattr(environment, "installed_version",
                        lambda name: "1.23.5" if name == "numpy" else real(name))
    net = torch.nn.Linear(2, 2)
    with caplog.at_level(logging.WARNING, logger="twinstep"):
        for run in ("a", "b"):
            twinstep.attach(net, session="old-numpy", run=run, baseline=run == "a", server=server.address).close()
    client_lines = [r for r in caplog.records if r.name == "twinstep" and "numpy 1.23.5 is outside" in r.getMessage()]
    assert len(client_lines) == 1  # the server logs the runs' warnings too, under twinstep.server
    report = server.report_proto("old-numpy")
    assert all(any("numpy 1.23.5" in w for w in r.warnings) for r in report.runs)
    assert report.runs[0].environment["numpy"] == "1.23.5"


@pytest.mark.parametrize("target, match", [
    ("", "empty"),
    ("localhost", "no port"),
    (":50051", "no host"),
    ("http://127.0.0.1:50051", "URL scheme"),
    ("127.0.0.1:port", "not a number"),
    ("127.0.0.1:70000", "not a number from 1 to 65535"),
    ("::1:50051", "IPv6 host goes in brackets"),
    ("127.0.0.1 :50051", "white space"),
])
def test_a_malformed_server_address_is_refused_at_attach_with_what_is_wrong(target, match):
    with pytest.raises(ValueError, match=match):
        check_target(target)
    if target:  # attach says the same before it hooks anything
        net = torch.nn.Linear(2, 2)
        with pytest.raises(ValueError, match=match):
            twinstep.attach(net, session="s", run="r", server=target)
        assert not net._forward_hooks


@pytest.mark.parametrize("target", ["127.0.0.1:50051", "[::1]:50051", "my-host.example:1", "unix:/tmp/ts.sock"])
def test_good_server_addresses_pass(target):
    check_target(target)


def test_sum_of_squares_without_vecdot_matches(monkeypatch):
    """numpy 1.x has no np.vecdot: the einsum path gives the same sums (the numpy-1.26 leg runs it natively)."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(n).astype(np.float32) for n in (10, 1024, 5000, 4096)]
    arrays.append(rng.standard_normal((64, 48)).astype(np.float32).T)  # strided
    with_vecdot = [stats._sum_sq(a) for a in arrays]
    monkeypatch.setattr(stats, "_VECDOT", None)
    without = [stats._sum_sq(a) for a in arrays]
    exact = [float(np.sum(a.astype(np.float64) ** 2)) for a in arrays]
    for got, reference, truth in zip(without, with_vecdot, exact):
        assert got == pytest.approx(truth, rel=1e-6)
        assert got == pytest.approx(reference, rel=1e-6)
