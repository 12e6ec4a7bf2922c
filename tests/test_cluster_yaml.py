"""cluster.yaml: Ray's own launcher schema accepts it, and its security and GPU settings hold.

No Ray cluster, no network, no AWS credentials: `prepare_config` only merges the AWS defaults
file shipped inside Ray, and `validate_config` checks against Ray's JSON schema. The AWS
bootstrap step of `ray up` (security group, subnets, IAM; boto3 + credentials) is not run.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import socket

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER_YAML = os.path.join(ROOT, "cluster.yaml")

# Ports that must never be reachable from the internet: dashboard / job API, Ray Client, GCS.
RAY_PORTS = (8265, 10001, 6379)
OPEN_CIDRS = ("0.0.0.0/0", "::/0")
# EC2 instance families with NVIDIA GPUs.
GPU_FAMILIES = ("g4dn", "g5", "g6", "g6e", "gr6", "p3", "p3dn", "p4d", "p4de", "p5", "p5e", "p5en")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """Any network connection or AWS credential lookup would make these checks flaky."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    for var in list(os.environ):
        if var.startswith("AWS_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)


def load() -> dict:
    with open(CLUSTER_YAML) as f:
        return yaml.safe_load(f)


def prepared(cfg: dict | None = None) -> dict:
    return prepare_config(copy.deepcopy(load() if cfg is None else cfg))


def worker_types(cfg: dict) -> dict:
    return {
        name: node
        for name, node in cfg["available_node_types"].items()
        if name != cfg["head_node_type"]
    }


# ---------------------------------------------------------------- schema


def test_shipped_config_passes_rays_schema():
    cfg = prepared()
    validate_config(cfg)
    assert cfg["provider"]["type"] == "aws"
    assert cfg["cluster_name"] == "ray-ddp"


def _unknown_top_level_key(cfg):
    cfg["dashboard_port"] = 8265


def _node_type_without_node_config(cfg):
    del worker_types(cfg)["gpu_worker"]["node_config"]


def _max_workers_as_string(cfg):
    worker_types(cfg)["gpu_worker"]["max_workers"] = "4"


def _resources_negative(cfg):
    worker_types(cfg)["gpu_worker"]["resources"] = {"GPU": -1}


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (_unknown_top_level_key, "Additional properties are not allowed ('dashboard_port'"),
        (_node_type_without_node_config, "'node_config' is a required property"),
        (_max_workers_as_string, "'4' is not of type 'integer'"),
        (_resources_negative, "-1 is less than the minimum of 0"),
    ],
)
def test_broken_copies_are_refused(break_it, message):
    cfg = load()
    break_it(cfg)
    cfg = prepared(cfg)  # the defaults merge does not catch these; the schema must
    with pytest.raises(jsonschema.ValidationError) as info:
        validate_config(cfg)
    assert message in info.value.message


# ---------------------------------------------------------------- security


def opens_ray_port_to_internet(rule: dict) -> bool:
    """True if an EC2 ingress rule admits any address to any of RAY_PORTS."""
    cidrs = [r.get("CidrIp") for r in rule.get("IpRanges", [])]
    cidrs += [r.get("CidrIpv6") for r in rule.get("Ipv6Ranges", [])]
    if not any(c in OPEN_CIDRS for c in cidrs):
        return False
    if str(rule.get("IpProtocol")) in ("-1", "all"):
        return True
    low, high = int(rule.get("FromPort", -1)), int(rule.get("ToPort", -1))
    if low == -1 and high == -1:  # -1 for tcp/udp means every port
        return True
    return any(low <= port <= high for port in RAY_PORTS)


