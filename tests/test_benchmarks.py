"""The benchmark really runs: its smallest case (torchrun DDP and ray_ddp, a few steps)
end to end, and the GPU checks skip cleanly without a GPU and work in their CPU dry runs
(the GPU rehearsals). All of it is the slow tier (whole jobs as processes of their own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


@pytest.mark.own_cluster  # jobs/train.py starts its own local Ray, as a user's run does
def test_quick_benchmark_smallest_case(tmp_path, no_shared_ray):
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCH, "run.py"), "--quick", "--only", "torchrun,ray_ddp",
         "--steps", "20", "--val-samples", "64", "--out", str(out), "--timeout", "240"],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (out / "results.md").read_text()
    assert "| torchrun DDP script" in table and "| ray_ddp: jobs/train.py |" in table
    assert (out / "benchmark.png").stat().st_size > 0
    raw = json.loads((out / "raw.json").read_text())
    assert {r["case"] for r in raw["records"]} == {"torchrun", "ray_ddp"}
    for record in raw["records"]:
        for key in ("samples_per_s", "step_time_median_s", "time_to_first_step_s", "wall_s"):
            assert record[key] > 0, (record["case"], key, record[key])
        assert record["allreduces_per_step"] == pytest.approx(1.0), record
        assert record["time_to_first_step_s"] < record["wall_s"]


def test_gpu_check_skips_without_a_gpu_and_runs_dry_on_cpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: benchmarks/gpu.sh would measure for real")
    skip = subprocess.run(
        ["bash", os.path.join(BENCH, "gpu.sh"), "--out", str(tmp_path / "none.md")],
        env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert skip.returncode == 0, skip.stderr
    assert len(skip.stdout.strip().splitlines()) == 1 and "skipping" in skip.stdout
    assert not (tmp_path / "none.md").exists()

    out = tmp_path / "gpu.md"
    dry = subprocess.run(
        [sys.executable, os.path.join(BENCH, "gpu.py"), "--dry-run", "--precisions", "bf16",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert dry.returncode == 0, dry.stdout + dry.stderr
    table = out.read_text()
    assert "| bf16 | off | off |" in table and "| bf16 | on | off |" in table
    assert "error" not in table.lower() and "skipped" not in table


def test_gpu_path_check_runs_dry_on_cpu():
    """benchmarks/gpu_path.py runs ray_ddp's epoch function on a GPU; its CPU dry run keeps
    it honest here (DDP over gloo, off and bf16, accumulation, the NaN stop)."""
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCH, "gpu_path.py"), "--dry-run"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("gpu_path: all checks passed")
    assert "optimizer step 7 on rank 0" in proc.stdout


def test_the_gpu_check_under_ray_rehearses_on_cpu(tmp_path, ray_session):
    """benchmarks/gpu_ray.py --dry-run: every step the GPU call will take, tiny, on CPU; its
    jobs join the test's Ray (on the GPU machine they join the one the script starts)."""
    out = tmp_path / "gpu_ray"
    address = ray_session.get_runtime_context().gcs_address
    done = subprocess.run(
        [sys.executable, os.path.join(BENCH, "gpu_ray.py"), "--dry-run", "--out", str(out),
         "--address", address],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu_ray.json").read_text())
    (row,) = report["rows"]  # bf16, not compiled: the dry run's one case
    assert row["bare"] > 0 and row["torchrun"] > 0 and row["ray_ddp_samples_per_s"] > 0
    assert row["ray_ddp_flops_per_sample"] > 0 and row["ray_ddp_vs_bare"] > 0
    real = report["real_run"]
    assert real["stopped_exit"] == real["resumed_exit"] == real["evaluate_exit"] == 0
    assert real["resumed"].startswith("resumed from") and real["export"]
    assert (out / "gpu_ray.md").read_text().startswith("# GPU path under Ray")


def test_the_order_scale_benchmark_rehearses_its_smallest_sizes(tmp_path):
    """benchmarks/order_scale.py --quick: every order (today's, 41f20c4's randperm, the
    streamed one of today and of versions 1 and 2) at 1e4 and 1e5 samples, 8 and 1,024
    ranks, each in its own process: a table row each, and today's orders hold under 4 MB
    (the figures of 1e9 are its full run's, results/order_scale.md)."""
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCH, "order_scale.py"), "--quick", "--repeats", "1",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = json.loads((tmp_path / "order_scale_quick.json").read_text())["records"]
    assert {(r["kind"], r["size"], r["world"]) for r in records} == {
        (kind, size, world)
        for kind in ("keyed", "randperm", "streamed", "streamed-v2")
        for size in (10**4, 10**5)
        for world in (8, 1024)
    }
    keyed = [r for r in records if r["kind"] in ("keyed", "streamed")]
    assert all(r["memory_mb"] < 4 and r["first_batch_len"] == 64 for r in keyed), keyed
    assert (tmp_path / "order_scale_quick.md").read_text().count("| keyed |") == 4
