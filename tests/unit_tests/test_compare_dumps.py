"""``twinstep compare-dumps``: real msprobe dumps (tests/fixtures/msprobe) through the live engine, offline.

The fixtures were made by msprobe 26.2.0 from a tiny torch model (their README):
``baseline``, ``faithful`` (the same batches, rows in another order: equal up to
rounding), ``gelu_tanh`` (layers.1.act is the tanh GELU) and ``lr`` (SGD at 0.11
instead of 0.1), at levels L0 (2 steps) and mix (1 step); ``no_statistics`` is
an L0 dump with summary_mode 'xor' (checksums, no statistics).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from twinstep.cli.main import main
from twinstep.server.report.render import report_schema

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "msprobe"


def compare(capsys, a: Path | str, b: Path | str, *options: str) -> tuple[int, dict, str]:
    """Exit code, JSON report and stderr of ``twinstep compare-dumps A B --json``."""
    code = main(["compare-dumps", str(a), str(b), "--json", *options])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if out.out.strip() else {}), out.err


@pytest.mark.parametrize("level", ["L0", "mix"])
def test_a_faithful_pair_is_aligned(capsys, level):
    code, report, err = compare(capsys, FIXTURES / "baseline" / level, FIXTURES / "faithful" / level)
    assert code == 0, report["first_divergence"]
    assert report["status"] == "aligned" and report["steps_compared"] == {"L0": 2, "mix": 1}[level]
    jsonschema.validate(report, report_schema())  # the schema of `twinstep report --json`
    # Every phase msprobe records was converted and compared; the two runs differ only by rounding.
    headroom = {h["phase"]: h for h in report["headroom"]}
    assert {"forward", "backward", "grad"} <= set(headroom), headroom
    assert all(0 < h["value"] < h["tolerance"] / 100 for h in headroom.values()), headroom
    if level == "L0":  # parameters after step 0's update, from step 1's forward
        assert "param" in headroom
    # What the dumps cannot give is said, on the runs.
    warnings = "\n".join(report["runs"][1]["warnings"])
    assert "msprobe records no loss" in warnings
    # ... and the long-run loss criteria are not judged on losses nobody sent (no FAIL on "nan").
    assert report["long_run"][0]["verdicts"][0] == "loss criteria not judged: no compared step has a loss from both runs"
    assert f"reading {FIXTURES / 'baseline' / level}: msprobe statistics dump, level {level}" in err


@pytest.mark.parametrize(("level", "module"), [("L0", "layers.1.act"), ("mix", "Functional.gelu.1")])
def test_the_gelu_variant_is_found_where_it_is(capsys, level, module):
    code, report, _ = compare(capsys, FIXTURES / "baseline" / level, FIXTURES / "gelu_tanh" / level)
    assert code == 1
    first = report["first_divergence"]
    assert (first["step"], first["phase"], first["module"]) == (0, "forward", module), first
    assert report["culprit"].startswith(f"origin: {module}")  # its input matched: the error is born there
    if level == "mix":  # the module around the API call diverges too
        rows = {r["name"]: r for r in report["tree"]["rows"]}
        assert rows["layers.1.act"]["divergent"] and not rows["layers.0.act"]["divergent"]


def test_a_learning_rate_bug_is_found_in_the_first_update(capsys):
    """msprobe records parameters as a forward reads them: step 1's are step 0's update."""
    code, report, _ = compare(capsys, FIXTURES / "baseline" / "L0", FIXTURES / "lr" / "L0")
    assert code == 1
    first = report["first_divergence"]
    assert (first["step"], first["phase"]) == (0, "param"), first
    assert report["stage"].startswith("optimizer:") and "learning rate" in report["stage"]


def test_one_rank_directory_or_one_file_is_a_dump_too(capsys):
    a = FIXTURES / "baseline" / "L0" / "step0" / "rank0"
    b = FIXTURES / "gelu_tanh" / "L0" / "step0" / "rank0" / "dump.json"
    code, report, _ = compare(capsys, a, b)
    assert code == 1 and report["steps_compared"] == 1
    assert report["first_divergence"]["module"] == "layers.1.act"


def test_ranks_are_compared_rank_by_rank(capsys, tmp_path):
    """dump_path/step{N}/rank{R}: rank 1 of the candidate carries the bug, rank 0 does not."""
    for run, rank1 in (("a", "baseline"), ("b", "gelu_tanh")):
        for rank, source in ((0, "baseline"), (1, rank1)):
            for step in (0, 1):
                target = tmp_path / run / f"step{step}" / f"rank{rank}"
                target.mkdir(parents=True)
                shutil.copy(FIXTURES / source / "L0" / f"step{step}" / "rank0" / "dump.json", target / "dump.json")
    code, report, _ = compare(capsys, tmp_path / "a", tmp_path / "b")
    assert code == 1
    assert {r["name"]: r["ranks"] for r in report["runs"]} == {"a": 2, "b": 2}
    first = report["first_divergence"]
    assert (first["step"], first["rank"], first["module"]) == (0, 1, "layers.1.act"), first


@pytest.mark.parametrize("option", ["--layer-mapping", "--mapping"])
def test_renamed_modules_follow_a_mapping_file(capsys, tmp_path, option):
    renamed = tmp_path / "renamed"
    shutil.copytree(FIXTURES / "gelu_tanh" / "L0", renamed)
    for file in renamed.rglob("dump.json"):
        file.write_text(file.read_text().replace('"Module.layers.', '"Module.blocks.'))
    mapping = tmp_path / "mapping.yaml"
    mapping.write_text("TopLayer:\n  blocks: layers\n" if option == "--layer-mapping"
                       else "prefix:\n  - {candidate: 'blocks.', baseline: 'layers.'}\n")
    code, report, _ = compare(capsys, FIXTURES / "baseline" / "L0", renamed, option, str(mapping))
    assert code == 1 and report["proposed_mapping"] is None  # the file mapped them: nothing left to guess
    first = report["first_divergence"]
    assert (first["module"], first["candidate_module"]) == ("layers.1.act", "blocks.1.act"), first
    assert report["unmatched"] == {"baseline": [], "candidate": []}


def edited_copy(source: Path, target: Path, edit) -> Path:
    """A copy of a fixture dump with ``edit(data)`` applied to each step's ``data`` (as msprobe would have written it)."""
    shutil.copytree(source, target)
    for file in target.rglob("dump.json"):
        dump = json.loads(file.read_text())
        edit(dump["data"])
        file.write_text(json.dumps(dump, indent=1))
    return target


