"""Hangs in real runs (real Ray, gloo): found by the ranks' watchdogs within
``--hang-timeout``, explained (every rank's stacks, the stuck rank named) and recovered from
(``--max-failures`` restarts from the latest checkpoint, exactly); a DataLoader worker that
hangs; stragglers named; no false alarm on slow first steps and slow checkpoints."""

from __future__ import annotations

import csv
import os

import pytest
from ledgers import EXACT_RUN, assert_same_weights, stalls
from waits import gone

from ray_ddp.checkpoint.format import load_state
from ray_ddp.driver.run import TrainingHung, fit
from ray_ddp.reliability.hangs.report import parse_header
from ray_ddp.testing.harness import Harness, Stall

pytestmark = pytest.mark.ray

TASK = "ray_ddp.image_classification:ImageClassification"
HANG_TIMEOUT = 4.0
SLACK_S = 6.0
"""Detection may take the watchdog's check interval, a step and py-spy's dumps past the
timeout."""


def read_report(path: str) -> tuple[dict[str, str], str]:
    with open(path) as file:
        text = file.read()
    return parse_header(text), text


def test_a_hung_rank_is_found_dumped_and_the_run_recovers_exactly(straight_run, tmp_path, capsys):
    storage = str(tmp_path)
    summary = fit(
        TASK, num_workers=2, storage_path=storage, name="hung", max_failures=1,
        hang_timeout=HANG_TIMEOUT, hang_grace=30, harness=stalls((13, 1)), **EXACT_RUN,
    )  # fmt: skip
    out = capsys.readouterr().out
    run_dir = os.path.join(storage, "hung")
    folder = os.path.join(run_dir, "hangs", "attempt-1")

    # Found within the timeout and a bounded slack of the moment rank 1 stopped.
    stalled_at = os.path.getmtime(os.path.join(run_dir, "stalled-step-13-rank-1"))
    found_after = os.path.getmtime(os.path.join(folder, "detected")) - stalled_at
    print(f"hang found {found_after:.1f} s after rank 1 stopped")
    # The watchdog counts from rank 1's last progress (step 12 done), a moment before it
    # writes the stall marker: detection may come that moment less than the timeout after
    # the marker (0.999 ms short once in CI).
    assert HANG_TIMEOUT - 0.25 <= found_after <= HANG_TIMEOUT + SLACK_S

    # Both ranks' stacks: rank 1 in the sleep, rank 0 in the gradient all-reduce.
    stuck, stuck_text = read_report(os.path.join(folder, "rank-1.txt"))
    waiting, waiting_text = read_report(os.path.join(folder, "rank-0.txt"))
    assert stuck["collective"] == "no" and stuck["where"].startswith("harness.py")
    assert "time.sleep(planned.seconds)" in stuck_text  # its Python stack
    assert "clock_nanosleep" in stuck_text or "py-spy failed" not in stuck_text  # native
    assert stuck["last_progress"] == "optimizer step 12"
    assert waiting["collective"] == "yes" and "gradient all-reduce" in waiting["phase"]
    assert waiting["last_progress"] == "optimizer step 13"
    assert "_engine_run_backward" in waiting_text

    # The driver's line, from Ray Train's controller; the restart from step 10.
    assert "hang on attempt 1: " in out and "stuck: rank 1 in harness.py" in out
    with open(os.path.join(run_dir, "attempts.csv")) as file:
        attempts = list(csv.DictReader(file))
    assert [(a["attempt"], a["world_size"]) for a in attempts] == [("1", "2"), ("2", "2")]
    assert not attempts[0]["checkpoint"]  # attempt 2 resumed from the checkpoint of step 10:
    assert f"{attempts[1]['checkpoint']}: 0 epochs, 10 steps done, 640 samples into" in out
    assert summary["epochs_completed"] == EXACT_RUN["epochs"]
    assert_same_weights(
        load_state(summary["latest_checkpoint"])["model"],
        load_state(straight_run["latest_checkpoint"])["model"],
    )
    assert all(not row["stragglers"] for row in straight_run["history"]), "an even run"


