"""The hang watchdog's rules, its report and the line made of the reports, the straggler
rule and the hang settings, without Ray (a real watchdog thread, real stacks, and a real
2-process gloo group for the collective a stack shows)."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from waits import Clock

from ray_ddp.config import TrainConfig
from ray_ddp.io import reporting
from ray_ddp.reliability.attempts import last_attempt, record_attempt
from ray_ddp.reliability.hangs import dump as hang_dump
from ray_ddp.reliability.hangs.dump import HangSite, handle_hang, loading_frame, rank_report
from ray_ddp.reliability.hangs.report import (
    hang_folder,
    hang_line,
    hang_signature,
    latest_hang,
    parse_header,
)
from ray_ddp.reliability.hangs.settings import nccl_env, process_group_timeout_s
from ray_ddp.reliability.hangs.watchdog import AUTO_FLOOR_S, Stall, Watchdog
from ray_ddp.worker.timing import EpochTiming


def watching(steady_s: float | None, grace_s: float, peer_check=None) -> tuple[Watchdog, list]:
    stalls: list[tuple[float, Stall]] = []
    watchdog = Watchdog(
        lambda stall: stalls.append((time.monotonic(), stall)), steady_s, grace_s, peer_check
    )
    return watchdog, stalls


def test_progress_keeps_it_quiet_and_silence_past_the_timeout_is_a_hang():
    watchdog, stalls = watching(steady_s=0.4, grace_s=5)
    watchdog.start()
    watchdog.doing("training")
    for step in range(1, 21):  # 1 s of steps, each well inside 0.4 s
        time.sleep(0.05)
        watchdog.progress("optimizer step", step)
    assert not stalls
    silent_from = time.monotonic()
    watchdog.doing("training: waiting for data", collective=False)
    time.sleep(1.2)
    watchdog.stop()
    assert len(stalls) == 1, "found once"
    found_at, stall = stalls[0]
    assert 0.4 <= found_at - silent_from <= 0.4 + 2 * watchdog.check_s + 0.2
    assert stall.phase == "training: waiting for data" and not stall.collective
    assert stall.last_progress == "optimizer step 20" and stall.thread_id == threading.get_ident()


def test_what_is_slow_by_nature_gets_the_grace():
    clock = Clock()
    watchdog = Watchdog(lambda stall: None, steady_s=0.3, grace_s=1.2, clock=clock)
    watchdog.doing("checkpoint", slow=True)
    clock.now += 0.9  # three times the steady allowance, inside the grace
    assert watchdog.check() is None
    clock.now += 0.31
    stall = watchdog.check()
    assert stall.phase == "checkpoint" and stall.allowed_s == 1.2 and not stall.by_peer
    watchdog.doing("training")  # the same silence in a steady phase: long past its 0.3 s
    assert watchdog.check().allowed_s == 0.3


def test_a_rank_inside_its_grace_writes_its_stacks_once_another_rank_found_a_hang():
    clock, asked = Clock(), []
    found = threading.Event()

    def peer_check() -> bool:
        asked.append(clock.now)
        return found.is_set()

    watchdog = Watchdog(
        lambda s: None, steady_s=0.2, grace_s=30, peer_check=peer_check, clock=clock
    )
    watchdog.doing("epoch end: checkpoint and report", slow=True)
    clock.now += 0.1
    assert watchdog.check() is None and not asked  # inside the steady allowance: not asked
    clock.now += 0.4
    assert watchdog.check() is None and len(asked) == 1  # asked: no hang found elsewhere
    found.set()
    stall = watchdog.check()
    assert stall.by_peer and stall.allowed_s == 30 and stall.idle_s == pytest.approx(0.5)


def test_the_auto_timeout_follows_the_step_time_within_its_floor_and_the_grace():
    watchdog, _ = watching(steady_s=None, grace_s=600)
    assert watchdog.steady_allowance() == 600, "no step time known yet: the grace"
    for step in range(1, 8):
        watchdog.progress("optimizer step", step)
    assert watchdog.steady_allowance() == AUTO_FLOOR_S  # fast steps: the floor
    watchdog._intervals.extend([10.0] * 50)  # 10 s steps: 20 x 10 s
    assert watchdog.steady_allowance() == 200
    short_grace, _ = watching(steady_s=None, grace_s=60)
    short_grace._intervals.extend([10.0] * 50)
    assert short_grace.steady_allowance() == 60, "never past the grace"
    explicit, _ = watching(steady_s=900, grace_s=60)
    assert explicit.allowance() == 900 and explicit.grace_s == 900


def test_an_interval_broken_by_other_work_is_not_a_step_time():
    watchdog, _ = watching(steady_s=None, grace_s=600)
    watchdog.progress("optimizer step", 1)
    watchdog.progress("checkpoint at step 1")
    watchdog.progress("optimizer step", 2)
    watchdog.progress("optimizer step", 4)  # a resumed count, not the next step
    assert len(watchdog._intervals) == 0
    watchdog.progress("optimizer step", 5)
    assert len(watchdog._intervals) == 1


def _sleeping_thread() -> tuple[threading.Thread, threading.Event]:
    release = threading.Event()

    def stuck_in_a_sleep() -> None:
        release.wait(30)

    thread = threading.Thread(target=stuck_in_a_sleep, name="train")
    thread.start()
    time.sleep(0.1)
    return thread, release


def test_the_report_has_the_stuck_threads_stack_and_a_header_to_read_back(tmp_path):
    thread, release = _sleeping_thread()
    stall = Stall(5.2, 5.0, "training: forward and backward", False, "optimizer step 7",
                  thread.ident)  # fmt: skip
    site = HangSite(rank=1, world_size=2, attempt=3, folder=str(tmp_path))
    try:
        text = rank_report(stall, site)
    finally:
        release.set()
        thread.join()
    header = parse_header(text)
    assert header["rank"] == "1 of 2" and header["attempt"] == "3"
    assert header["where"].startswith("threading.py:") and header["where"].endswith("in wait")
    assert header["collective"] == "no" and header["last_progress"] == "optimizer step 7"
    assert "in stuck_in_a_sleep" in text  # the training thread's Python stack, first
    assert text.index("(training loop)") < text.index("-- thread MainThread")
    if hang_dump.py_spy() is not None:
        assert f"py-spy dump --native --pid {os.getpid()}" in text


def test_a_hung_rank_writes_its_report_waits_for_the_others_then_ends(tmp_path, monkeypatch):
    """It waits until every rank has reported (rank 1 here, once rank 0 has), or, for a rank
    that never does, until the wait's limit; either way the rank then ends."""
    monkeypatch.setattr(hang_dump, "py_spy", lambda: None)  # this test is about the rest
    stall = Stall(1.1, 1.0, "training: waiting for data from the loader", False,
                  "optimizer step 2", threading.get_ident())  # fmt: skip
    folder = tmp_path / "attempt-1"
    site = HangSite(rank=0, world_size=2, attempt=1, folder=str(folder))

    def rank_1_reports() -> None:
        while not (folder / "rank-0.txt").exists():
            time.sleep(0.02)
        (folder / "rank-1.txt").write_text("rank 1's report")

    monkeypatch.setattr(hang_dump, "PEER_WAIT_MIN_S", 60.0)
    threading.Thread(target=rank_1_reports, daemon=True).start()
    ended, started = [], time.monotonic()
    handle_hang(stall, site, end=ended.append)
    assert ended == [hang_dump.EXIT_HUNG]
    assert time.monotonic() - started < 30, "ended once rank 1 reported, not at the limit"
    assert (folder / "detected").read_text() == "rank 0\n"
    assert "py-spy not found" in (folder / "rank-0.txt").read_text()

    monkeypatch.setattr(hang_dump, "PEER_WAIT_MIN_S", 0.5)
    silent = HangSite(rank=0, world_size=2, attempt=2, folder=str(tmp_path / "attempt-2"))
    started = time.monotonic()
    handle_hang(stall, silent, end=ended.append)
    assert ended == [hang_dump.EXIT_HUNG] * 2 and time.monotonic() - started >= 0.5