def test_nan_and_inf_compare_by_presence(capsys, tmp_path):
    """msprobe's Max/Min/Mean/Norm say a NaN is there, not how many: both sides NaN agree, one side does not."""
    def nan_output(data):
        data["Module.layers.1.act.GELU.forward.0"]["output"][0].update(Max=float("nan"), Min=float("nan"),
                                                                        Mean=float("nan"), Norm=float("nan"))
    a = edited_copy(FIXTURES / "baseline" / "L0", tmp_path / "a", nan_output)
    b = edited_copy(FIXTURES / "faithful" / "L0", tmp_path / "b", nan_output)
    code, report, _ = compare(capsys, a, b)
    assert code == 0, report["first_divergence"]
    code, report, _ = compare(capsys, FIXTURES / "baseline" / "L0", b)
    first = report["first_divergence"]
    assert code == 1 and (first["step"], first["module"], first["metric"]) == (0, "layers.1.act", "nonfinite"), first


def test_tensors_without_mean_and_norm_are_counted_not_compared(capsys, tmp_path):
    """msprobe writes no Mean/Norm for integer tensors: such a record is left out and the report says how many."""
    def integer_input(data):
        data["Module.embed.Linear.forward.0"]["input_args"][0].update(dtype="torch.int64", Mean=None, Norm=None)
    a = edited_copy(FIXTURES / "baseline" / "L0", tmp_path / "a", integer_input)
    b = edited_copy(FIXTURES / "faithful" / "L0", tmp_path / "b", integer_input)
    code, report, _ = compare(capsys, a, b)
    assert code == 0, report["first_divergence"]
    warnings = report["runs"][1]["warnings"]
    assert "2 tensors with no Mean/Norm in msprobe's dump (integer, bool or float64, or precision 'high'): " \
           "not compared" in warnings, warnings


