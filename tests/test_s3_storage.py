"""Runs on S3-compatible object storage, against a real S3 server on 127.0.0.1 (moto's
standalone server, one for the session: ``conftest.s3``; dummy credentials, nothing
leaves the machine).

The fast tests use the storage helpers, the run logs, the run record and the sweep's
refusal directly. The Ray tests train on ``s3://`` on the shared Ray, which is started
after the environment points at the server (Ray's workers inherit the environment of the
process that starts Ray): a run, its restart under the same name, ``--resume-from`` a
checkpoint URI, ``jobs/evaluate.py`` on one, a sweep, streamed Parquet shards.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os

import pytest
import s3server
import torch

from ray_ddp.checkpoint.format import CheckpointError
from ray_ddp.config import ConfigError, TrainConfig
from ray_ddp.io import storage
from ray_ddp.io.run_logs import METRICS_CSV, RunLogs, read_metrics

BUCKET = s3server.BUCKET  # on the session's S3 server (conftest.s3)


def _keys(uri: str) -> list[str]:
    """Every object under ``uri``, relative to it."""
    import pyarrow.fs

    fs, inner = storage.filesystem(uri)
    infos = fs.get_file_info(pyarrow.fs.FileSelector(inner, recursive=True, allow_not_found=True))
    return sorted(i.path[len(inner) + 1 :] for i in infos if i.type == pyarrow.fs.FileType.File)


# ------------------------------------------------------------------ no Ray
def test_join_and_full_uris_keep_the_scheme_and_the_options():
    base = "s3://b/runs?endpoint_override=127.0.0.1:9000&scheme=http"
    assert storage.join(base, "x", "metrics.csv") == (
        "s3://b/runs/x/metrics.csv?endpoint_override=127.0.0.1:9000&scheme=http"
    )
    assert storage.join("s3://b/runs/", "x") == "s3://b/runs/x"
    assert storage.join("/tmp/runs", "x", "y") == "/tmp/runs/x/y"
    # Ray's Result.path / Checkpoint.path: the filesystem path, scheme and options dropped.
    assert storage.uri_of(base, "b/runs/x/checkpoint_1") == (
        "s3://b/runs/x/checkpoint_1?endpoint_override=127.0.0.1:9000&scheme=http"
    )
    assert storage.uri_of("gs://b", "b/x") == "gs://b/x"
    assert storage.uri_of("/tmp/runs", "/tmp/runs/x") == "/tmp/runs/x"
    assert storage.uri_of("s3://b/runs", "elsewhere/x") == "elsewhere/x"


@pytest.mark.parametrize("options", [False, True], ids=["AWS_ENDPOINT_URL", "uri-options"])
def test_storage_helpers_against_the_s3_server(s3, tmp_path, monkeypatch, options):
    """Write, read, exists (file, prefix, marker, nothing), download and upload, with the
    endpoint from the environment or from the URI's own options alone."""
    root = f"s3://{BUCKET}/helpers-{options}"
    if options:
        monkeypatch.delenv("AWS_ENDPOINT_URL")
        root += f"?endpoint_override={s3}&scheme=http"
    target = storage.join(root, "a", "b.txt")
    assert storage.read_text(target) is None and not storage.exists(target)
    storage.write_bytes(target, b"one")
    storage.write_bytes(target, b"two")  # replaced whole
    assert storage.read_text(target) == "two" and storage.read_bytes(target) == b"two"
    assert storage.exists(target) and storage.exists(storage.join(root, "a"))  # a prefix
    assert not storage.exists(storage.join(root, "nothing"))
    fs, inner = storage.filesystem(storage.join(root, "marker"))
    fs.create_dir(inner)  # an empty "directory": a marker object
    assert storage.exists(storage.join(root, "marker"))

    (tmp_path / "ckpt" / "sub").mkdir(parents=True)
    (tmp_path / "ckpt" / "state.pt").write_bytes(b"x" * 1000)
    (tmp_path / "ckpt" / "sub" / "f").write_bytes(b"y")
    written = storage.upload_dir(str(tmp_path / "ckpt"), storage.join(root, "copy"))
    assert written == [storage.join(root, "copy", n) for n in ("state.pt", "sub/f")]
    assert _keys(storage.join(root, "copy")) == ["state.pt", "sub/f"]
    with storage.local_copy(storage.join(root, "copy")) as local:
        assert storage.read_bytes(os.path.join(local, "state.pt")) == b"x" * 1000
        assert storage.read_bytes(os.path.join(local, "sub", "f")) == b"y"
    assert not os.path.exists(local)  # the download is removed
    with storage.local_copy(storage.join(root, "missing")) as local:
        assert os.listdir(local) == []


