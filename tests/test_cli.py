"""Bad input: exit code 2 and one actionable line, before any training starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from formats import write_imagefolder, write_parquet
from test_checkpoint import _write as write_checkpoint

from ray_ddp.cli import train_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bad_inputs(tmp: str) -> list[tuple[list[str], str]]:
    folder = os.path.join(tmp, "folder")
    write_imagefolder(folder)
    import shutil

    shutil.rmtree(os.path.join(folder, "val"))
    write_parquet(os.path.join(tmp, "pq"))
    write_checkpoint(os.path.join(tmp, "ckpt"))
    os.makedirs(os.path.join(tmp, "empty"))
    # A run started with another learning rate, and a run record that is not JSON.
    for name, text in (("earlier", '{"lr": 0.5, "model": "small_cnn"}'), ("garbled", "{nope")):
        os.makedirs(os.path.join(tmp, "kept", name))
        with open(os.path.join(tmp, "kept", name, "ray_ddp_config.json"), "w") as f:
            f.write(text)
    kept = ["--storage-path", os.path.join(tmp, "kept")]
    return [
        (["--lr", "0"], "--lr must be positive"),
        (["--lr", "-1"], "--lr must be positive"),
        (["--batch-size", "0"], "--batch-size must be positive"),
        (["--epochs", "0"], "--epochs must be positive"),
        (["--accum-steps", "-2"], "--accum-steps must be positive"),
        (["--num-workers", "0"], "--num-workers must be positive"),
        (["--dataset", "imagenet"], "unknown --dataset 'imagenet'"),
        (["--model", "resnet9000"], "unknown --model 'resnet9000'"),
        (["--amp", "fp16", "--no-gpu"], "--amp fp16 needs GPUs"),
        (["--amp", "fp16"], "--amp fp16 needs GPUs"),
        (["--amp", "int4"], "unknown --amp 'int4'"),
        (["--dataset", "cifar10"], "needs --data-dir"),
        (["--dataset", "cifar10", "--data-dir", os.path.join(tmp, "nope")], "does not exist"),
        (["--dataset", "mnist", "--data-dir", os.path.join(tmp, "empty")], "pass --download"),
        (["--dataset", "imagefolder", "--data-dir", folder], "val/ with one sub-folder per class"),
        (
            ["--dataset", "parquet", "--data-dir", os.path.join(tmp, "pq"), "--label-column", "y"],
            "has no column 'y'",
        ),
        (["--resume-from", os.path.join(tmp, "empty")], "is not a ray_ddp checkpoint"),
        (
            ["--resume-from", os.path.join(tmp, "ckpt"), "--model", "mlp"],
            "saved with model=small_cnn",
        ),
        (
            ["--num-workers", "2", "--train-samples", "100", "--batch-size", "64"],
            "larger than a worker's share",
        ),
        (["--name", "a/b"], "--name must be a plain directory name"),
        (["--dataset", "imagefolder", "--data-dir", os.path.join(tmp, "empty")], "train/ with"),
        (["--dataset", "parquet", "--data-dir", os.path.join(tmp, "empty")], "train.parquet or"),
        (
            ["--num-workers", "2", "--train-samples", "400", "--batch-size", "64"]
            + ["--accum-steps", "8"],
            "--accum-steps 8 is more than the 3 micro-batches",
        ),
        (["--checkpoint-every", "0"], "--checkpoint-every must be positive"),
        (["--wait-for-resources", "-5"], "--wait-for-resources must be zero or more"),
        (["--name", "earlier", *kept], "exists with another config (--lr 0.5 -> 0.003)"),
        (["--name", "garbled", *kept], "is not readable JSON"),
    ]


def test_bad_inputs_exit_2_with_one_line(tmp_path, capsys):
    cases = _bad_inputs(str(tmp_path))
    assert len(cases) >= 20
    for argv, message in cases:
        if "--storage-path" not in argv:
            argv = argv + ["--storage-path", str(tmp_path / "runs")]
        code = train_main(argv)
        err = capsys.readouterr().err.strip()
        assert code == 2, (argv, err)
        assert err.startswith("error: ") and message in err, (argv, err)
        assert "\n" not in err, (argv, err)
    assert not (tmp_path / "runs").exists(), "nothing was written for refused input"
    assert sorted(os.listdir(tmp_path / "kept" / "earlier")) == ["ray_ddp_config.json"]


@pytest.mark.ray
def test_requests_the_cluster_cannot_hold_exit_2(ray_session, tmp_path, capsys):
    for argv, message in [
        (["--num-workers", "3"], "3 workers x 1 CPUs = 3 CPUs asked, the Ray cluster has 2"),
        (["--use-gpu"], "the Ray cluster has no GPUs"),
        (["--cpus-per-worker", "1.5"], "2 workers x 1.5 CPUs = 3 CPUs asked"),
    ]:
        started = time.monotonic()
        assert train_main(argv + ["--storage-path", str(tmp_path)]) == 2
        assert time.monotonic() - started < 30  # not Ray's endless pending
        assert message in capsys.readouterr().err
    # An autoscaling cluster: told to wait, it says so, waits that long, then refuses.
    started = time.monotonic()
    argv = ["--num-workers", "3", "--wait-for-resources", "3", "--storage-path", str(tmp_path)]
    assert train_main(argv) == 2
    assert 3 <= time.monotonic() - started < 30
    out, err = capsys.readouterr()
    assert "waiting up to 3 s for nodes" in out and "3 CPUs asked" in err


def test_the_script_itself_exits_2_before_starting_ray():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "jobs", "train.py"), "--lr", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --lr must be positive, got -1.0"
    assert "Ray" not in proc.stdout + proc.stderr  # refused before any Ray start-up


def test_argparse_errors_also_exit_2():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "jobs", "train.py"), "--epochs", "three"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "invalid int value: 'three'" in proc.stderr