def test_a_silent_rank_on_this_host_is_dumped_by_pid(tmp_path):
    """A process that never runs its watchdog (here: one asleep in a native call holding
    Python's lock) gets its report from a peer's py-spy."""
    if hang_dump.py_spy() is None:
        pytest.skip("py-spy is not installed")
    frozen = subprocess.Popen(
        [sys.executable, "-c", "import ctypes; print(flush=True); ctypes.PyDLL(None).sleep(60)"],
        stdout=subprocess.PIPE,
    )
    try:
        frozen.stdout.readline()  # started
        site = HangSite(rank=0, world_size=2, attempt=1, folder=str(tmp_path),
                        peers=(("elsewhere", 1), (socket.gethostname(), frozen.pid)))  # fmt: skip
        stall = Stall(3.2, 3.0, "training: backward", True, "optimizer step 5", 0)
        hang_dump.dump_silent_peer(stall, site, 1)
        hang_dump.dump_silent_peer(stall, site, 0)  # another host's rank: nothing to do
    finally:
        frozen.kill()
        frozen.wait()
    assert sorted(os.listdir(tmp_path)) == ["rank-1.txt"]
    header = parse_header((tmp_path / "rank-1.txt").read_text())
    assert header["pid"] == str(frozen.pid) and header["where"] == "<module> (<string>:1)"
    assert header["found_by"].startswith("rank 0's py-spy: its own watchdog never ran")
    line = hang_line(str(tmp_path), 1, {1: header}, 2)
    assert "stuck: rank 1 in <module> (<string>:1) (unknown: no Python ran in the process)" in line