def _metrics(epoch: int) -> dict:
    return {
        "epoch": epoch, "step": 10 * epoch, "train_loss": 1.0 / epoch, "val_loss": 1.5 / epoch,
        "val_acc": 0.1 * epoch, "lr": 0.001, "samples_per_s": 100.0, "epoch_s": 1.0,
        "speed_max_min": 1.0, "memory_max_min": 1.0, "peak_memory_mb": 10.0,
    }  # fmt: skip


def _run_logs_epochs(run_dir: str, epochs: range) -> None:
    logs = RunLogs(run_dir, tensorboard=True)
    per_rank = [{"rank": 0, "samples_per_s": 100.0, "peak_memory_mb": 10.0}]
    for epoch in epochs:
        logs.step(epoch * 10, 1.0 / epoch, 0.001)
        logs.epoch(_metrics(epoch), per_rank)
    logs.close()


@pytest.mark.parametrize("options", [False, True], ids=["AWS_ENDPOINT_URL", "uri-options"])
def test_a_restarted_run_keeps_every_metrics_row_and_earlier_event_files(s3, monkeypatch, options):
    """What a restart did (a fresh staging folder, possibly on another node): the
    history came back from S3 and every upload carried the whole of it."""
    run_dir = storage.join(f"s3://{BUCKET}/logs-{options}", "run")
    if options:
        monkeypatch.delenv("AWS_ENDPOINT_URL")
        run_dir += f"?endpoint_override={s3}&scheme=http"
    _run_logs_epochs(run_dir, range(1, 3))
    assert [r["epoch"] for r in read_metrics(storage.join(run_dir, METRICS_CSV))] == [1, 2]
    events = [k for k in _keys(run_dir) if k.startswith("tensorboard/")]
    first_events = {k: storage.read_bytes(storage.join(run_dir, k)) for k in events}
    assert len(first_events) == 1

    _run_logs_epochs(run_dir, range(2, 4))  # restarted from the epoch-1 checkpoint
    text = storage.read_text(storage.join(run_dir, METRICS_CSV))
    assert text.splitlines()[0].startswith("epoch,step,train_loss,val_loss,val_acc,lr")
    assert len(text.splitlines()) == 1 + 4  # header, epochs 1, 2, then 2 again and 3
    assert [r["epoch"] for r in read_metrics(storage.join(run_dir, METRICS_CSV))] == [1, 2, 3]
    events = [k for k in _keys(run_dir) if k.startswith("tensorboard/")]
    assert len(events) == 2  # one file per attempt
    for key, data in first_events.items():
        assert storage.read_bytes(storage.join(run_dir, key)) == data  # untouched
    png = storage.read_bytes(storage.join(run_dir, "curves.png"))
    assert png is not None and png.startswith(b"\x89PNG")


def test_run_record_on_s3_refuses_another_config(s3):
    from ray_ddp.driver.rerun_guard import check_rerun, record_path, write_record

    cfg = TrainConfig(storage_path=f"s3://{BUCKET}/records", name="run", lr=0.5)
    check_rerun(cfg)  # nothing recorded yet
    write_record(cfg)
    assert record_path(cfg.checkpointing) == f"s3://{BUCKET}/records/run/ray_ddp_config.json"
    assert json.loads(storage.read_text(record_path(cfg.checkpointing)))["lr"] == 0.5
    check_rerun(cfg.replace(epochs=20))  # extending it is fine
    with pytest.raises(ConfigError, match=r"exists with another config \(--lr 0.5 -> 0.1\)"):
        check_rerun(cfg.replace(lr=0.1))


