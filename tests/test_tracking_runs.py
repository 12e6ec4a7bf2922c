"""Experiment tracking and profiles in real runs: a real MLflow server (``mlflow_server``:
SQLite store, local artifacts, 127.0.0.1) and real 2-worker fits on the shared Ray,
everything read back through ``MlflowClient``. (A tracked sweep, a parent run with a
child run per trial, is test_tune's interrupted and resumed sweep.)

One fit carries most assertions (``tracked``): rank 1 dies at step 8, after checkpoint
4 and after rank 0 has logged steps past it, and the run restarts from the checkpoint
(``--max-failures 1``); it profiles steps 10-11 of the second attempt."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid

import pytest
from mlflow_server import MlflowServer, server_command
from slow_proxy import SlowProxy

from ray_ddp.driver.run import fit
from ray_ddp.driver.tracking import finish_tracking, open_tracking
from ray_ddp.testing.harness import Harness, Stall
from ray_ddp.tracking.params import Settings, run_tags
from ray_ddp.tracking.tracker import Tracker, read_run_id

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(server_command() is None, reason="pip install -e '.[test]' (mlflow)"),
]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = "ray_ddp.image_classification:ImageClassification"
# 512 samples in global batches of 64: 8 steps an epoch, 16 in all.
SMALL = dict(num_workers=2, train_samples=512, val_samples=128, batch_size=32, epochs=2,
             loader_workers=0, export=False, tensorboard=False, log_every_steps=1)  # fmt: skip


@pytest.fixture(scope="module")
def server(tracking_server):
    return tracking_server  # the session's (conftest): test_tune's sweep logs there too


@pytest.fixture(scope="module")
def client(server):
    from mlflow.tracking import MlflowClient

    return MlflowClient(server.uri)


@pytest.fixture(scope="module")
def tracked(ray_session, server, tmp_path_factory):
    """The killed-and-restarted, profiled, tracked fit: its summary and run folder."""
    storage = str(tmp_path_factory.mktemp("tracked"))
    # Rank 1 holds step 7 for 3 s (rank 0 waits in its all-reduce while its sender sends
    # steps 1-6), then dies at step 8: the restart resumes from checkpoint 4.
    harness = Harness(stalls=(Stall(7, rank=1, seconds=3.0), Stall(8, rank=1, exit=True)))
    started = time.perf_counter()
    summary = fit(TASK, **SMALL, storage_path=storage, name="tracked", checkpoint_every=4,
                  max_failures=1, tracking="mlflow", tracking_uri=server.uri,
                  experiment="tests", profile_steps="10-11", harness=harness)  # fmt: skip
    print(f"tracked fit: {time.perf_counter() - started:.1f} s")
    return summary


def _run(client, summary):
    return client.get_run(summary["tracking"]["run_id"])


def _runs(client, experiment: str) -> list:
    found = client.get_experiment_by_name(experiment)
    return list(client.search_runs([found.experiment_id])) if found else []


def test_an_open_answered_too_late_makes_no_second_run(server, client, tmp_path, monkeypatch):
    """The driver opens the run before the workers start; the server makes it, but its
    answer comes after the client has given up (a slow network: ``slow_proxy``). Rank 0
    then opens the run as the workers do, logs, and the driver ends it: one MLflow run,
    with everything. (No Ray: the driver's and rank 0's own calls, in their order.)"""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")  # 10 s in a run: shortened here
    run_dir, experiment = str(tmp_path / "late"), f"late-{uuid.uuid4().hex[:8]}"
    lines: list[str] = []
    with SlowProxy(server.uri) as proxy:
        proxy.hold("/runs/create", seconds=4)
        settings = Settings("mlflow", proxy.uri, experiment, "late", run_dir,
                            run_tags("late", run_dir, None))  # fmt: skip
        open_tracking(settings)  # the driver, before the workers
        rank0 = Tracker(settings, read_run_id(run_dir, "mlflow"), lines.append)
        rank0.params({"lr": 0.1})
        rank0.points(1, {"train_loss": 1.0})
        rank0.metrics(1, {"val_loss": 0.5})
        ended = rank0.close(30)
        finish_tracking(settings, {"tracking": ended})
        made = proxy.seen("/runs/create")
    assert made == 1  # the make whose answer was lost is found by its key, not asked again
    runs = _runs(client, experiment)
    assert len(runs) == 1, [(r.info.run_id, r.info.start_time) for r in runs]
    (run,) = runs
    assert run.info.run_id == ended["run_id"] == read_run_id(run_dir, "mlflow")
    assert run.data.params == {"lr": "0.1"} and run.info.status == "FINISHED"
    assert set(run.data.metrics) == {"train_loss", "val_loss"}


def test_a_server_far_behind_the_run_loses_step_points_only_and_the_end_line_says_so(
    server, client, tmp_path
):
    """The server takes the params, then answers only once 200 steps' points (3 a step)
    and 10 epochs' metrics (2 each) have been put into a queue of 60 step points (a slow
    network: ``slow_proxy``). What the server holds is read back: every param and metric,
    the thinned curve's points, and the end line's numbers are exactly those. (No Ray:
    rank 0's tracker as the workers use it.)"""
    run_dir, experiment = str(tmp_path / "behind"), f"behind-{uuid.uuid4().hex[:8]}"
    answered = threading.Event()
    with SlowProxy(server.uri) as proxy:
        settings = Settings("mlflow", proxy.uri, experiment, "behind", run_dir, {})
        tracker = Tracker(settings, None, print, interval_s=0.05, capacity=60)
        assert tracker.wait_for_run(30)
        proxy.hold("/runs/log-batch", until=answered)
        tracker.params({f"p{i}": i for i in range(10)})
        tracker.sender.flush()
        deadline = time.monotonic() + 10
        while not proxy.seen("/runs/log-batch") and time.monotonic() < deadline:
            time.sleep(0.01)
        for step in range(1, 201):  # the server has the params; its answer is held
            tracker.points(step, {"train_loss": 1.0 / step, "lr": 0.1, "samples_per_s": 9.0})
            if step % 20 == 0:
                tracker.metrics(step, {"val_loss": 0.5, "epoch_train_loss": 0.6})
        answered.set()
        ended = tracker.close(30)
        line = tracker.sender.line()
    run = client.get_run(ended["run_id"])
    assert run.data.params == {f"p{i}": str(i) for i in range(10)}
    for key in ("val_loss", "epoch_train_loss"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == list(
            range(20, 201, 20)
        )
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train_loss"))
    for key in ("lr", "samples_per_s"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == steps
    assert steps[-1] == 200 and len(steps) == len(set(steps)) <= 20
    held = 3 * len(steps)
    assert ended["thinned_points"] == 600 - held and ended["dropped"] == 600 - held
    assert ended["delivered"] == {"param": 10, "point": held, "metric": 20}
    assert line == (
        f"MLflow tracking ({proxy.uri}): not everything reached the tracker: {600 - held} "
        "step points thinned out while the tracker lagged behind (every other step waiting, "
        f"the newest kept); it has {held} step points, 20 metrics, 10 params"
    )


def test_params_tags_and_status(tracked, client):
    run = _run(client, tracked)
    params = run.data.params
    assert params["world_size"] == "2" and params["global_batch_size"] == "64"
    assert params["task"] == TASK and params["lr"] == "0.003"
    assert params["warmup_steps"] == "auto"  # None: decided by the run
    assert params["torch_version"] and params["ray_version"]
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert run.data.tags["ray_ddp.run_dir"] == tracked["run_dir"]
    assert re.fullmatch(r"[0-9a-f]{40}", run.data.tags["mlflow.source.git.commit"])
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == "tests"


def test_a_restart_continues_the_run_without_logging_a_step_twice(tracked, client):
    run_id = tracked["tracking"]["run_id"]
    history = client.get_metric_history(run_id, "train_loss")
    steps = [m.step for m in history]
    assert sorted(steps) == list(range(1, 17)), steps  # every step, once
    # The failed attempt had logged steps past checkpoint 4, which the restart trained
    # again: they are the first attempt's (logged before the second attempt started).
    with open(os.path.join(tracked["run_dir"], "attempts.csv")) as f:
        assert len(list(csv.DictReader(f))) == 2
    by_step = {m.step: m.timestamp for m in history}
    restarted = min(by_step[s] for s in range(9, 17))
    assert by_step[5] < restarted and by_step[6] < restarted
    for key in ("lr", "samples_per_s"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == steps
    # Per-epoch metrics at each epoch's last step.
    for key in ("val_loss", "val_acc", "epoch_train_loss", "data_wait_max", "epoch_s"):
        assert [m.step for m in client.get_metric_history(run_id, key)] == [8, 16], key
    assert len(list(client.search_runs([_run(client, tracked).info.experiment_id]))) == 1


def test_artifacts_and_profiles(tracked, client, tmp_path):
    run_id = tracked["tracking"]["run_id"]
    names = {a.path for a in client.list_artifacts(run_id)}
    assert {"curves.png", "metrics.csv", "summary.json", "profiles"} <= names, names
    local = client.download_artifacts(run_id, "summary.json", str(tmp_path))
    with open(local) as f:
        assert json.load(f)["steps"] == 16
    # The second attempt (the first trained steps 1-8) recorded steps 10-11.
    traces = {a.path for a in client.list_artifacts(run_id, "profiles/attempt-2")}
    assert traces == {f"profiles/attempt-2/rank-{r}.trace.json" for r in (0, 1)}, traces
    folder = os.path.join(tracked["run_dir"], "profiles", "attempt-2")
    assert tracked["profile"]["folder"] == folder
    for rank in (0, 1):
        with open(os.path.join(folder, f"rank-{rank}.trace.json")) as f:
            events = json.load(f)["traceEvents"]
        ops = {e.get("name") for e in events}
        assert {"aten::conv2d", "aten::addmm"} <= ops, sorted(o for o in ops if o)[:50]
        # Two optimizer steps recorded: two ProfilerStep ranges.
        assert len({n for n in ops if n and n.startswith("ProfilerStep#")}) == 2
    assert "aten::" in tracked["profile"]["top"]


def _job_lines(proc: subprocess.Popen, lines: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip())


def test_a_server_stopped_mid_run_costs_one_warning_line_and_the_run_finishes(
    ray_session, tmp_path
):
    """``jobs/train.py`` as users run it; its server goes away after the first metrics
    arrive (rank 0 holds before step 4 until the test has stopped it: steps 1-3 logged,
    4-16 never will be). Training goes on, the run ends with exit 0, one line says what
    happened."""
    from mlflow.tracking import MlflowClient

    storage, summary_path = str(tmp_path / "runs"), str(tmp_path / "summary.json")
    down = MlflowServer(str(tmp_path / "mlflow"))
    lines: list[str] = []
    proc = None
    try:  # the server and the job stopped whatever happens
        down.start()
        argv = [sys.executable, os.path.join(ROOT, "jobs", "train.py"),
                "--address", ray_session.get_runtime_context().gcs_address,
                "--num-workers", "2", "--train-samples", "512", "--val-samples", "128",
                "--batch-size", "32", "--epochs", "2", "--loader-workers", "0", "--no-export",
                "--no-tensorboard", "--log-every-steps", "1", "--storage-path", storage,
                "--name", "down", "--tracking", "mlflow", "--tracking-uri", down.uri,
                "--summary-json", summary_path]  # fmt: skip
        released = str(tmp_path / "server-stopped")
        held = Harness(stalls=(Stall(4, rank=0, seconds=120, until_file=released),))
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env={**os.environ, **held.to_env()})  # fmt: skip
        reader = threading.Thread(target=_job_lines, args=(proc, lines), daemon=True)
        reader.start()
        client, run_id = MlflowClient(down.uri), None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            path = os.path.join(storage, "down", "tracking.json")
            if run_id is None and os.path.exists(path):
                with open(path) as f:
                    run_id = json.load(f)["mlflow"].get("run_id")  # its key comes first
            if run_id and client.get_metric_history(run_id, "train_loss"):
                break
            time.sleep(0.2)
        else:
            pytest.fail("no metric reached the server\n" + "\n".join(lines[-30:]))
        down.stop()  # mid-run: the first steps are logged, the rest never will be
        open(released, "w").close()  # rank 0 goes on
        assert proc.wait(timeout=180) == 0, "\n".join(lines[-30:])
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        down.stop()
    reader.join(timeout=10)
    warnings = [line for line in lines if "warning" in line.lower()]
    assert len(warnings) == 1, warnings
    assert "MLflow tracking" in warnings[0] and "training goes on" in warnings[0]
    with open(summary_path) as f:
        summary = json.load(f)
    assert summary["steps"] == 16 and summary["epochs_completed"] == 2
    assert summary["tracking"]["dropped"] > 0 and summary["tracking"]["warned"]


def test_wandb_offline_gets_the_same_content(ray_session, tmp_path):
    """``--tracking wandb`` in offline mode, read back from the transaction logs W&B wrote
    (``wandb_records``): the params, every step's loss once, the epochs' metrics, the
    run's files. (``jobs/train.py`` as a process: W&B's service stays out of the tests'.)"""
    import wandb_records

    summary_path = str(tmp_path / "summary.json")
    argv = [sys.executable, os.path.join(ROOT, "jobs", "train.py"),
            "--address", ray_session.get_runtime_context().gcs_address,
            "--num-workers", "2", "--train-samples", "512", "--val-samples", "128",
            "--batch-size", "32", "--epochs", "1", "--loader-workers", "0", "--no-export",
            "--no-tensorboard", "--log-every-steps", "1", "--storage-path", str(tmp_path),
            "--name", "wb", "--tracking", "wandb", "--experiment", "tests",
            "--summary-json", summary_path]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    job = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    with open(summary_path) as f:
        summary = json.load(f)
    run_dir = summary["run_dir"]
    with open(os.path.join(run_dir, "tracking.json")) as f:
        run_id = json.load(f)["wandb"]["run_id"]
    logs = wandb_records.offline_runs(run_dir)
    assert logs and all(path.endswith(f"run-{run_id}.wandb") for path in logs), logs
    config = wandb_records.config(logs)
    assert config["world_size"] == "2" and config["global_batch_size"] == "64"
    assert config["task"] == TASK and config["tag.ray_ddp.run_dir"] == run_dir, config
    rows = wandb_records.history(logs)
    losses = [row["_step"] for row in rows if "train_loss" in row]
    assert losses == list(range(1, 9)), rows  # 8 steps, each once, in order
    assert [row["_step"] for row in rows if "val_acc" in row] == [8]
    assert {"curves.png", "metrics.csv", "summary.json"} <= wandb_records.saved_files(logs)


def test_a_rerun_of_the_same_name_continues_the_same_run(tracked, server, client):
    """The same command with more epochs continues the tracked run: one MLflow run, each
    step once, the curve going on at step 17. (Last in the module: it extends the run the
    tests above read.)"""
    storage = os.path.dirname(tracked["run_dir"])
    summary = fit(TASK, **{**SMALL, "epochs": 3}, storage_path=storage, name="tracked",
                  checkpoint_every=4, max_failures=1, tracking="mlflow",
                  tracking_uri=server.uri, experiment="tests", profile_steps="10-11")  # fmt: skip
    run_id = tracked["tracking"]["run_id"]
    assert summary["tracking"]["run_id"] == run_id
    steps = [m.step for m in client.get_metric_history(run_id, "train_loss")]
    assert sorted(steps) == list(range(1, 25)), steps  # 16 before, 8 now: each once
    assert [m.step for m in client.get_metric_history(run_id, "val_acc")] == [8, 16, 24]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert len(list(client.search_runs([run.info.experiment_id]))) == 1