def test_a_report_that_cannot_be_written_still_ends_the_hung_rank(tmp_path, capsys):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the hang folder should go")
    site = HangSite(rank=0, world_size=1, attempt=1, folder=str(blocker / "attempt-1"))
    stall = Stall(1.1, 1.0, "training: forward and backward", False, "optimizer step 2", 0)
    ended = []
    handle_hang(stall, site, end=ended.append)
    assert ended == [hang_dump.EXIT_HUNG]
    assert "rank 0 hung; its report failed: " in capsys.readouterr().out


def _report(rank: int, collective: bool, where: str, phase: str, last: str, **extra) -> dict:
    return {"rank": f"{rank} of 3", "idle_s": "4.2", "allowed_s": "4.0", "where": where,
            "phase": phase, "last_progress": last, "collective": "yes" if collective else "no",
            **extra}  # fmt: skip


def test_the_line_names_the_stuck_rank_the_waiting_ones_and_the_silent_one():
    reports = {
        0: _report(0, True, "graph.py:1 in _engine_run_backward", "training: backward",
                   "optimizer step 13"),
        1: _report(1, False, "harness.py:112 in stall", "training: optimizer step",
                   "optimizer step 12"),
    }  # fmt: skip
    line = hang_line("runs/x/hangs/attempt-2", 2, reports, world_size=3)
    assert line == (
        "hang on attempt 2: no progress for 4 s (allowed 4 s). stuck: rank 1 in "
        "harness.py:112 in stall (training: optimizer step; after optimizer step 12). "
        "waiting for them in a collective: rank 0 (training: backward; after optimizer step "
        "13). no report from rank 2. Stacks: runs/x/hangs/attempt-2"
    )
    moved = {**reports, 0: {**reports[0], "idle_s": "9.0"}}
    assert hang_signature(moved) == hang_signature(reports), "the same place, the same hang"
    elsewhere = {**reports, 1: {**reports[1], "last_progress": "optimizer step 40"}}
    assert hang_signature(elsewhere) != hang_signature(reports)