@pytest.mark.parametrize("marker", ["object", "directory-marker"])
def test_a_sweep_under_an_existing_name_on_s3_is_refused(s3, capsys, marker):
    """A sweep "exists" on an object store when anything lies under its prefix (Tune's
    state, results.csv, a trial's checkpoint, or an empty directory marker): refused with
    one line, exit 2, before Ray or any trial starts, and nothing is written."""
    from ray_ddp.driver.cli import tune_main

    sweep_dir = f"s3://{BUCKET}/sweeps/old-{marker}"
    if marker == "object":
        storage.write_bytes(storage.join(sweep_dir, "results.csv"), b"trial\n")
    else:
        fs, inner = storage.filesystem(sweep_dir)
        fs.create_dir(inner)
    before = _keys(f"s3://{BUCKET}/sweeps")
    code = tune_main(
        ["--storage-path", f"s3://{BUCKET}/sweeps", "--name", f"old-{marker}",
         "--num-samples", "1", "--epochs", "1", "--train-samples", "200"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    assert err == (
        f"error: {sweep_dir} already exists: pass --resume to continue it, or a new --name\n"
    )
    assert _keys(f"s3://{BUCKET}/sweeps") == before


def _fake_checkpoint(directory) -> None:
    directory.mkdir(parents=True)
    torch.save({"format_version": 1, "marker": 7}, directory / "state.pt")


def test_resume_from_reads_a_checkpoint_uri(s3, tmp_path):
    from ray_ddp.checkpoint.format import load_checkpoint_state

    _fake_checkpoint(tmp_path / "ckpt")
    uri = f"s3://{BUCKET}/resume/run/checkpoint_1"
    storage.upload_dir(str(tmp_path / "ckpt"), uri)
    assert load_checkpoint_state(uri)["marker"] == 7
    missing = f"s3://{BUCKET}/resume/run/checkpoint_none"
    with pytest.raises(CheckpointError, match=f"^{missing} is not a ray_ddp checkpoint"):
        load_checkpoint_state(missing)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_remote_sharded_checkpoint_is_downloaded_once_and_kept_until_its_shards_are_read(
    s3, tmp_path, monkeypatch
):
    """A worker resuming from a checkpoint on S3 reads its state.pt from one download of
    its own; a sharded one's download is kept for the shards (every rank reads its
    slices) and removed by ``release``; a whole one's at once. A broken one names the URI."""
    import tempfile

    import ray.train
    import torch.distributed.checkpoint as dcp
    from torch import nn

    from ray_ddp.checkpoint.format import FORMAT_VERSION, SHARDS, write_state
    from ray_ddp.worker.resume import _open

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    # Ray's download takes a file lock in RAY_TMPDIR: a folder of the test's own (the
    # session's stays empty in the fast tier; conftest._no_ray_without_the_marker)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "ray"))
    (tmp_path / "tmp").mkdir()
    downloads = lambda: sorted(os.listdir(tmp_path / "tmp"))  # noqa: E731
    made, mkdtemp = [], tempfile.mkdtemp  # every download's folder, as it is made
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kw: made.append(mkdtemp(**kw)) or made[-1])
    sharded, whole = tmp_path / "sharded", tmp_path / "whole"
    dcp.save(
        {"model": nn.Linear(3, 2).state_dict()}, checkpoint_id=str(sharded / SHARDS), no_dist=True
    )
    write_state(str(sharded), {"format_version": FORMAT_VERSION, "sharded": "dcp"})
    _fake_checkpoint(whole)
    for directory in (sharded, whole):
        storage.upload_dir(str(directory), f"s3://{BUCKET}/shards/run/{directory.name}")

    def opened(name: str):
        fs, path = storage.filesystem(f"s3://{BUCKET}/shards/run/{name}")
        return _open(ray.train.Checkpoint(path, filesystem=fs), f"s3://{BUCKET}/shards/run/{name}")

    restored = opened("sharded")
    assert made == [restored.directory] and restored.temporary  # downloaded once
    assert downloads() == [os.path.basename(restored.directory)]
    assert {".metadata", "__0_0.distcp"} <= set(
        os.listdir(os.path.join(restored.directory, SHARDS))
    )
    restored.release()
    assert downloads() == []
    restored = opened("whole")
    assert restored.state["marker"] == 7 and restored.directory is None and downloads() == []
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "state.pt").write_bytes(b"truncated")
    storage.upload_dir(str(tmp_path / "broken"), f"s3://{BUCKET}/shards/run/broken")
    broken = f"s3://{BUCKET}/shards/run/broken/state.pt"
    with pytest.raises(CheckpointError, match=f"^cannot read {broken}: "):
        opened("broken")
    assert downloads() == []


