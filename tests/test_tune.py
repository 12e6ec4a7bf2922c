"""Ray Tune sweeps on the real path: local Ray, 2 CPU workers per trial, ASHA; and an own
loop's sweep (``ray_ddp.sweep``), 1 worker per trial."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import ray_ddp
from ray_ddp.checkpoint.format import load_checkpoint_state, load_model
from ray_ddp.config import ConfigError, SweepConfig, TrainConfig
from ray_ddp.driver.cli import tune_main
from ray_ddp.driver.sweep_results import trial_lr
from ray_ddp.driver.tune import plan_concurrency

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_concurrency_is_derived_from_the_cluster():
    cfg = TrainConfig(num_workers=2, cpus_per_worker=1.0, use_gpu=False)
    sweep = SweepConfig(num_samples=8)
    assert plan_concurrency(cfg.scaling, sweep, {"CPU": 16}) == 7  # 16 // 2.1
    assert plan_concurrency(cfg.scaling, SweepConfig(num_samples=3), {"CPU": 16}) == 3
    assert plan_concurrency(cfg.scaling, SweepConfig(max_concurrent_trials=2), {"CPU": 16}) == 2
    gpu = TrainConfig(num_workers=4, cpus_per_worker=1.0, use_gpu=True)
    assert plan_concurrency(gpu.scaling, sweep, {"CPU": 64, "GPU": 8}) == 2
    # A custom resource per worker counts like the GPUs: 5 slots hold 2 trials of 2 workers.
    slots = cfg.replace(resources_per_worker={"trainer_slot": 1.0})
    assert plan_concurrency(slots.scaling, sweep, {"CPU": 16, "trainer_slot": 5}) == 2
    with pytest.raises(ConfigError, match="needs 2 trainer_slot .* the cluster has 1"):
        plan_concurrency(slots.scaling, sweep, {"CPU": 16, "trainer_slot": 1})
    with pytest.raises(ConfigError, match="one trial needs 2.1 CPUs .* the cluster has 2 CPUs"):
        plan_concurrency(cfg.scaling, sweep, {"CPU": 2})


def test_scale_lr_follows_the_global_batch():
    config = {"lr": 0.01, "batch_size": 128, "scale_lr": True, "train": {"batch_size": 64}}
    assert trial_lr(config) == pytest.approx(0.02)
    assert trial_lr({**config, "scale_lr": False}) == 0.01


def test_an_own_loops_sweep_refuses_bad_input_before_ray(capsys):
    """``ray_ddp.sweep`` refuses what ``jobs/tune.py`` and ``ray_ddp.main`` refuse, in one
    line, exit 2, before Ray starts (the fast tier fails any test that starts it)."""
    from examples.own_loop import seed_port

    for argv, line in (
        (["--data-engine", "ray"], "--data-engine ray"),
        (["--lr-min", "0.1", "--lr-max", "0.01"], "need 0 < --lr-min <= --lr-max"),
        (["--num-workers", "1-2"], "(elastic) is for jobs/train.py"),
    ):
        assert ray_ddp.sweep(seed_port.main, argv) == 2, argv
        assert line in capsys.readouterr().err, argv


# An own loop's sweep script: ``jobs/tune.py`` for seed_port.py's loop.
OWN_SWEEP = (
    "import sys\n"
    "import ray_ddp\n"
    "from examples.own_loop import seed_port\n"
    "sys.exit(ray_ddp.sweep(seed_port.main, sys.argv[1:], best_metric='acc', best_mode='max'))"
)


@pytest.mark.ray
def test_an_own_loops_sweep_runs_every_trial_with_its_lr_and_batch(ray_session, storage):
    """``ray_ddp.sweep`` (issue 45): 2 trials of ``examples/own_loop/seed_port.py``'s loop,
    1 epoch on 1 worker each, both at once on the 2 CPUs (2 fits). Each trial's loop built
    its Adam from ``run.config.optim.lr`` and split its data by
    ``run.config.optim.batch_size``: its checkpoint's optimizer holds the trial's lr and
    its position the steps of the trial's batch. The summary names the best trial.

    A process of its own that joins the shared Ray, as jobs/tune.py is run: Tune ends a
    trial at its last report, and the trial's Train placement group is released when
    the sweep's driver ends (measured in-process: still held 30 s after the sweep)."""
    address = ray_session.get_runtime_context().gcs_address
    path = os.path.join(storage, "own.json")
    argv = ["--address", address, "--storage-path", storage, "--name", "own",
            "--num-samples", "2", "--epochs", "1", "--lr-min", "1e-3", "--lr-max", "1e-1",
            "--batch-sizes", "8,16", "--train-samples", "96", "--val-samples", "40",
            "--num-workers", "1", "--cpus-per-worker", "0.9", "--summary-json", path]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", OWN_SWEEP, *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    print(f"own loop's 2-trial sweep: {time.perf_counter() - started:.0f} s")
    with open(path) as file:
        summary = json.load(file)
    trials = summary["trials"]
    assert len(trials) == 2 and trials[0]["lr"] != trials[1]["lr"], trials
    assert summary["metric"] == "val_acc" and summary["mode"] == "max"
    for trial in trials:
        assert trial["status"] == "finished" and math.isfinite(trial["best_value"]), trial
        states = ray_ddp.load_state(trial["best_checkpoint"])
        assert states["optimizer"]["param_groups"][0]["lr"] == pytest.approx(trial["lr"])
        progress = load_checkpoint_state(trial["best_checkpoint"])["progress"]
        assert (progress["epoch"], progress["step"]) == (1, 96 // trial["batch_size"]), trial
    best = summary["best"]
    assert best["trial"] in {t["trial"] for t in trials}
    assert best["best_value"] == max(t["best_value"] for t in trials)


@pytest.mark.ray
def test_a_trial_too_large_for_the_cluster_fails_fast(ray_session, storage, capsys):
    started = time.perf_counter()
    code = tune_main(["--num-workers", "2", "--cpus-per-worker", "1", "--storage-path", storage])
    assert code == 2
    err = capsys.readouterr().err
    assert "one trial needs 2.1 CPUs" in err and "the cluster has 2 CPUs" in err
    assert time.perf_counter() - started < 30


def _sweep_cmd(address: str, storage: str, *extra: str) -> list[str]:
    # 2 workers x 0.9 CPU + 0.1 for the trial's driver: one trial at a time on 2 CPUs.
    return [
        sys.executable, os.path.join(ROOT, "jobs", "tune.py"), "--address", address,
        "--storage-path", storage, "--name", "sweep", "--num-samples", "4",
        "--lr-min", "1e-5", "--lr-max", "3e-2", "--batch-sizes", "32,64", "--grace-period", "1",
        "--reduction-factor", "2", "--epochs", "3", "--train-samples", "1000",
        "--val-samples", "301", "--num-workers", "2", "--cpus-per-worker", "0.9",
        "--model", "small_cnn", "--summary-json", os.path.join(storage, "sweep.json"), *extra,
    ]  # fmt: skip


def _until_the_cluster_is_free(ray, log_path: str, timeout: float = 180.0) -> None:
    """Once an interrupted sweep's driver has exited, wait until the shared Ray's CPUs are
    all free again, as a user told "try again later" would. A trial's workers are freed
    when their Train controller is gone, which Ray ends with the sweep's job; CI once
    found them still held a minute on (the resumed command, after its 30 s wait, said
    "other jobs hold the rest; try again later", and so did the next test's run)."""
    from ray.util import placement_group_table

    began, cpus = time.monotonic(), ray.cluster_resources()["CPU"]
    while (free := ray.available_resources().get("CPU", 0.0)) < cpus - 1e-6:
        if time.monotonic() - began > timeout:
            held = {pg: v["bundles"] for pg, v in placement_group_table().items()
                    if v["state"] != "REMOVED"}  # fmt: skip
            with open(log_path, errors="replace") as file:
                tail = file.read()[-3000:]
            pytest.fail(f"{free:g} of {cpus:g} CPUs free {timeout:.0f} s after the interrupted "
                        f"sweep exited; placement groups {held}; its output:\n{tail}")  # fmt: skip
        time.sleep(0.5)
    waited = time.monotonic() - began
    if waited > 5:
        print(f"the interrupted sweep's CPUs were freed {waited:.0f} s after it exited")


@pytest.mark.ray
def test_a_sweep_stops_weak_trials_resumes_after_ctrl_c_and_reports_the_best(
    ray_session, tracking_server, storage
):
    """One sweep of 4 trials, one at a time, with ASHA: Ctrl-C once the first trial has
    finished (the first at each rung, it runs all 3 epochs), then the same command with
    --resume runs the other three without running the first again; ASHA stops some of
    them early; the best trial's checkpoint loads like any training checkpoint. Tracked
    in MLflow (--tracking): one parent run for the sweep, continued by the resumed
    command, holding the search space, with each trial's run as its child."""
    address = ray_session.get_runtime_context().gcs_address
    train_dir = os.path.join(storage, "sweep", "train")
    tracked = ("--tracking", "mlflow", "--tracking-uri", tracking_server.uri,
               "--experiment", "sweeps")  # fmt: skip
    started = time.perf_counter()
    log_path = os.path.join(storage, "interrupted.log")
    log = open(log_path, "wb")  # noqa: SIM115 (closed below, after the process)
    proc = subprocess.Popen(
        _sweep_cmd(address, storage, *tracked), stdout=log, stderr=subprocess.STDOUT
    )
    try:
        # One trial at a time: a second trial's run directory means the first ended.
        deadline = time.time() + 240
        while time.time() < deadline:
            if os.path.isdir(train_dir) and len(os.listdir(train_dir)) >= 2:
                break
            assert proc.poll() is None, "the sweep ended before it could be interrupted"
            time.sleep(0.2)
        else:
            pytest.fail("the first trial did not finish in time")
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    _until_the_cluster_is_free(ray_session, log_path)
    first = sorted(os.listdir(train_dir))[0]
    first_checkpoints = sorted(os.listdir(os.path.join(train_dir, first)))

    resumed = subprocess.run(
        _sweep_cmd(address, storage, *tracked, "--resume"),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "MLflow" not in resumed.stderr, resumed.stderr[-2000:]  # no tracking warning
    print(f"4-trial sweep, interrupted and resumed: {time.perf_counter() - started:.0f} s")
    # The finished trial was not run again: its run directory is exactly as it was.
    assert sorted(os.listdir(os.path.join(train_dir, first))) == first_checkpoints
    assert f"[{first}] epoch" not in resumed.stdout

    with open(os.path.join(storage, "sweep.json")) as f:
        summary = json.load(f)
    trials = summary["trials"]
    assert len(trials) == 4
    stopped = [t for t in trials if t["status"] == "stopped early"]
    assert stopped and all(t["epochs_run"] < 3 for t in stopped), trials  # ASHA acted
    assert any(t["status"] == "finished" and t["epochs_run"] == 3 for t in trials)
    best = summary["best"]
    assert summary["metric"] == best["metric"] == "val_acc" and summary["mode"] == "max"
    assert best["best_value"] == max(t["best_value"] for t in trials)
    model = load_model(best["best_checkpoint"])  # loads like any training checkpoint
    assert isinstance(model, torch.nn.Module)
    with open(os.path.join(summary["sweep_dir"], "results.csv")) as f:
        rows = list(csv.DictReader(f))
    assert {r["trial"] for r in rows} == {t["trial"] for t in trials}
    assert {r["status"] for r in rows} >= {"stopped early", "finished"}
    with open(os.path.join(summary["sweep_dir"], "sweep.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    _assert_tracked(tracking_server.uri, summary)


def _assert_tracked(uri: str, summary: dict) -> None:
    """The sweep in MLflow: one parent run (the resumed command continued the one the
    first made), its search space as params and the best trial as a tag; every trial's
    run its child, with the trial's lr and batch as params, tagged and ended as Tune
    ended the trial (a trial ASHA stopped: KILLED)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("sweeps").experiment_id
    runs = client.search_runs([experiment])
    parents = [r for r in runs if r.info.run_name == "sweep"]
    assert len(parents) == 1, [r.info.run_name for r in runs]
    parent = parents[0]
    assert parent.data.params["num_samples"] == "4" and parent.data.params["lr_max"] == "0.03"
    assert parent.data.tags["ray_ddp.best_trial"] == summary["best"]["trial"]
    assert parent.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {"results.csv"}
    children = {r.info.run_name: r for r in runs if r.info.run_id != parent.info.run_id}
    trials = {t["trial"]: t for t in summary["trials"]}
    assert set(children) == set(trials)
    for name, run in children.items():
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert float(run.data.params["lr"]) == pytest.approx(trials[name]["lr"])
        assert run.data.params["batch_size"] == str(trials[name]["batch_size"])
        stopped = trials[name]["status"] == "stopped early"
        assert run.data.tags["ray_ddp.asha_stopped"] == str(stopped).lower()
        assert run.info.status == ("KILLED" if stopped else "FINISHED")
        epochs = client.get_metric_history(run.info.run_id, "val_acc")
        # (A stopped trial may train on a little while Tune stops it: its run shows it.)
        assert len(epochs) >= trials[name]["epochs_run"] >= 1
