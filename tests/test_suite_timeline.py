"""benchmarks/suite_timeline.py on a timeline written the way runs write it: each stage
counted per worker group (rank 0's), a driver's fit paired with the group it started, and
each group counted for the test running when it started."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import suite_timeline  # noqa: E402 - after the path is set

from ray_ddp.io import timeline  # noqa: E402


def test_the_groups_and_their_stages_are_counted(tmp_path, monkeypatch):
    path = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(timeline.ENV, str(path))
    clock = iter([100.0, 107.0, 107.1, 109.5, 109.6, 111.0,  # a fit: driver, ranks 0 and 1
                  120.0, 122.0])  # fmt: skip  # a Tune trial's group, killed after its first step
    monkeypatch.setattr(timeline.time, "time", lambda: next(clock))
    pids = iter([1, 2, 3, 2, 3, 2, 4, 4])
    monkeypatch.setattr(timeline.os, "getpid", lambda: next(pids))
    timeline.mark(suite_timeline.BUILT)
    timeline.mark(suite_timeline.LOOP, "rank 0")
    timeline.mark(suite_timeline.LOOP, "rank 1")
    timeline.mark(suite_timeline.FIRST, "rank 0")
    timeline.mark(suite_timeline.FIRST, "rank 1")
    timeline.mark(suite_timeline.ENDED, "rank 0")
    timeline.mark(suite_timeline.LOOP, "rank 0")
    timeline.mark(suite_timeline.FIRST, "rank 0")

    found = suite_timeline.stages(timeline.read(str(path)))
    assert found["groups"] == [107.0, 120.0]
    assert found["start"] == [7.0]  # the trial's group has no driver's trainer before it
    assert found["to the first step"] == [2.5, 2.0] and found["training"] == [1.5]
    lines = suite_timeline.report(timeline.read(str(path))).splitlines()
    assert lines[0] == "2 worker groups started"
    assert lines[2].split() == ["start", "1", "7.00", "7.0-7.0", "7"]
    assert lines[4].split() == ["training", "1", "1.50", "1.5-1.5", "2"]


def test_each_group_counts_for_the_test_that_started_it(tmp_path, monkeypatch, capsys):
    path = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(timeline.ENV, str(path))
    clock = iter([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    monkeypatch.setattr(timeline.time, "time", lambda: next(clock))
    pids = iter([1, 2, 3, 4, 5, 6, 7])
    monkeypatch.setattr(timeline.os, "getpid", lambda: next(pids))
    timeline.mark(timeline.TEST_STARTED, "tests/test_a.py::test_one")
    timeline.mark(suite_timeline.LOOP, "rank 0")
    timeline.mark(suite_timeline.LOOP, "rank 1")  # the same group's other rank
    timeline.mark(suite_timeline.LOOP, "rank 0")  # a restart: another group
    timeline.mark(timeline.TEST_STARTED, "tests/test_b.py::test_two")
    timeline.mark(timeline.TEST_STARTED, "tests/test_a.py::test_three")
    timeline.mark(suite_timeline.LOOP, "rank 0")
    marks = timeline.read(str(path))
    assert suite_timeline.groups_by_test(marks) == {"tests/test_a.py": 3}
    assert suite_timeline.groups_by_test(marks, per_test=True) == {
        "tests/test_a.py::test_one": 2,
        "tests/test_a.py::test_three": 1,
    }
    assert suite_timeline.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out.endswith("worker groups per test module:\n    3  tests/test_a.py\n"), out
