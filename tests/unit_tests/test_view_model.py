"""server/view: the view model, its module tree, the wire form of the history, CSV tables and the frozen page."""

from __future__ import annotations

import base64
import csv
import json
import re

import numpy as np
import pytest

from tests.unit_tests.test_comparator import ctx, decoded, model_records
from twinstep.server.compare.comparator import compare_step
from twinstep.server.compare.plan import PlanCache
from twinstep.server.view import model, wire
from twinstep.server.view.history import DIVERGENT, EMPTY, ErrorsCopy, SessionHistory
from twinstep.server.view.page import render_frozen, render_page
from twinstep.server.view.tables import ERRORS_COLUMNS, write_tables
from twinstep.server.view.tree import module_tree, path_parts
from twinstep.v1 import twinstep_pb2 as pb


def _errors(values: list[float], tolerances: list[float], flags: list[int]) -> ErrorsCopy:
    n = len(values)
    return ErrorsCopy(run="c", rows=tuple(("forward", f"m{k}", "Linear") for k in range(n)),
                      first_step=np.array([0]), last_step=np.array([0]),
                      value=np.array(values, np.float32).reshape(n, 1),
                      tolerance=np.array(tolerances, np.float32).reshape(n, 1),
                      flags=np.array(flags, np.uint8).reshape(n, 1), rows_not_kept=0)


def test_codes_put_over_tolerance_exactly_on_one_side_of_the_scale():
    over = DIVERGENT | 0
    errors = _errors([1e-5, 1.0001e-5, 1e-8, 1.0, 0.0, 5.0, np.nan],
                     [1e-5, 1e-5, 1e-5, 1e-5, 1e-5, 0.0, 1e-5],
                     [0, over, 0, over, 0, over, EMPTY])
    codes = model.codes(errors)[:, 0].tolist()
    assert codes[0] == model.OVER - 1       # at tolerance: the top of "within"
    assert codes[1] >= model.OVER           # a hair beyond: "beyond", however the log scale rounds
    assert codes[2] == 1                    # 1e-3 of tolerance and below: the floor
    assert codes[3] == 255                  # 1e5 over: the ceiling
    assert codes[4] == 1                    # exactly equal: no error
    assert codes[5] == 255                  # over a tolerance of 0 (shape, nonfinite)
    assert codes[6] == 0                    # not compared


def test_module_tree_puts_parents_first_and_siblings_in_call_order():
    rows = [("forward", "layers.1.mlp.act", "GELU"), ("forward", "layers.0.attn", "Attention"),
            ("forward", "layers.1", "Block"), ("forward", "", "Model"), ("grad", "layers.0.qkv.{q,k}.weight", "Linear"),
            ("loss", "", "")]
    nodes = module_tree(rows)
    forward = [(n.path, n.depth, n.row) for n in nodes if n.phase == "forward"]
    assert forward == [("", 0, 3), ("layers", 1, -1), ("layers.1", 2, 2), ("layers.1.mlp", 3, -1),
                       ("layers.1.mlp.act", 4, 0), ("layers.0", 2, -1), ("layers.0.attn", 3, 1)]
    assert [n.phase for n in nodes if n.depth == 0] == ["forward", "loss", "grad"]  # a step's order
    for i, node in enumerate(nodes):  # a subtree is the run of nodes up to its end
        inside = nodes[i + 1:node.end]
        assert all(n.path.startswith(node.path) and n.depth > node.depth for n in inside)
        assert node.end == len(nodes) or nodes[node.end].depth <= node.depth
    assert path_parts("layers.0.qkv.{q.a,k.b}.weight") == ["layers", "0", "qkv", "{q.a,k.b}", "weight"]


