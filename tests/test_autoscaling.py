"""A real autoscaling cluster on this machine: a head without the workers' resources, and
node types the autoscaler starts on request (Ray's fake multi-node provider: real raylets,
started by the real autoscaler). The driver asks for the workers' nodes, waits with progress lines,
trains, and withdraws the request; a wait that runs out, a request no node type can hold
and GPU workers without a count exit 2 with the figures.

Fake GPUs cannot run CUDA, so the nodes that train advertise a custom resource
(``trainer_slot``) and the workers ask for it with ``--resources-per-worker``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time

import pytest
from ports import free_port

from ray_ddp.driver.cli import train_main

pytestmark = [pytest.mark.ray, pytest.mark.own_cluster]

SLOT = {"CPU": 1, "trainer_slot": 1, "object_store_memory": 200 * 1024**2}
NODE_TYPES = {
    "slot": {"resources": SLOT, "node_config": {}, "min_workers": 0, "max_workers": 2},
    # Asked for only by the test whose wait runs out. Its nodes never start (an object store
    # below Ray's 75 MiB minimum fails the launch), as in a region out of capacity.
    "other": {
        "resources": {"CPU": 1, "other_slot": 1, "object_store_memory": 1024**2},
        "node_config": {},
        "min_workers": 0,
        "max_workers": 1,
    },
    # Never started: its presence makes "auto" mean GPU workers.
    "gpu": {
        "resources": {"CPU": 1, "GPU": 1}, "node_config": {}, "min_workers": 0, "max_workers": 1
    },
}  # fmt: skip
SMALL_RUN = [
    "--epochs", "1", "--train-samples", "512", "--val-samples", "101", "--batch-size", "64",
    "--no-export", "--no-tensorboard",
]  # fmt: skip


def _autoscaling_cluster_class():
    from ray.cluster_utils import AutoscalingCluster

    class LocalAutoscalingCluster(AutoscalingCluster):
        """``AutoscalingCluster`` as Ray 2.60 ships it cannot start: it reads an example
        config the wheel lacks. And its start and shutdown run ``ray stop --force``, which
        stops every Ray on the machine (another test run's too). This one writes the whole
        config and runs the head in this process (``cluster_utils.Cluster``); shutdown
        stops only what it started: the head, and the nodes its autoscaler launched."""

        def _generate_config(self, head_resources, worker_node_types, **_):
            return {
                "cluster_name": "fake-autoscaling",
                "max_workers": sum(t["max_workers"] for t in worker_node_types.values()),
                "upscaling_speed": 1.0,
                "idle_timeout_minutes": 1,
                "provider": {
                    "type": "fake_multinode",
                    "use_node_id_as_ip": True,
                    "disable_node_updaters": True,
                    "disable_launch_config_check": True,
                },
                "head_node_type": "ray.head.default",
                "available_node_types": {
                    "ray.head.default": {
                        "resources": dict(head_resources),
                        "node_config": {},
                        "max_workers": 0,
                    },
                    **worker_node_types,
                },
                "docker": {},
                "auth": {"ssh_user": "ubuntu"},
                "file_mounts": {},
                "cluster_synced_files": [],
                "file_mounts_sync_continuously": False,
                "initialization_commands": [],
                "setup_commands": [],
                "head_setup_commands": [],
                "worker_setup_commands": [],
                "head_start_ray_commands": [],
                "worker_start_ray_commands": [],
            }

        def start(self, tmp_dir: str) -> None:
            import ray
            from ray.cluster_utils import Cluster

            port = free_port()
            ip = ray.util.get_node_ip_address()
            # The fake provider starts nodes against this GCS (else it assumes port 6379).
            self._config["provider"]["gcs_address"] = f"{ip}:{port}"
            path = os.path.join(tmp_dir, "autoscaling.json")
            with open(path, "w") as f:
                json.dump(self._config, f)
            # The monitor (the autoscaler) inherits these when the head starts it.
            names = ("RAY_FAKE_CLUSTER", "AUTOSCALER_UPDATE_INTERVAL_S")
            saved = {name: os.environ.get(name) for name in names}
            os.environ.update(RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1")
            try:
                self.head = Cluster(
                    initialize_head=True,
                    head_node_args={
                        "num_cpus": self._head_resources.get("CPU", 0),
                        "autoscaling_config": path,
                        "gcs_server_port": port,
                        "dashboard_port": free_port(),
                    },
                )
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
            self.address = self.head.address

        def shutdown(self) -> None:
            import psutil  # after ray: Ray ships it

            from ray_ddp.compat.cluster_state import monitor_pid

            pid = monitor_pid(self.address)
            try:  # the nodes the autoscaler started are the monitor's children
                launched = psutil.Process(pid).children(recursive=True) if pid else []
            except psutil.NoSuchProcess:
                launched = []
            self.head.shutdown()
            for process in launched:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
            psutil.wait_procs(launched, timeout=10)

    return LocalAutoscalingCluster


@pytest.fixture(scope="module")
def cluster(no_shared_ray):
    import ray

    tmp_dir = tempfile.mkdtemp(prefix="ray_ddp_autoscaling_")
    # The head has CPUs but no trainer_slot: workers that land on it ignored their
    # --resources-per-worker.
    cluster = _autoscaling_cluster_class()({"CPU": 2}, NODE_TYPES)
    cluster.start(tmp_dir)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


class Stamped:
    """stdout that also keeps each line with its time since the start."""

    def __init__(self, stream):
        self.stream, self.started, self.lines, self._part = stream, time.monotonic(), [], ""

    def write(self, text: str) -> int:
        self._part += text
        *whole, self._part = self._part.split("\n")
        now = time.monotonic() - self.started
        self.lines += [(now, line) for line in whole]
        return self.stream.write(text)

    def __getattr__(self, name: str):  # isatty, fileno, encoding, ...
        return getattr(self.stream, name)

    def first(self, words: str) -> float:
        return next(t for t, line in self.lines if words in line)

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _nodes_of_type(resource: str) -> int:
    import ray

    return sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get(resource, 0) > 0)


def _standing_request(within_s: float = 10.0) -> list:
    """The autoscaler's standing request for nodes as its latest status reports it, once
    it is empty (or as it is after ``within_s``: the status is written every second)."""
    from ray_ddp.compat.cluster_state import autoscaler_status

    deadline = time.monotonic() + within_s
    while True:
        status = autoscaler_status()
        assert status is not None, "the autoscaler has not reported yet"
        demand = status["load_metrics_report"]["request_demand"]
        if not demand or time.monotonic() > deadline:
            return demand
        time.sleep(0.5)


def test_the_autoscaler_starts_the_workers_nodes_and_they_train(cluster, storage, monkeypatch):
    import ray

    from ray_ddp.cluster import resources as driver

    monkeypatch.setattr(driver, "PROGRESS_EVERY_S", 0.5)  # lines within the few seconds
    out = Stamped(sys.stdout)
    monkeypatch.setattr(sys, "stdout", out)
    argv = [
        "--address", cluster.address, "--no-gpu", "--num-workers", "2",
        "--resources-per-worker", '{"trainer_slot": 1}', "--wait-for-resources", "120",
        "--storage-path", storage, "--name", "autoscaled", "--summary-json",
        os.path.join(storage, "summary.json"), *SMALL_RUN,
    ]  # fmt: skip
    code = train_main(argv)
    done = time.monotonic() - out.started
    assert code == 0, out.text
    asked = out.first("asking the autoscaler for them")
    up = out.first("2 workers fit on the nodes up after")
    ranks = out.first("rank  local  node")
    epoch = out.first("epoch   1/1")
    print(
        f"\nautoscaling run: request at {asked:.1f} s, nodes up {up - asked:.1f} s later, "
        f"workers started {ranks - up:.1f} s later, first epoch {epoch - ranks:.1f} s later, "
        f"exit {done - epoch:.1f} s later ({done:.1f} s in all)",
        file=sys.__stdout__,
    )
    assert "2 workers x (1 CPU + 1 trainer_slot) do not fit on the nodes up: 0 of 2 fit" in out.text
    assert "waiting for 2 workers: " in out.text  # the progress line
    with open(os.path.join(storage, "summary.json")) as f:
        summary = json.load(f)
    assert summary["epochs_completed"] == 1 and summary["device"] == "cpu"
    # The workers ran on the nodes the autoscaler started for them, not on the head.
    head = next(n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"])
    assert head not in {r["node_id"] for r in summary["ranks"]}
    assert _nodes_of_type("trainer_slot") == 2
    # Ours and the Train controller's requests are withdrawn: the cluster may scale down.
    assert _standing_request() == []


def test_a_wait_that_runs_out_exits_2_with_the_figures(cluster, storage, capsys):
    started = time.monotonic()
    argv = [
        "--address", cluster.address, "--no-gpu", "--num-workers", "1",
        "--resources-per-worker", '{"other_slot": 1}', "--wait-for-resources", "3",
        "--storage-path", storage, *SMALL_RUN,
    ]  # fmt: skip
    assert train_main(argv) == 2
    assert time.monotonic() - started < 30
    err = capsys.readouterr().err
    assert err.startswith(
        "error: 1 worker x (1 CPU + 1 other_slot) do not fit on the nodes up: 0 of 1 fit ("
    ), err
    assert "; the autoscaler did not start them in 3 s: raise --wait-for-resources" in err
    assert len(err.strip().splitlines()) == 1
    assert _standing_request() == []  # withdrawn on the way out


def test_what_no_node_type_holds_is_refused_at_once(cluster, storage, capsys):
    started = time.monotonic()
    argv = [
        "--address", cluster.address, "--no-gpu", "--num-workers", "2",
        "--cpus-per-worker", "2", "--resources-per-worker", '{"trainer_slot": 1}',
        "--wait-for-resources", "120", "--storage-path", storage, *SMALL_RUN,
    ]  # fmt: skip
    assert train_main(argv) == 2
    assert time.monotonic() - started < 15  # not the 120 s wait
    assert capsys.readouterr().err.strip() == (
        "error: 2 workers x (2 CPUs + 1 trainer_slot) do not fit, counted node by node: no "
        "node holds one (largest: 1 CPU / 1 trainer_slot); lower --cpus-per-worker to 1"
    )


def test_gpu_node_types_make_auto_mean_gpu_workers(cluster, storage, capsys):
    """The autoscaler has a GPU node type and no GPU is up: auto is GPU workers, never a
    silent fall-back to CPU, and their count must be given."""
    argv = ["--address", cluster.address, "--storage-path", storage, *SMALL_RUN]
    assert train_main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        "error: GPU workers on a cluster with no GPUs up yet: give --num-workers N (one per "
        "GPU to start) and --wait-for-resources SECONDS to wait for the autoscaler's nodes "
        "(or --no-gpu)"
    )
    assert _nodes_of_type("GPU") == 0