def test_a_stuck_loader_is_named_by_the_frame_its_worker_is_in():
    dump = """Process 42: ray::RayTrainWorker
Thread 42 (idle): "MainThread"
    HangOnSample.__getitem__ (ray_ddp/testing/harness.py:150)
    _MapDatasetFetcher.fetch (torch/utils/data/_utils/fetch.py:54)
    _worker_loop (torch/utils/data/_utils/worker.py:375)
"""
    idle = dump.replace("    HangOnSample.__getitem__ (ray_ddp/testing/harness.py:150)\n", "")
    idle = idle.replace("_MapDatasetFetcher.fetch (torch/utils/data/_utils/fetch.py:54)",
                        "Queue.get (multiprocessing/queues.py:113)")  # fmt: skip
    assert loading_frame(dump) == "HangOnSample.__getitem__ (ray_ddp/testing/harness.py:150)"
    assert loading_frame(idle) is None
    loading = "pid 42 in HangOnSample.__getitem__ (ray_ddp/testing/harness.py:150)"
    report = _report(0, False, "selectors.py:415 in select",
                     "training: waiting for data from the loader", "optimizer step 7",
                     loading=loading)  # fmt: skip
    assert "its DataLoader: pid 42 in HangOnSample.__getitem__" in hang_line("f", 1, {0: report}, 1)


def test_the_latest_attempts_hang_is_read_back_and_an_older_one_is_not(tmp_path):
    run_dir = str(tmp_path)
    assert latest_hang(run_dir) is None
    assert record_attempt(run_dir, 2, "") == 1
    folder = hang_folder(run_dir, 1)
    os.makedirs(folder)
    text = "# ray_ddp hang report\n" + "".join(
        f"{k}: {v}\n" for k, v in _report(1, False, "x.py:1 in f", "p", "optimizer step 3").items()
    )
    with open(os.path.join(folder, "rank-1.txt"), "w") as file:
        file.write(text + "\n== Python stacks ==\n")
    line, signature = latest_hang(run_dir)
    assert "stuck: rank 1 in x.py:1 in f" in line and "no report from rank 0" in line
    assert signature == "hang: rank 1 at x.py:1 in f after optimizer step 3"
    assert record_attempt(run_dir, 1, "checkpoint_2026-11-30_22-35-42.586027") == 2
    assert last_attempt(run_dir)["world_size"] == "1"
    assert last_attempt(run_dir)["checkpoint"] == "checkpoint_2026-11-30_22-35-42.586027"
    assert latest_hang(run_dir) is None, "attempt 2 did not hang"


def _rank_in_all_reduce(rank: int, store: str, out, gate) -> None:
    import sys

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    if rank == 1:
        gate.wait(60)  # rank 0 waits for it in the all-reduce until the test has looked
    else:
        main = threading.get_ident()

        def look() -> None:
            # What the watchdog's dump would see while rank 0 waits: its first sight of a
            # collective (None until the main thread is inside the all-reduce).
            deadline = time.monotonic() + 30
            seen = None
            while seen is None and time.monotonic() < deadline:
                time.sleep(0.05)
                seen = hang_dump.collective_call(sys._current_frames()[main])
            out.put(seen)

        threading.Thread(target=look).start()
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()


def test_a_stack_waiting_in_a_torch_distributed_call_is_seen_as_in_a_collective(tmp_path):
    context = multiprocessing.get_context("spawn")
    out, gate = context.Queue(), context.Event()
    store = str(tmp_path / "store")  # a file store: no port to race for
    ranks = [
        context.Process(target=_rank_in_all_reduce, args=(r, store, out, gate)) for r in (0, 1)
    ]
    for process in ranks:
        process.start()
    try:
        assert out.get(timeout=60) == "torch.distributed.all_reduce"
    finally:
        gate.set()
        for process in ranks:
            process.join(timeout=30)
    assert [p.exitcode for p in ranks] == [0, 0]


