"""Workers counted onto nodes one by one, the lines that say so, the node types read from
an autoscaling config, --resources-per-worker, and the GPU rule and the refusals given a
cluster's figures: no Ray."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest

from ray_ddp.cluster.autoscaling import (
    UNLIMITED,
    types_from_launcher_config,
    types_from_node_groups,
)
from ray_ddp.cluster.placement import (
    Nodes,
    capacity,
    cpus_that_fit,
    fits_on,
    nodes_text,
    progress_line,
    unplaceable,
    worker_text,
)
from ray_ddp.cluster.resources import ClusterView, choose_workers, wait_for_nodes
from ray_ddp.compat.cluster_state import monitor_config_path
from ray_ddp.config.train import ConfigError, TrainConfig, parse_resources, validate

GPU_NODE = {"CPU": 48.0, "GPU": 4.0, "memory": 1e11}  # a g5.12xlarge
HEAD = {"CPU": 8.0, "memory": 3e10}


def test_a_node_holds_workers_by_its_scarcest_resource():
    assert fits_on({"CPU": 13, "GPU": 1}, GPU_NODE) == 3  # CPUs run out before GPUs
    assert fits_on({"CPU": 4, "GPU": 1}, GPU_NODE) == 4  # GPUs run out first
    assert fits_on({"CPU": 1, "GPU": 1}, HEAD) == 0  # no GPU at all
    assert fits_on({"CPU": 0.3}, {"CPU": 0.9}) == 3  # fractions, without rounding loss
    assert fits_on({"CPU": 1, "slot": 1}, {"CPU": 8}) == 0  # a custom resource it lacks


def test_capacity_counts_each_worker_whole_on_one_node():
    nodes = [Nodes(GPU_NODE), Nodes(HEAD)]
    # The issue's case: the totals (56 CPUs, 4 GPUs) hold 4 workers of 13 CPUs + 1 GPU,
    # the nodes only 3.
    assert capacity({"CPU": 13, "GPU": 1}, nodes) == 3
    assert capacity({"CPU": 3}, nodes) == 16 + 2
    # A node type started up to 4 times, with a cap of 3 nodes in all: best types first.
    types = [Nodes({"CPU": 1, "slot": 1}, 4), Nodes({"CPU": 2, "slot": 2}, 2)]
    assert capacity({"CPU": 1, "slot": 1}, types) == 4 + 4
    assert capacity({"CPU": 1, "slot": 1}, types, max_nodes=3) == 2 + 2 + 1


def test_the_issues_request_is_refused_with_per_node_figures():
    message = unplaceable({"CPU": 13, "GPU": 1}, 4, [GPU_NODE, HEAD])
    assert message == (
        "4 workers x (13 CPUs + 1 GPU) do not fit, counted node by node: the nodes hold 3 "
        "(largest: 48 CPUs / 4 GPUs, fits 3); lower --num-workers to 3 or --cpus-per-worker "
        "to 12"
    )
    assert unplaceable({"CPU": 12, "GPU": 1}, 4, [GPU_NODE, HEAD]) is None


def test_refusals_name_only_fixes_that_help():
    # GPUs are short, not CPUs: fewer CPUs per worker would not help.
    message = unplaceable({"CPU": 1, "GPU": 1}, 5, [GPU_NODE, HEAD])
    assert message.endswith("hold 4 (largest: 48 CPUs / 4 GPUs, fits 4); lower --num-workers to 4")
    # No node holds even one worker.
    message = unplaceable({"CPU": 16}, 2, [HEAD, {"CPU": 12.0}])
    assert "no node holds one (largest: 12 CPUs)" in message
    assert message.endswith("lower --cpus-per-worker to 8")  # one on each node
    assert cpus_that_fit({"CPU": 3}, 3, [Nodes({"CPU": 4}), Nodes({"CPU": 4})]) == 2
    # The largest node named is the one closest to holding a worker, not the most CPUs.
    message = unplaceable({"CPU": 2, "slot": 1}, 1, [{"CPU": 8}, {"CPU": 1, "slot": 1}])
    assert "(largest: 1 CPU / 1 slot); lower --cpus-per-worker to 1" in message


def test_node_types_an_autoscaler_may_start_count_too():
    slot = {"CPU": 1.0, "trainer_slot": 1.0}
    up = [{"CPU": 0.0}]  # a head that runs no workers
    assert unplaceable({"CPU": 1, "trainer_slot": 1}, 2, up, [Nodes(slot, 2)]) is None
    message = unplaceable({"CPU": 1, "trainer_slot": 1}, 3, up, [Nodes(slot, 2)])
    assert "the nodes up and those the autoscaler may start hold 2" in message
    message = unplaceable({"CPU": 2, "trainer_slot": 1}, 2, up, [Nodes(slot, 2)])
    assert "no node holds one (largest: 1 CPU / 1 trainer_slot)" in message
    # The cluster's cap on nodes counts: 2 types of 2, at most 2 nodes in all.
    types = [Nodes(slot, 2), Nodes(slot, 2)]
    assert unplaceable({"CPU": 1, "trainer_slot": 1}, 3, up, types, max_nodes=2) is not None


def test_the_lines_read_as_sentences():
    assert worker_text({"trainer_slot": 1, "GPU": 1, "CPU": 13}) == (
        "13 CPUs + 1 GPU + 1 trainer_slot"
    )
    assert worker_text({"CPU": 1}) == "1 CPU"
    bundle = {"CPU": 1, "trainer_slot": 1}
    assert nodes_text(bundle, [{"CPU": 0}, slot := {"CPU": 1, "trainer_slot": 1}, slot]) == (
        "2 x 1 CPU / 1 trainer_slot, 1 x 0 CPUs / 0 trainer_slot"
    )
    assert progress_line(4, 0, 118.4, use_gpu=True) == (
        "waiting for 4 GPU workers: 0/4 up, 118 s left"
    )
    assert progress_line(2, 3, 9.6, use_gpu=False) == "waiting for 2 workers: 2/2 up, 10 s left"
    assert progress_line(1, 0, 5, use_gpu=False) == "waiting for 1 worker: 0/1 up, 5 s left"


def test_node_types_come_from_the_launcher_config_the_head_runs():
    config = {
        "max_workers": 4,
        "head_node_type": "head_cpu",
        "available_node_types": {
            "head_cpu": {"resources": {"CPU": 8}, "max_workers": 0},
            "gpu_worker": {"resources": {"CPU": 48, "GPU": 4}, "min_workers": 0, "max_workers": 4},
            "spare": {"resources": {"CPU": 2}, "max_workers": 0},
            "any": {"resources": {"CPU": 2}},
        },
    }
    types, max_nodes = types_from_launcher_config(config)
    assert max_nodes == 4
    assert types == [Nodes({"CPU": 48.0, "GPU": 4.0}, 4), Nodes({"CPU": 2.0}, 4)]
    # Resources not filled in (a provider that learns them from a launched node): unknown.
    config["available_node_types"]["gpu_worker"]["resources"] = {}
    assert types_from_launcher_config(config) == (None, None)
    assert types_from_launcher_config({"provider": {}}) == (None, None)
    del config["max_workers"], config["available_node_types"]["gpu_worker"]
    assert types_from_launcher_config(config) == ([Nodes({"CPU": 2.0}, UNLIMITED)], None)


def test_node_types_come_from_a_cluster_config_published_in_the_gcs():
    from ray.core.generated import autoscaler_pb2

    config = autoscaler_pb2.ClusterConfig()
    for name, resources, max_count in [
        ("head", {"CPU": 8}, 0),
        ("gpu", {"CPU": 48, "GPU": 4}, 4),
        ("any", {"CPU": 2}, -1),
    ]:
        group = config.node_group_configs.add(name=name, max_count=max_count)
        group.resources.update(resources)
    assert types_from_node_groups(config.node_group_configs) == (
        [Nodes({"CPU": 48.0, "GPU": 4.0}, 4), Nodes({"CPU": 2.0}, UNLIMITED)],
        None,
    )


def test_the_autoscaling_config_is_found_from_the_monitors_command_line(tmp_path):
    """Real processes named like Ray's: the autoscaler's monitor is told apart from the log
    monitor, and matched by the GCS port whatever name the driver knows the head by."""
    for name in ("log_monitor.py", "monitor.py"):
        (tmp_path / name).write_text("import time\ntime.sleep(60)\n")
    port = 40000 + os.getpid() % 20000  # no real Ray here listens there
    config = str(tmp_path / "bootstrap.yaml")
    common = [f"--gcs-address=10.1.2.3:{port}", "--logs-dir=/tmp"]
    processes = [
        subprocess.Popen([sys.executable, "-u", str(tmp_path / "log_monitor.py"), *common]),
        subprocess.Popen(
            [
                sys.executable,
                "-u",
                str(tmp_path / "monitor.py"),
                *common,
                f"--autoscaling-config={config}",
            ]
        ),  # fmt: skip
    ]
    try:
        time.sleep(0.3)  # their command lines are readable once they run
        assert monitor_config_path(f"127.0.0.1:{port}") == config
        assert monitor_config_path(f"10.1.2.3:{port + 1}") is None
    finally:
        for process in processes:
            process.kill()
            process.wait()


def test_resources_per_worker_is_a_json_object_of_positive_amounts():
    assert parse_resources('{"trainer_slot": 1, "accelerator_type:A100": 0.001}') == {
        "trainer_slot": 1.0,
        "accelerator_type:A100": 0.001,
    }
    for text, words in [
        ("trainer_slot=1", "must be a JSON object of resource amounts"),
        ("{}", "must be a JSON object"),
        ('{"GPU": 1}', "give GPU with --use-gpu"),
        ('{"CPU": 2}', "give CPU with --cpus-per-worker"),
        ('{"slot": 0}', "slot must be a positive number, got 0"),
        ('{"slot": true}', "slot must be a positive number, got True"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            parse_resources(text)
    # The library's own callers are checked by validate, with the flag's name.
    with pytest.raises(ConfigError, match="^--resources-per-worker: slot must be a positive"):
        validate(TrainConfig(resources_per_worker={"slot": -1}))
    validate(TrainConfig(resources_per_worker={"slot": 1}))


# ---------------------------------------------------------------- the GPU rule (no Ray)
GPU_TYPES = [Nodes({"CPU": 48.0, "GPU": 4.0}, 4)]  # what cluster.yaml's head sees
CPU_TYPES = [Nodes({"CPU": 8.0}, 4)]


def _choose(view, capsys, address=None, **fields):
    cfg = TrainConfig(address=address, **fields)
    scaling = choose_workers(cfg.scaling, cfg.optim.amp, view)
    return (scaling.use_gpu, scaling.num_workers), capsys.readouterr().out.strip()


def test_auto_means_gpu_workers_where_gpus_are_up_or_can_be_started(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    up_gpus = ClusterView([HEAD, GPU_NODE])
    assert _choose(up_gpus, capsys, "ray://head") == ((True, 4), "")
    # None up, but the autoscaler has a GPU node type: GPU workers, whose count is needed.
    scaling = ClusterView([HEAD], GPU_TYPES, 4)
    assert _choose(scaling, capsys, num_workers=8) == ((True, 8), "")
    with pytest.raises(ConfigError, match="^GPU workers on a cluster with no GPUs up yet: give"):
        choose_workers(TrainConfig().scaling, "off", scaling)
    with pytest.raises(ConfigError, match="^GPU workers on a cluster with no GPUs up yet"):
        choose_workers(TrainConfig(use_gpu=True).scaling, "off", scaling)
    assert _choose(scaling, capsys, use_gpu=False) == ((False, 2), "")  # --no-gpu decides


def test_auto_without_gpus_is_cpu_and_says_so_on_a_cluster(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert _choose(ClusterView([HEAD]), capsys) == ((False, 2), "")  # a local Ray: quiet
    assert _choose(ClusterView([HEAD]), capsys, "auto") == (
        (False, 2),
        "CPU workers: the Ray cluster has no GPUs up and no autoscaler's node types are "
        "visible from here; --use-gpu --num-workers N --wait-for-resources SECONDS asks an "
        "autoscaler for GPU nodes, --no-gpu silences this line",
    )
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")  # inside `ray job submit`
    assert _choose(ClusterView([HEAD], CPU_TYPES), capsys) == (
        (False, 2),
        "CPU workers: the Ray cluster has no GPUs and none of its autoscaler's node types has one",
    )


def test_use_gpu_without_gpus_says_how_to_get_them(capsys):
    with pytest.raises(ConfigError) as info:
        choose_workers(TrainConfig(use_gpu=True).scaling, "off", ClusterView([HEAD]))
    assert str(info.value) == (
        "--use-gpu was given but the Ray cluster has no GPUs; use --no-gpu, or give "
        "--num-workers N and --wait-for-resources SECONDS to ask an autoscaling cluster for "
        "GPU nodes"
    )
    with pytest.raises(ConfigError, match="nor a node type its autoscaler may start"):
        choose_workers(TrainConfig(use_gpu=True).scaling, "off", ClusterView([HEAD], CPU_TYPES))
    with pytest.raises(ConfigError, match="^--amp fp16 needs GPU workers"):
        choose_workers(TrainConfig().scaling, "fp16", ClusterView([HEAD]))


def _refusal(view, **fields) -> str:
    cfg = TrainConfig(**fields)
    with pytest.raises(ConfigError) as info:
        wait_for_nodes(cfg.scaling, view)  # refused before any Ray call
    return str(info.value)


def test_without_waiting_a_request_is_refused_with_the_figures():
    # Static cluster (no autoscaler seen): the totals' figures first, then node by node.
    static = ClusterView([HEAD, {"CPU": 4.0}])
    assert _refusal(static, num_workers=5, cpus_per_worker=3.0).startswith(
        "5 workers x 3 CPUs = 15 CPUs asked, the Ray cluster has 12; lower --num-workers"
    )
    assert _refusal(static, num_workers=2, cpus_per_worker=5.0) == (
        "2 workers x (5 CPUs) do not fit, counted node by node: the nodes hold 1 (largest: "
        "8 CPUs, fits 1); lower --num-workers to 1 or --cpus-per-worker to 4"
    )
    assert _refusal(static, num_workers=2, resources_per_worker={"slot": 1.0}) == (
        "2 workers x 1 slot = 2 slot asked, the Ray cluster has 0; lower --num-workers or "
        "--resources-per-worker"
    )
    # An autoscaler whose node types hold it: the nodes up, and how to wait for more.
    scaling = ClusterView([HEAD], GPU_TYPES, 4)
    assert _refusal(scaling, num_workers=8, use_gpu=True) == (
        "8 workers x (1 CPU + 1 GPU) do not fit on the nodes up: 0 of 8 fit (1 x 8 CPUs / "
        "0 GPUs); the cluster's autoscaler can add nodes: --wait-for-resources SECONDS asks "
        "it for them and waits"
    )
    # ... and what its node types can never hold is refused even with a wait.
    assert _refusal(
        scaling, num_workers=4, use_gpu=True, cpus_per_worker=49.0, wait_for_resources=900
    ) == (
        "4 workers x (49 CPUs + 1 GPU) do not fit, counted node by node: no node holds one "
        "(largest: 48 CPUs / 4 GPUs); lower --cpus-per-worker to 48"
    )