def test_a_truncated_dump_is_a_clear_error_not_a_traceback(tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(FIXTURES / "faithful" / "L0", broken)
    file = broken / "step1" / "rank0" / "dump.json"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    out = subprocess.run([sys.executable, "-m", "twinstep", "compare-dumps", str(FIXTURES / "baseline" / "L0"),
                          str(broken)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert f"{file}: the JSON ends early" in out.stderr and "truncated" in out.stderr, out.stderr


@pytest.mark.parametrize(("edit", "message"), [
    (lambda text: text.replace('"Max"', '"Max" "Max"', 1), "not valid JSON at line"),
    (lambda text: text.replace('"task": "statistics"', '"task": "overflow_check"'),
     "msprobe task 'overflow_check'; compare-dumps reads dumps that hold statistics"),
    (lambda text: '["not", "a", "dump"]', "not msprobe's dump.json"),
])
def test_malformed_dumps_say_what_is_wrong(capsys, tmp_path, edit, message):
    target = tmp_path / "step0" / "rank0" / "dump.json"
    target.parent.mkdir(parents=True)
    target.write_text(edit((FIXTURES / "faithful" / "L0" / "step0" / "rank0" / "dump.json").read_text()))
    code, report, err = compare(capsys, FIXTURES / "baseline" / "L0", tmp_path)
    assert code == 2 and report == {}
    assert message in err and str(target) in err, err


def test_a_dump_without_statistics_is_refused(capsys):
    """summary_mode 'xor' (a real msprobe dump): checksums only, nothing twinstep's metrics can use."""
    code, _, err = compare(capsys, FIXTURES / "baseline" / "L0", FIXTURES / "no_statistics" / "L0")
    assert code == 2
    assert "carry no statistics" in err and "summary_mode 'statistics'" in err, err


def test_a_missing_path_is_a_clear_error(capsys, tmp_path):
    code, _, err = compare(capsys, FIXTURES / "baseline" / "L0", tmp_path / "nowhere")
    assert code == 2 and "no such file or directory" in err
    code, _, err = compare(capsys, FIXTURES / "baseline" / "L0", tmp_path)  # empty: no dump.json below it
    assert code == 2 and "no dump.json below it" in err


def test_a_dump_with_nothing_to_compare_is_refused(capsys, tmp_path):
    target = tmp_path / "step0" / "rank0" / "dump.json"
    target.parent.mkdir(parents=True)
    target.write_text('{"task": "statistics", "level": "L0", "framework": "pytorch", "data": {}}')
    code, _, err = compare(capsys, FIXTURES / "baseline" / "L0", tmp_path)
    assert code == 2 and f"{tmp_path}: none of its 1 dump.json files holds a tensor" in err, err


def test_a_calls_input_is_read_as_capture_reads_it(tmp_path):
    """The input record is the first positional tensor, else the first keyword tensor (twinstep.wire.inputs);
    a dump names no forward signature, so keywords count in the order msprobe wrote them (the call's)."""
    from twinstep.server.ingest.msprobe import DumpFile, read_step
    from twinstep.wire import phases

    def tensor(mean: float) -> dict:
        return {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2, 2], "Max": mean, "Min": mean,
                "Mean": mean, "Norm": 2 * abs(mean), "requires_grad": False}

    number = {"type": "int", "value": 2}
    calls = {
        "positional": ([tensor(1)], {"scale": tensor(2)}),
        "keywords_after_a_number": ([number], {"scale": tensor(3), "hidden_states": tensor(4)}),
        "keywords_only": ([], {"hidden_states": tensor(5), "attention_mask": tensor(6)}),
        "nested": ([[tensor(7), tensor(8)]], {"x": tensor(9)}),
        "no_tensor": ([number], {"n": number}),
    }
    data = {f"Module.{name}.Block.forward.0": {"input_args": args, "input_kwargs": kwargs, "output": [tensor(0.5)]}
            for name, (args, kwargs) in calls.items()}
    file = tmp_path / "dump.json"
    file.write_text(json.dumps({"task": "statistics", "level": "L0", "framework": "pytorch", "data": data}))
    step = read_step(DumpFile(str(file), 0, 0))
    inputs = {r.name: r.stats[1] / r.stats[0] for r in step.records if r.phase == phases.INPUT}  # sum / count
    assert inputs == pytest.approx({"positional": 1, "keywords_after_a_number": 3, "keywords_only": 5, "nested": 7})
    assert all(r.slot == 0 and r.call == 0 for r in step.records if r.phase == phases.INPUT)