def _history_and_report():
    history = SessionHistory("s", steps=4, max_rows=100, noise_multiple=3.0)
    plans = PlanCache()
    for step in range(10):
        base = decoded(model_records(), step=step)
        cand = decoded(model_records(perturb={"forward:layers.1": 1e-2} if step >= 2 else None), step=step)
        context = ctx()
        context.plans = plans
        history.add("paddle", False, compare_step(base, cand, context), base, cand)
        rerun = decoded(model_records(perturb={"forward:head": 1e-7}), step=step)
        rerun.table["sum"][rerun.phase == pb.LOSS] += 1e-4
        history.add("rerun", True, compare_step(base, rerun, context), base, rerun)
    report = pb.Report(
        session="s", status="diverged",
        runs=[pb.RunStatus(name="torch", baseline=True, framework="torch", ranks=1, last_step=9, state="streaming"),
              pb.RunStatus(name="paddle", framework="paddle", ranks=1, last_step=7, state="streaming",
                           health=[pb.RankHealth(rank=0, capture=pb.CaptureHealth(failed_steps=2))])],
        steps_compared=8,
        first_divergence=pb.Divergence(step=2, rank=0, phase="forward", module="layers.1", metric="rms", value=1e-2,
                                       tolerance=5e-5, candidate_run="paddle", stage="forward: layers.1 ..."),
        stage="forward: layers.1 ...",
        tree=[pb.ModuleRow(name="", type="Model", metric="rms", value=1e-3, tolerance=5e-5, divergent=True, growth=-1,
                           noise=-1),
              pb.ModuleRow(name="layers.1", type="Linear", metric="rms", value=1e-2, tolerance=5e-5, divergent=True,
                           first=True, growth=2.0, noise=-1)],
    )
    return history.copy(), report


def test_the_view_holds_runs_divergence_heatmap_and_curves():
    history, report = _history_and_report()
    live = model.LiveFacts(steps_per_second={"torch": 2.0, "paddle": 1.5}, halt_enabled=True, auth_required=True)
    view = model.build_view(report, history, live)
    json.dumps(view, allow_nan=False)  # JSON as it is: no NaN or infinity anywhere
    assert view["view_version"] == model.VIEW_VERSION and view["live"] and view["halt"]["enabled"]
    assert view["history_kept"] and not model.build_view(report, None, None)["history_kept"]
    assert view["report"]["schema_version"] and view["report"]["first_divergence"]["module"] == "layers.1"
    runs = {p["run"]: p for p in view["progress"]}
    # Steps behind the furthest run: 0 for it, never negative, on the row of the run that lags.
    assert runs["paddle"]["steps_behind"] == 2 and runs["torch"]["steps_behind"] == 0
    ahead = pb.Report()
    ahead.CopyFrom(report)
    ahead.runs[1].last_step = 17  # the candidate ahead of its baseline
    behind = {p["run"]: p["steps_behind"] for p in model.build_view(ahead, history, live)["progress"]}
    assert behind == {"torch": 8, "paddle": 0}
    ahead.runs[1].last_step = -1  # no step yet: not behind by a number
    behind = {p["run"]: p["steps_behind"] for p in model.build_view(ahead, history, live)["progress"]}
    assert behind == {"torch": 0, "paddle": None}
    assert runs["paddle"]["steps_per_second"] == 1.5 and not runs["paddle"]["capture_ok"]
    assert "2 whole step(s)" in runs["paddle"]["capture_summary"]
    assert [r["depth"] for r in view["divergence"]["tree"]] == [0, 1]
    (heat,) = view["heatmap"]["candidates"]  # the reference run has curves, no heatmap
    cells = np.frombuffer(base64.b64decode(heat["cells"]), np.uint8).reshape(len(heat["rows"]), len(heat["columns"]))
    row = next(k for k, r in enumerate(heat["rows"]) if r["phase"] == "forward" and r["path"] == "layers.1")
    steps = [tuple(c) for c in heat["columns"]]
    assert steps[-4:] == [(6, 6), (7, 7), (8, 8), (9, 9)] and steps[0][0] == 0
    assert all(cells[row, c] >= model.OVER for c, (first, last) in enumerate(steps) if last >= 2)
    assert all(cells[row, c] < model.OVER for c, (first, last) in enumerate(steps) if last < 2)
    grouping = [k for k, r in enumerate(heat["rows"]) if not r["recorded"]]
    assert grouping and not cells[grouping].any()  # "layers" only groups: no record of its own
    (curve,) = view["curves"]
    assert curve["run"] == "paddle" and curve["noise"]["reference_run"] == "rerun"
    assert curve["noise"]["multiple"] == 3.0
    np.testing.assert_allclose([v for v in curve["noise"]["loss"]], 1e-4, rtol=1e-3)
    assert curve["loss_diff"] == [0.0] * len(curve["loss"])