def test_a_local_resume_from_is_shared_through_the_run_storage_on_a_cluster(s3, tmp_path):
    """On more than one node a worker may not see the driver's --resume-from path: it is
    copied into the run's storage, which every node sees. On one node it stays."""
    from ray_ddp.checkpoint.format import load_checkpoint_state
    from ray_ddp.driver.run import shared_resume_from

    _fake_checkpoint(tmp_path / "checkpoint_7")
    cfg = TrainConfig(resume_from=str(tmp_path / "checkpoint_7"))
    run_dir = f"s3://{BUCKET}/shared/run"
    assert shared_resume_from(cfg.checkpointing, run_dir, nodes=1) == cfg.checkpointing
    shared = shared_resume_from(cfg.checkpointing, run_dir, nodes=3).resume_from
    assert shared == f"{run_dir}/resume_from/checkpoint_7"
    assert load_checkpoint_state(shared)["marker"] == 7
    uri = cfg.replace(resume_from=shared)
    assert shared_resume_from(uri.checkpointing, run_dir, nodes=3) == uri.checkpointing  # shared


def test_predictions_are_written_to_a_uri(s3):
    import pyarrow.parquet as pq

    from ray_ddp.driver.evaluate import write_predictions

    uri = f"s3://{BUCKET}/eval/preds.parquet"
    write_predictions([(0, 1, 0.5), (1, 2, 0.25)], ["predicted", "confidence"], uri)
    table = pq.read_table(io.BytesIO(storage.read_bytes(uri))).to_pydict()
    assert table == {
        "index": [0, 1],
        "predicted": [1, 2],
        "confidence": [0.5, 0.25],
        "unreadable": [False, False],  # issue 27: a marker on every row
        "unreadable_error": [None, None],
    }


def test_fp16_is_not_refused_in_a_submitted_job(monkeypatch):
    """Inside ``ray job submit`` (RAY_ADDRESS set) the driver runs on the head, which may
    have no GPU while the cluster's workers do: the cluster decides, not this machine."""
    from ray_ddp.driver.preflight import preflight

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cfg = TrainConfig(amp="fp16", train_samples=200, val_samples=50)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="--amp fp16 needs GPUs"):
            preflight(cfg)
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    preflight(cfg)  # passes: the GPUs are checked once connected


# ------------------------------------------------------------------ real Ray
# ------------------------------------------------------------ runs on S3
# 960 rows in 4 shards of row groups of 40, streamed from the S3 server: 15 optimizer
# steps of 64 per epoch, a checkpoint every 5; the shuffle buffer spans a few groups.
STREAMED = dict(
    num_workers=2, dataset="parquet", epochs=2, batch_size=32, image_size=8, model="small_cnn",
    seed=3, checkpoint_every=5, shuffle_buffer=96, progress_interval_s=0,
)  # fmt: skip


@pytest.fixture(scope="module")
def s3_shards(s3, tmp_path_factory):
    """train/ and val/ folders of Parquet shards, uploaded to the S3 server."""
    from formats import write_parquet_shards

    local = tmp_path_factory.mktemp("shards")
    write_parquet_shards(str(local), train=960, val=101, shards=4, group_rows=40, size=8)
    storage.upload_dir(str(local), f"s3://{BUCKET}/data")
    return f"s3://{BUCKET}/data"


@pytest.fixture(scope="module")
def s3_runs(s3, ray_session, s3_shards):
    """Two runs of the same training, data and runs both on s3://: one straight through,
    and one whose rank 1 dies (os._exit) before optimizer step 23, after the checkpoint of
    step 20, inside epoch 2 (step 5 of 15), and which --max-failures restarts from there."""
    from ledgers import LEDGER

    from ray_ddp.driver.run import run_training
    from ray_ddp.testing.harness import Harness, Stall

    cfg = TrainConfig(
        **STREAMED, data_dir=s3_shards, storage_path=f"s3://{BUCKET}/runs", name="straight"
    )
    straight = run_training(cfg, harness=LEDGER)
    dies = Harness(stalls=(Stall(23, rank=1, exit=True),), sample_ledger=True)
    killed = run_training(cfg.replace(name="killed", max_failures=1), harness=dies)
    return cfg, straight, killed


