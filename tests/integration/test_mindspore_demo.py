"""A torch baseline and its MindSpore port (PyNative), each a real process, streaming to a real server.

Skips where MindSpore is not installed (the legs without it) or runs with numpy 2
(MindSpore's 2.x wheels are built against numpy 1.x: client/runtime/environment.py).
"""

from __future__ import annotations



from tests.mindspore_env import skip_module_without_mindspore

skip_module_without_mindspore()


def test_faithful_mindspore_port_aligned_and_bug_found_at_its_step_phase_and_module(server, jobs):
    # Both sessions at once, on one server: four real training processes.
    faithful = (jobs("torch", server=server.address, session="ms-faithful", baseline=True, steps=8),
                jobs("mindspore", server=server.address, session="ms-faithful", steps=8))
    buggy = (jobs("torch", server=server.address, session="ms-gelu", baseline=True, steps=3),
             jobs("mindspore", server=server.address, session="ms-gelu", bug="gelu_tanh", steps=3))
    results = [job.wait() for job in (*faithful, *buggy)]
    assert all(r.returncode == 0 for r in results), "\n".join(r.output for r in results)

    report = server.report("ms-faithful")
    assert report["status"] == "aligned", report
    assert report["steps_compared"] == 8
    runs = {r["name"]: r for r in report["runs"]}
    assert runs["mindspore"]["framework"] == "mindspore" and runs["mindspore"]["dropped"] == 0
    assert runs["mindspore"]["capture_health"] == []
    # Every record joined: MindSpore's gamma/beta/embedding_table with torch's weight/bias, and every
    # gradient and updated parameter (an absent MindSpore gradient would leave the baseline's unmatched).
    assert report["unmatched"] == {"baseline": [], "candidate": []}, report["unmatched"]

    first = server.report("ms-gelu")["first_divergence"]
    assert first is not None
    assert (first["step"], first["phase"], first["module"], first["candidate_run"]) == (
        0, "forward", "layers.1.mlp.act", "mindspore")
    assert first["value"] > first["tolerance"]


def test_full_tensors_through_the_sender_process_from_a_mindspore_port(server, jobs):
    """capture="tensors" with sender="process": MindSpore's host copies are encoded and sent by the child
    process (forked from a MindSpore training), then compared element by element with torch's."""
    runs = (jobs("torch", server=server.address, session="ms-process", baseline=True, steps=3, capture="tensors"),
            jobs("mindspore", server=server.address, session="ms-process", steps=3, capture="tensors",
                 extra=["--sender", "process"]))
    results = [job.wait() for job in runs]
    assert all(r.returncode == 0 for r in results), "\n".join(r.output for r in results)
    report = server.report("ms-process")
    assert report["status"] == "aligned" and report["steps_compared"] == 3, report
    ms = next(r for r in report["runs"] if r["name"] == "mindspore")
    assert ms["dropped"] == 0 and ms["capture_health"] == [], ms
    last = server.last_comparison("ms-process")
    assert last is not None and last.step == 2 and last.errors == []
    # Full tensors were compared (rel_l2 computed from both sides' elements), not only statistics.
    assert "rel_l2" in last.values and (last.values["rel_l2"] > 0).any()
