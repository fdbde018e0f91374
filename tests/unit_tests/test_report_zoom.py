"""The report's zoom section says, for each zoom, whether it ran, on which runs and steps, or why not."""

from __future__ import annotations

from twinstep.server.report.render import render_text
from twinstep.server.report.zoom import zoom_lines, zooms_to_dict
from twinstep.v1 import twinstep_pb2 as pb


def _runs(*rows: tuple[str, int, str]) -> list[pb.RunStatus]:
    return [pb.RunStatus(name=name, baseline=name == "torch", last_step=last, state=state, ranks=1)
            for name, last, state in rows]


def _window(id: int, first: int, last: int, runs=("torch", "paddle"), captured=(), state="sent", **spec) -> pb.ZoomWindow:
    return pb.ZoomWindow(
        spec=pb.ZoomSpec(id=id, modules=spec.pop("modules", ["fc1"]), capture="tensors", first_step=first,
                         last_step=last, divergent_step=-1, reason="asked by an operator", **spec),
        origin="operator", runs=runs, state=state,
        captured=[pb.ZoomCapture(run=run, first_step=a, last_step=b) for run, a, b in captured])


def test_each_zoom_says_whether_it_ran_and_where():
    ended = _runs(("torch", 39, "finished"), ("paddle", 39, "finished"))
    report = pb.Report(session="s", status="aligned", runs=ended, zooms=[
        _window(1, 12, 13, captured=[("torch", 12, 13), ("paddle", 12, 13)]),
        _window(2, 12, 13, captured=[("torch", 12, 13), ("paddle", 12, 12)]),
        _window(3, 1000, 1000),
        _window(4, 12, 12, modules=[""], ops_module="fc1", captured=[("torch", 12, 12)]),
    ])
    assert zoom_lines(report) == [
        "zoom (live capture changes):",
        "  #1 operator: fc1 in tensors, steps 12-13 (told: torch, paddle)",
        "     ran on torch and paddle, steps 12-13",
        "  #2 operator: fc1 in tensors, steps 12-13 (told: torch, paddle)",
        "     ran on torch (steps 12-13) and paddle (step 12)",
        "  #3 operator: fc1 in tensors, step 1000 (told: torch, paddle)",
        "     never ran: every run had ended before step 1000 (torch after step 39, paddle after step 39)",
        "  #4 operator: the whole model in tensors, step 12; the operations of 'fc1' (told: torch, paddle)",
        "     ran on torch, step 12; not on paddle: it sent that step without what the zoom asked",
    ]
    [first, *_] = zooms_to_dict(report)
    assert first["captured"] == [{"run": "torch", "first_step": 12, "last_step": 13},
                                 {"run": "paddle", "first_step": 12, "last_step": 13}]
    assert first["outcome"] == "ran on torch and paddle, steps 12-13"


def test_a_zoom_not_run_yet_or_not_reached_says_why():
    report = pb.Report(session="s", status="running",
                       runs=_runs(("torch", 20, "streaming"), ("paddle", 5, "finished")), zooms=[
        _window(1, 30, 31),
        _window(2, 30, 31, captured=[("torch", 30, 31)]),
        _window(3, 30, 31, runs=(), state="not asked: no run was still streaming"),
        _window(4, 30, 31, runs=("torch",)),
    ])
    text = render_text(report) + "\n"
    assert ("  #1 operator: fc1 in tensors, steps 30-31 (told: torch, paddle)\n"
            "     not run yet: torch has not reached step 30; paddle had ended after step 5\n") in text
    assert "     ran on torch, steps 30-31; not on paddle: it had ended after step 5\n" in text
    assert ("  #3 operator: fc1 in tensors\n"
            "     not asked: no run was still streaming\n") in text
    assert ("  #4 operator: fc1 in tensors, steps 30-31 (told: torch)\n"
            "     not run yet: torch has not reached step 30\n") in text