@pytest.mark.ray
def test_a_run_on_s3_writes_everything_and_a_restart_keeps_the_history(s3_runs):
    cfg, straight, killed = s3_runs
    run_dir = f"s3://{BUCKET}/runs/straight"
    assert straight["run_dir"] == run_dir
    assert straight["best"]["checkpoint"].startswith(f"{run_dir}/checkpoint_")
    assert straight["latest_checkpoint"].startswith(f"{run_dir}/checkpoint_")
    assert straight["export"]["program"] == f"{run_dir}/export/model.pt2"
    keys = _keys(run_dir)
    assert {"metrics.csv", "curves.png", "ray_ddp_config.json"} <= set(keys)
    assert {"export/model.pt2", "export/model_state_dict.pt", "export/model.json"} <= set(keys)
    assert len([k for k in keys if k.startswith("tensorboard/events.out.tfevents.")]) == 1
    assert any(k.startswith("checkpoint_") and k.endswith("/state.pt") for k in keys)
    rows = read_metrics(storage.join(run_dir, METRICS_CSV))
    assert [r["val_acc"] for r in rows] == [m["val_acc"] for m in straight["history"]]
    meta = json.loads(storage.read_text(f"{run_dir}/export/model.json"))
    assert meta["source_checkpoint"] == straight["best"]["checkpoint"]

    # The killed run's restart (the same path a driver re-run takes to its logs): every
    # epoch's row, across both attempts, and the first attempt's event file kept.
    killed_dir = f"s3://{BUCKET}/runs/killed"
    assert storage.exists(f"{killed_dir}/stalled-step-23-rank-1")
    attempts = storage.read_text(f"{killed_dir}/attempts.csv").splitlines()
    assert len(attempts) == 3  # a header and two attempts
    assert [m["epoch"] for m in killed["history"]] == [2]  # of the attempt that finished
    rows = read_metrics(storage.join(killed_dir, METRICS_CSV))
    assert [r["epoch"] for r in rows] == [1, 2]
    events = [k for k in _keys(killed_dir) if k.startswith("tensorboard/events.out.tfevents.")]
    assert len(events) == 2


@pytest.mark.ray
def test_streamed_shards_on_s3_every_row_once_and_a_killed_run_resumes_to_the_bit(s3_runs):
    from ledgers import assert_every_sample_once, ledger

    from ray_ddp.checkpoint.format import load_state

    _, straight, killed = s3_runs
    for summary in (straight, killed):
        assert_every_sample_once(ledger(summary["run_dir"]), 960)
    assert ledger(straight["run_dir"]) == ledger(killed["run_dir"])
    with storage.local_copy(killed["latest_checkpoint"]) as local:
        weights = load_state(local)["model"]
    with storage.local_copy(straight["latest_checkpoint"]) as local:
        expected = load_state(local)["model"]
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    assert killed["history"][-1]["val_loss"] == straight["history"][-1]["val_loss"]


@pytest.mark.ray
def test_resume_from_a_checkpoint_uri_into_a_new_name_with_new_flags(s3, s3_runs, monkeypatch):
    """Fine-tuning from a 2-worker checkpoint (a URI) on 1 worker with another lr and weight
    decay, into a storage path that names its endpoint in the URI itself (as for MinIO or
    R2 without AWS_ENDPOINT_URL): the flags' values are used (not the checkpoint's), the
    schedule continues at 2 of 3 epochs at this world size, so it ends at its floor with
    epoch 3, and every path keeps the URI's options, workers' logs included."""
    from ray_ddp.checkpoint.format import load_model, load_state
    from ray_ddp.driver.run import run_training

    cfg, straight, _ = s3_runs
    options = f"?endpoint_override={s3}&scheme=http"
    summary = run_training(
        dataclasses.replace(
            cfg, storage_path=f"s3://{BUCKET}/runs{options}", name="branch", epochs=3,
            resume_from=straight["latest_checkpoint"], export=False, num_workers=1, lr=1e-4,
            weight_decay=0.05,
        )
    )  # fmt: skip
    assert [m["epoch"] for m in summary["history"]] == [3]
    assert summary["run_dir"] == f"s3://{BUCKET}/runs/branch{options}"
    assert summary["history"][-1]["lr"] == pytest.approx(1e-4 * cfg.optim.min_lr_ratio)
    rows = read_metrics(storage.join(summary["run_dir"], METRICS_CSV))
    assert [r["epoch"] for r in rows] == [3]  # the workers' logs reached that URI too
    with storage.local_copy(summary["latest_checkpoint"]) as local:
        state = load_state(local)
    assert state["progress"]["epoch"] == 3 and state["world_size"] == 1
    assert state["optimizer"]["param_groups"][0]["weight_decay"] == 0.05
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # the URI's options alone find the server
    assert isinstance(load_model(summary["latest_checkpoint"]), torch.nn.Module)


