"""`twinstep demo --candidate mindspore` refuses up front, with the fix, where MindSpore cannot run."""

from __future__ import annotations

from twinstep.tools.demo.run import mindspore_refusal


def test_mindspore_2_under_numpy_2_is_refused_with_the_pip_command():
    assert mindspore_refusal("2.10.0", "2.4.6") == (
        "MindSpore 2.x needs numpy<2: pip install 'numpy<2' (installed here: mindspore 2.10.0 with numpy 2.4.6, "
        "under which MindSpore's own operators fail)")
    assert mindspore_refusal("2.7.0", "2.0.0rc1") is not None


def test_mindspore_with_numpy_1_or_a_later_mindspore_runs():
    assert mindspore_refusal("2.10.0", "1.26.4") is None
    assert mindspore_refusal("2.7.0", "1.26.0") is None
    assert mindspore_refusal("3.0.0", "2.4.6") is None  # not known to need numpy 1: not refused


def test_mindspore_not_installed_names_the_extra():
    assert mindspore_refusal(None, "2.4.6") == (
        "MindSpore is not installed: pip install 'twinstep[mindspore]' (it brings the numpy<2 MindSpore 2.x needs)")