def test_a_halt_says_which_runs_it_stopped_or_that_it_reached_none():
    history, report = _history_and_report()
    live = model.LiveFacts(halt_enabled=True)
    view = model.build_view(report, history, live)
    assert (view["status_label"], view["halt"]["outcome"]) == ("diverged", None)
    report.halted = True
    for states, label, outcome in [
        (("halted", "halted"), "diverged · halted", "Halted: torch, paddle."),
        (("halted", "finished"), "diverged · halted", "Halted: torch."),
        (("streaming", "halted"), "diverged · halting", "Halt sent; waiting for torch to stop."),
        (("finished", "lost"), "diverged · halt reached no run",
         "The halt reached no run: every run had ended before it."),
    ]:
        for run, state in zip(report.runs, states):
            run.state = state
        view = model.build_view(report, history, live)
        assert (view["status_label"], view["halt"]["outcome"]) == (label, outcome), states


def test_a_live_view_merges_old_columns_past_its_width_and_a_kept_one_keeps_them_all():
    history, report = _history_and_report()
    assert len(model.build_view(report, history, model.LiveFacts(), max_columns=3)["heatmap"]["candidates"][0]
               ["columns"]) <= 3
    kept = model.build_view(report, history, None, max_columns=None)
    assert len(kept["heatmap"]["candidates"][0]["columns"]) == len(history.errors[0].first_step)
    assert not kept["live"] and not kept["halt"]["enabled"]


def test_the_history_survives_the_wire():
    history, _ = _history_and_report()
    back = wire.from_proto(pb.History.FromString(wire.to_proto(history).SerializeToString()))
    for sent, got in zip(history.errors, back.errors):
        assert sent.rows == got.rows and sent.run == got.run
        np.testing.assert_array_equal(sent.first_step, got.first_step)
        np.testing.assert_array_equal(sent.value, got.value)
        np.testing.assert_array_equal(sent.flags, got.flags)
    for sent, got in zip(history.curves, back.curves):
        np.testing.assert_array_equal(sent.means, got.means)
        assert sent.reference == got.reference
    assert (back.steps, back.noise_multiple, back.revision) == (4, 3.0, history.revision)


def test_a_history_too_large_for_one_answer_is_merged_and_a_broken_one_refused():
    history, _ = _history_and_report()
    errors = history.errors[0]
    small = wire.to_proto(history, max_cells=errors.value.shape[0] * 2)
    assert len(small.candidates[0].first_step) <= 2
    assert small.candidates[0].first_step[0] == 0 and small.candidates[0].last_step[-1] == 9
    broken = wire.to_proto(history)
    del broken.candidates[0].value[-1]
    with pytest.raises(ValueError, match="do not match its cells"):
        wire.from_proto(broken)


def test_csv_tables_hold_every_compared_cell(tmp_path):
    history, _ = _history_and_report()
    errors_path, curves_path = write_tables(history, tmp_path / "out")
    rows = list(csv.DictReader(errors_path.open()))
    assert tuple(rows[0]) == ERRORS_COLUMNS
    errors = history.errors[0]
    assert len(rows) == int((errors.flags != EMPTY).sum())
    for line in rows:
        assert line["divergent"] == ("1" if float(line["value"]) > float(line["tolerance"]) else "0")
    diverged = {(int(r["step"]), r["module"]) for r in rows if r["divergent"] == "1" and r["phase"] == "forward"}
    assert ("layers.1" in {m for _, m in diverged}) and min(s for s, m in diverged if m == "layers.1") >= 0
    curves = list(csv.DictReader(curves_path.open()))
    assert {r["run"] for r in curves} == {"paddle", "rerun"}


def test_the_frozen_page_needs_no_network_and_carries_its_view():
    history, report = _history_and_report()
    report.first_divergence.module = "evil</script><script>alert(1)</script>"
    view = model.build_view(report, history, None, max_columns=None)
    page = render_frozen(view)
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert not re.search(r"""url\(\s*["']?\s*(https?:)?//|@import""", page, re.I)
    found = re.search(r'<script type="application/json" id="twinstep-view">(.*?)</script>', page, re.S)
    assert json.loads(found.group(1)) == json.loads(json.dumps(view))  # intact, and the name did not end it
    assert page.count("<script>alert(1)") == 0
    live = render_page("dashboard", session='a"b<c')
    assert 'data-session="a&quot;b&lt;c"' in live and '<script src="/assets/dashboard.js">' in live
