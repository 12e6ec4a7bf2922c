"""Several nodes simulated on this machine (ray.cluster_utils.Cluster): workers on
different nodes, a node lost mid-run survived through --max-failures, and a request the
cluster's totals hold but its nodes do not refused at once."""

from __future__ import annotations

import json
import os
import time

import pytest
from background import BackgroundRun

from ray_ddp.cli import evaluate_main, train_main
from ray_ddp.config import TrainConfig
from ray_ddp.trainer import run_training

pytestmark = [pytest.mark.ray, pytest.mark.own_cluster]


@pytest.fixture(scope="module")
def cluster(no_shared_ray):
    """A head with 1 CPU and two worker nodes with 1 and 2 CPUs; the module's own Ray
    connection."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        nodes = [cluster.add_node(num_cpus=cpus) for cpus in (1, 2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_what_the_totals_hold_but_no_node_arrangement_does_is_refused(cluster, storage, capsys):
    """4 CPUs in all hold 2 workers x 1.5 CPUs, but only the 2-CPU node holds one."""
    started = time.monotonic()
    argv = ["--num-workers", "2", "--cpus-per-worker", "1.5", "--storage-path", storage]
    assert train_main(argv) == 2
    assert time.monotonic() - started < 15  # at once, not Ray's endless pending
    assert capsys.readouterr().err.strip() == (
        "error: 2 workers x (1.5 CPUs) do not fit, counted node by node: the nodes hold 1 "
        "(largest: 2 CPUs, fits 1); lower --num-workers to 1 or --cpus-per-worker to 1"
    )


def test_workers_spread_over_nodes_and_their_checkpoint_evaluates(cluster, storage, capsys):
    started = time.perf_counter()
    summary = run_training(
        TrainConfig(
            num_workers=2,
            placement_strategy="SPREAD",
            epochs=2,
            train_samples=1000,
            val_samples=101,
            storage_path=storage,
            name="spread",
        )
    )
    print(f"2-node run: {time.perf_counter() - started:.0f} s")
    assert len({r["node_id"] for r in summary["ranks"]}) == 2
    assert summary["epochs_completed"] == 2 and summary["final"]["evaluated_samples"] == 101

    # jobs/evaluate.py on that local checkpoint: on several nodes it is first copied to the
    # storage every node sees (a worker elsewhere may not have the driver's path).
    results = os.path.join(storage, "eval.json")
    argv = [summary["latest_checkpoint"], "--num-workers", "2", "--storage-path", storage,
            "--summary-json", results]  # fmt: skip
    assert evaluate_main(argv) == 0
    out = capsys.readouterr().out
    assert f"checkpoint {summary['latest_checkpoint']} copied to {storage}/eval-" in out
    with open(results) as f:
        evaluated = json.load(f)
    assert evaluated["checkpoint"].startswith(f"{storage}/eval-")
    assert evaluated["metrics"]["acc"] == summary["final"]["val_acc"]


def _checkpoints(run_dir: str) -> list[str]:
    if not os.path.isdir(run_dir):
        return []
    return [d for d in os.listdir(run_dir) if d.startswith("checkpoint_")]


def test_losing_a_node_resumes_from_the_last_checkpoint(cluster, storage):
    from ray.util.state import list_actors

    ray_cluster, nodes = cluster
    cfg = TrainConfig(
        num_workers=2,
        placement_strategy="SPREAD",
        max_failures=1,
        epochs=5,
        train_samples=8000,
        val_samples=301,
        storage_path=storage,
        name="survivor",
    )
    started = time.perf_counter()
    run = BackgroundRun(cfg)
    run_dir = os.path.join(storage, "survivor")
    deadline = time.time() + 180
    # Two checkpoints on disk, then past Ray's 2 s report polling: the first is surely
    # registered, so the restart has a checkpoint to resume from (a node lost within 2 s of
    # a report may restart from the checkpoint before it).
    while len(_checkpoints(run_dir)) < 2 and time.time() < deadline and run.running:
        time.sleep(0.5)
    assert len(_checkpoints(run_dir)) >= 2, run.error or "no checkpoints in time"
    time.sleep(3)
    workers = list_actors(
        address=ray_cluster.address,
        filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")],
    )
    worker_nodes = {a.node_id for a in workers}
    victim = next(n for n in nodes if n.node_id in worker_nodes)  # never the head
    ray_cluster.remove_node(victim)
    summary = run.finish(timeout=420)
    print(f"2-node run with a lost node: {time.perf_counter() - started:.0f} s")
    history = [m["epoch"] for m in summary["history"]]  # of the attempt that finished
    assert summary["epochs_completed"] == 5 and history[-1] == 5
    assert history[0] > 1, "the restarted workers began again from epoch 1"
    assert victim.node_id not in {r["node_id"] for r in summary["ranks"]}