def test_a_hung_dataloader_worker_is_found_and_ends_the_run_with_one_line(ray_session, tmp_path):
    storage = str(tmp_path)
    with pytest.raises(TrainingHung) as raised:
        fit(
            TASK, num_workers=2, storage_path=storage, name="loader", loader_workers=1,
            hang_timeout=3, hang_grace=30, harness=Harness(hang_loader_sample=700),
            **dict(EXACT_RUN, epochs=1),
        )  # fmt: skip
    line = str(raised.value)
    print(line)
    run_dir = os.path.join(storage, "loader")
    assert line.startswith("hang on attempt 1: ")
    assert "waiting for data from the loader" in line and "HangOnSample.__getitem__" in line
    assert line.endswith(f"Stacks: {os.path.join(run_dir, 'hangs', 'attempt-1')}")
    reports = [
        read_report(os.path.join(run_dir, "hangs", "attempt-1", f"rank-{r}.txt")) for r in (0, 1)
    ]
    stuck = [header for header, _ in reports if header["collective"] == "no"]
    assert len(stuck) == 1 and "harness.py" in stuck[0]["loading"]
    # The hung loader worker did not outlive its rank.
    with open(os.path.join(run_dir, "stalled-loader")) as file:
        loader_pid = int(file.read())
    assert gone(loader_pid)


def test_a_rank_frozen_holding_pythons_lock_is_dumped_by_its_peer(ray_session, tmp_path):
    """Rank 1 sleeps in a native call without releasing Python's lock: its own watchdog
    never runs, so rank 0 (same host) dumps it with py-spy by pid."""
    storage = str(tmp_path)
    with pytest.raises(TrainingHung) as raised:
        fit(
            TASK, num_workers=2, storage_path=storage, name="frozen", hang_timeout=3,
            hang_grace=30, harness=Harness(stalls=(Stall(5, rank=1, frozen=True, seconds=120),)),
            **dict(EXACT_RUN, train_samples=640, epochs=1, checkpoint_every=None),
        )  # fmt: skip
    line = str(raised.value)
    print(line)
    assert "stuck: rank 1 in stall (ray_ddp/testing/harness.py:" in line
    assert "waiting for them in a collective: rank 0" in line
    folder = os.path.join(storage, "frozen", "hangs", "attempt-1")
    frozen, text = read_report(os.path.join(folder, "rank-1.txt"))
    assert frozen["found_by"].startswith("rank 0's py-spy: its own watchdog never ran")
    assert "sleep (libc" in text  # the native call it is in


def test_a_straggler_is_named_and_slow_starts_and_checkpoints_are_no_hang(ray_session, tmp_path):
    """Steps allowed 1.5 s; the first step takes 2 s more on every rank and every
    checkpoint 2 s more on rank 0 (both past the steady allowance, inside the 10 s grace);
    rank 1 is 30 ms slower every step than rank 0 (a few ms)."""
    storage = str(tmp_path)
    summary = fit(
        TASK, num_workers=2, storage_path=storage, name="uneven", hang_timeout=1.5,
        hang_grace=10,
        harness=Harness(slow_start_s=2.0, slow_checkpoint_s=2.0, slow_rank=1, slow_step_s=0.03),
        **dict(EXACT_RUN, train_samples=1280, epochs=1),
    )  # fmt: skip
    run_dir = os.path.join(storage, "uneven")
    assert not os.path.exists(os.path.join(run_dir, "hangs")), "a false alarm"
    (epoch,) = summary["history"]
    assert epoch["stragglers"] == "1"
    ranks = {row["rank"]: row for row in summary["per_rank"]}
    assert ranks[1]["ready_ms"] > ranks[0]["ready_ms"] + 20
    with open(os.path.join(run_dir, "metrics.csv")) as file:
        (row,) = list(csv.DictReader(file))
    assert row["stragglers"] == "1" and float(row["data_wait_max"]) < 0.5