@pytest.mark.parametrize(
    ("rule", "opens"),
    [
        ({"IpProtocol": "tcp", "FromPort": 8265, "ToPort": 8265,
          "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}, True),
        ({"IpProtocol": "tcp", "FromPort": 6000, "ToPort": 11000,
          "Ipv6Ranges": [{"CidrIpv6": "::/0"}]}, True),
        ({"IpProtocol": "-1", "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}, True),
        ({"IpProtocol": "tcp", "FromPort": 8265, "ToPort": 8265,
          "IpRanges": [{"CidrIp": "203.0.113.7/32"}]}, False),
        ({"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22,
          "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}, False),
    ],
)  # fmt: skip
def test_the_ingress_check_itself(rule, opens):
    assert opens_ray_port_to_internet(rule) is opens


def test_no_ingress_rule_opens_ray_ports_to_the_internet():
    cfg = prepared()
    rules = cfg["provider"].get("security_group", {}).get("IpPermissions", [])
    bad = [rule for rule in rules if opens_ray_port_to_internet(rule)]
    assert not bad, f"security group opens Ray ports to the internet: {bad}"


def _start_commands_export_token_mode(commands: list[str]) -> bool:
    """RAY_AUTH_MODE=token must be set in the same shell command as `ray start`."""
    starts = [c for c in commands if re.search(r"\bray start\b", c)]
    return bool(starts) and all(
        re.search(r"\bRAY_AUTH_MODE=token\b.*\bray start\b", c, re.S) for c in starts
    )


@pytest.mark.parametrize("key", ["head_start_ray_commands", "worker_start_ray_commands"])
def test_ray_starts_with_token_auth(key):
    assert _start_commands_export_token_mode(prepared()[key]), key


def test_token_is_mounted_not_written_into_the_file():
    cfg = prepared()
    assert cfg["file_mounts"].get("~/.ray/auth_token") == "~/.ray/auth_token"
    with open(CLUSTER_YAML) as f:
        text = f.read()
    assert not re.search(r"RAY_AUTH_TOKEN\s*=", text), "a token value must not be committed"
    assert not _start_commands_export_token_mode(["ray stop; ray start --head"])


def test_code_is_mounted_and_installed_on_every_node():
    cfg = prepared()
    assert cfg["file_mounts"].get("/home/ubuntu/ray_ddp") == "."
    for key in ("head_setup_commands", "worker_setup_commands"):
        assert any(re.search(r"pip install\b.*-e /home/ubuntu/ray_ddp\b", c) for c in cfg[key]), key


# ---------------------------------------------------------------- GPU workers


def test_gpu_worker_type_autoscales_on_a_gpu_instance():
    cfg = prepared()
    workers = worker_types(cfg)
    assert workers, "no worker node type"
    for name, node in workers.items():
        assert 0 <= node["min_workers"] <= node["max_workers"] <= cfg["max_workers"], name
        family = node["node_config"]["InstanceType"].split(".")[0]
        assert family in GPU_FAMILIES, f"{name}: {family} has no GPU"
        assert node["resources"].get("GPU", 1) > 0, name
    head = cfg["available_node_types"][cfg["head_node_type"]]
    assert head["max_workers"] == 0
    assert head["resources"].get("GPU", 0) == 0


# ---------------------------------------------------------------- the documented jobs

# What `ray up` fills into `resources: {}` from EC2 for the instance types used here.
EC2_SHAPES = {
    "m5.2xlarge": {"CPU": 8},
    "g5.12xlarge": {"CPU": 48, "GPU": 4, "accelerator_type:A10G": 1},
}


def _commands(text: str) -> list[list[str]]:
    """The argv after ``jobs/train.py`` or ``jobs/tune.py`` of each command in ``text``
    (shell lines continued with a backslash; YAML comment marks dropped)."""
    lines = [re.sub(r"^\s*#", "", line) for line in text.splitlines()]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    found = []
    for line in joined.splitlines():
        match = re.search(r"\bpython\s+\S*jobs/(train|tune)\.py\s+(.*)$", line)
        if match:
            found.append([f"{match.group(1)}.py", *shlex.split(match.group(2))])
    return found


def _documented_jobs() -> list[list[str]]:
    with open(CLUSTER_YAML) as f:
        jobs = _commands(f.read())
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("## Run on a cluster") :]
    block = section[section.index("```bash") : section.index("```\n", section.index("```bash") + 7)]
    return jobs + _commands(block)


def test_the_documented_jobs_ask_for_gpu_workers_the_gpu_nodes_can_hold():
    from ray_ddp.cluster.autoscaling import types_from_launcher_config
    from ray_ddp.cluster.placement import unplaceable
    from ray_ddp.cluster.resources import worker_bundle
    from ray_ddp.config import SweepConfig, TrainConfig, validate, validate_sweep
    from ray_ddp.config.flags import from_args
    from ray_ddp.driver.cli import train_parser, tune_parser

    cfg = prepared()
    for node in cfg["available_node_types"].values():
        node["resources"] = {**EC2_SHAPES[node["node_config"]["InstanceType"]], **node["resources"]}
    types, max_nodes = types_from_launcher_config(cfg)
    head = cfg["available_node_types"][cfg["head_node_type"]]["resources"]

    jobs = _documented_jobs()
    assert [job[0] for job in jobs] == ["train.py", "train.py", "tune.py"]
    for script, *argv in jobs:
        args = (train_parser() if script == "train.py" else tune_parser()).parse_args(argv)
        train = from_args(TrainConfig, args)
        validate(train)
        if script == "tune.py":
            validate_sweep(from_args(SweepConfig, args), train)
        # GPU workers, counted, and waited for: the GPU nodes start only when asked for.
        assert (
            train.scaling.use_gpu
            and train.scaling.num_workers
            and train.scaling.wait_for_resources >= 300
        ), argv
        problem = unplaceable(
            worker_bundle(train.scaling), train.scaling.num_workers, [head], types, max_nodes
        )
        assert problem is None, problem
    # And what the comments say is refused is.
    for too_much in ({"cpus_per_worker": 64.0}, {"num_workers": 17}):
        train = TrainConfig(
            **{"use_gpu": True, "num_workers": 4, "cpus_per_worker": 8.0, **too_much}
        )
        assert unplaceable(
            worker_bundle(train.scaling), train.scaling.num_workers, [head], types, max_nodes
        )