def test_stragglers_are_ranks_much_slower_than_the_others_with_as_many_micro_batches():
    def row(rank: int, ready: float, micro: int = 1, wait: float = 0.0) -> dict:
        return {"rank": rank, "ready_ms": ready, "micro_per_step": micro, "data_wait": wait}

    even = [row(0, 10.0), row(1, 13.5), row(2, 9.0), row(3, 10.4)]  # 1.3x: CPU sharing
    assert reporting.stragglers(even) == []
    slow = [*even[:3], row(3, 31.0)]
    assert reporting.stragglers(slow) == [(3, 31.0, 10.0)]
    # An uneven split: ranks 0-1 train 2 micro-batches per step, 2-3 one. Not stragglers.
    uneven = [row(0, 20.0, 2), row(1, 21.0, 2), row(2, 10.0), row(3, 10.5)]
    assert reporting.stragglers(uneven) == []
    tiny = [row(0, 3.0), row(1, 7.0)]  # 2.3x, but 4 ms: timer noise on a tiny step
    assert reporting.stragglers(tiny) == []
    timing = reporting.rank_timing([row(0, 10.0, wait=0.02), row(1, 31.0, wait=0.4)])
    assert timing == {"data_wait_max": 0.4, "data_wait_rank": 1, "stragglers": "1"}
    rows = [{"rank": r, "host": "gpu-7", "node_id": "abcdef123456"} for r in (0, 1)]
    (line,) = reporting.straggler_lines([row(0, 10.0), row(1, 31.0)], rows)
    assert line.startswith("straggler: rank 1 (gpu-7, node abcdef12) needs 31.0 ms per step")


def test_the_epoch_line_shows_a_large_data_wait_and_the_table_every_ranks():
    metrics = {"epoch": 1, "train_loss": 1.0, "val_acc": 0.5, "lr": 1e-3,
               "samples_per_s": 100.0, "epoch_s": 2.0}  # fmt: skip
    assert "data wait" not in reporting.epoch_line({**metrics, "data_wait_max": 0.05,
                                                    "data_wait_rank": 1}, 3)  # fmt: skip
    line = reporting.epoch_line({**metrics, "data_wait_max": 0.34, "data_wait_rank": 1}, 3)
    assert line.endswith("data wait 34% (rank 1)")
    table = reporting.worker_table([
        {"rank": r, "samples_per_s": 50.0, "peak_memory_mb": 900.0, "memory_kind": "peak RSS",
         "ready_ms": 3.0 + r, "data_wait": 0.1 * r, "data_wait_ms": 2.5 * r} for r in (0, 1)
    ])  # fmt: skip
    assert "ready ms/step  data wait (ms/step)" in table
    assert table.splitlines()[2].split()[:5] == ["1", "50", "4.0", "10%", "(2.5)"]


def test_epoch_timing_takes_the_median_of_the_steps_with_the_usual_micro_batch_count():
    timing = EpochTiming()
    timing.data_wait_s = 0.5
    timing.ready.extend([(2, 0.010), (2, 0.012), (2, 0.011), (1, 0.5), (2, 0.9)])
    summary = timing.summary(train_seconds=5.0)
    assert summary == {"data_wait": 0.1, "data_wait_ms": 100.0,  # 0.5 s over 5 steps
                       "ready_ms": pytest.approx(11.5), "micro_per_step": 2}  # fmt: skip


def test_the_process_group_timeout_comes_after_every_allowance_and_nccl_is_set_up():
    cfg = TrainConfig(num_workers=2, name="r")
    assert process_group_timeout_s(cfg.reliability) == 2 * 600 + 60
    assert process_group_timeout_s(cfg.replace(hang_timeout=0).reliability) == 1800
    hung = cfg.replace(hang_timeout=900, hang_grace=60)
    assert process_group_timeout_s(hung.reliability) == 1860
    assert nccl_env(False, "r") == {} and nccl_env(None, "r") == {}
    env = nccl_env(True, "r")
    assert (
        env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    )
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/tmp/ray_ddp_nccl_trace_r_rank_"
    os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] = "50"
    try:
        assert nccl_env(True, "r")["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50"
    finally:
        del os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"]