@pytest.mark.ray
def test_evaluate_a_checkpoint_uri(s3_runs, capsys):
    """jobs/evaluate.py s3://.../checkpoint_...: the run's own figures; results to S3."""
    from ray_ddp.driver.cli import evaluate_main

    _, straight, _ = s3_runs
    results_uri = f"s3://{BUCKET}/eval/results.json"
    code = evaluate_main(
        [straight["latest_checkpoint"], "--num-workers", "2", "--summary-json", results_uri]
    )
    assert code == 0, capsys.readouterr().err
    results = json.loads(storage.read_text(results_uri))
    assert results["checkpoint"] == straight["latest_checkpoint"]
    assert results["metrics"]["acc"] == straight["final"]["val_acc"]
    assert results["metrics"]["loss"] == pytest.approx(straight["final"]["val_loss"], rel=1e-5)
    assert results["sums"]["acc"][1] == 101
    assert results["held_bytes"] == [results["model_bytes"]] * 2  # a DDP checkpoint: whole


@pytest.mark.ray
def test_a_sweep_of_the_tabular_example_on_s3_ranks_by_mae_and_its_name_is_then_taken(
    s3, ray_session, capsys, tmp_path
):
    """Two trials of the worked example ``examples.tabular_regression`` at once (1 worker
    x 0.9 CPU + 0.1 for each trial's driver on 2 CPUs), ranked by validation MAE (the
    task's best_metric); Tune's state, the trials' checkpoints, results.csv and sweep.png
    land on S3 and the best checkpoint is a full URI; the same --name again is refused.
    The trials run under ``--strategy fsdp2``: a sweep of sharded runs, whose checkpoints
    (DCP's shards and index beside state.pt) go to S3 and load back from it."""
    from examples.make_tabular_data import write_friedman
    from examples.tabular_regression import TabularMLP
    from ray_ddp.checkpoint.format import load_model
    from ray_ddp.driver.cli import tune_main

    data = str(tmp_path / "friedman")
    write_friedman(data, train_rows=4000, val_rows=1000, noise=1.0, seed=0)
    argv = [
        "--task", "examples.tabular_regression:TabularRegression", "--data-dir", data,
        "--storage-path", f"s3://{BUCKET}/sweeps", "--name", "tabular", "--num-samples", "2",
        "--lr-min", "1e-3", "--lr-max", "3e-2", "--batch-sizes", "32,64", "--no-early-stop",
        "--epochs", "2", "--seed", "0", "--num-workers", "1", "--cpus-per-worker", "0.9",
        "--no-tensorboard", "--summary-json", f"s3://{BUCKET}/sweeps/tabular.json",
        "--strategy", "fsdp2",
    ]  # fmt: skip
    assert tune_main(argv) == 0, capsys.readouterr().err
    sweep_dir = f"s3://{BUCKET}/sweeps/tabular"
    keys = _keys(sweep_dir)
    assert {"results.csv", "sweep.png"} <= set(keys)
    assert any(k.startswith("experiment_state") for k in keys), keys  # Tune's own state
    summary = json.loads(storage.read_text(f"s3://{BUCKET}/sweeps/tabular.json"))
    assert summary["sweep_dir"] == sweep_dir and summary["concurrency"] == 2
    trials = summary["trials"]
    assert len(trials) == 2 and all(t["status"] == "finished" for t in trials), trials
    for t in trials:
        assert t["metric"] == "val_mae" and t["epochs_run"] == 2
        assert 0.7 < t["best_value"] < 3.0, t  # the noise floor: 0.80; the mean: ~4.2
        assert t["best_value"] == min(mae for _, mae in t["curve"])
    assert summary["best"]["best_value"] == min(t["best_value"] for t in trials)
    best = summary["best"]["best_checkpoint"]
    assert best.startswith(f"{sweep_dir}/train/") and "/checkpoint_" in best, best
    assert storage.exists(storage.join(best, "state.pt"))
    assert {"shards/.metadata", "shards/__0_0.distcp"} <= set(_keys(best))  # sharded, 1 rank
    assert best in storage.read_text(storage.join(sweep_dir, "results.csv"))
    assert isinstance(load_model(best), TabularMLP)
    capsys.readouterr()

    assert tune_main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err == f"error: {sweep_dir} already exists: pass --resume to continue it, or a new --name\n"
    )
    assert _keys(sweep_dir) == keys  # nothing overwritten
