"""Where the workers can go: the nodes up and the node types an autoscaler may start,
the worker count and the GPU rule, and waiting (a bounded time) for the nodes of a request,
then for what is free on them. Ray itself would leave an unplaceable request pending
forever; here the workers are counted onto the nodes one by one (``placement``): a request
no node arrangement can hold fails at once, one that needs more nodes fails at once too
unless ``--wait-for-resources`` allows time, during which the cluster's autoscaler
(``autoscaling``) is asked for the workers' nodes, and one that fits the nodes but not what
is free now waits a bounded time."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass

from ray_ddp.cluster.autoscaling import autoscaler_node_types
from ray_ddp.cluster.placement import (
    Nodes,
    capacity,
    nodes_text,
    progress_line,
    unplaceable,
    worker_text,
    workers_text,
)
from ray_ddp.compat.autoscaler import asking_for
from ray_ddp.compat.cluster_state import free_resources_per_node
from ray_ddp.config import ConfigError
from ray_ddp.config.sections import Scaling

DEFAULT_CPU_WORKERS = 2
RESOURCE_POLL_S = 2.0
FREE_POLL_S = 0.1
"""How often the driver looks again while resources it fits in are held: usually by the
placement group of a run that has just ended, released within a second (polling every
2 s cost each run started right after another 1 s on average)."""
PROGRESS_EVERY_S = 10.0  # a waiting driver's progress lines, not one per poll
# A request for nodes outlives the wait by this much only if the driver dies (it is
# withdrawn when the wait ends); by then the Train controller has made its own.
REQUEST_GRACE_S = 60.0


def worker_resources(scaling: Scaling) -> dict[str, float]:
    """One worker's resources for Ray Train's ``ScalingConfig(resources_per_worker=...)``:
    its CPUs and the extra resources asked for (the GPU comes from ``use_gpu``)."""
    return {"CPU": scaling.cpus_per_worker, **(scaling.resources_per_worker or {})}


def worker_bundle(scaling: Scaling) -> dict[str, float]:
    """Everything one worker holds on its node, the GPU included."""
    return {**worker_resources(scaling), **({"GPU": 1.0} if scaling.use_gpu else {})}


@dataclass(frozen=True)
class ClusterView:
    """What the driver knows about where workers can go."""

    up: list[dict[str, float]]
    """The total resources of each node that is up."""
    node_types: list[Nodes] | None = None
    """The node shapes the cluster's autoscaler may start and how many of each; None when
    no autoscaler's node types are visible from here (there may be none)."""
    max_nodes: int | None = None
    """The autoscaler's cap on worker nodes, when known."""

    def total(self, name: str) -> float:
        return sum(node.get(name, 0.0) for node in self.up)

    @property
    def gpu_types(self) -> bool:
        """The autoscaler is known to have a node type with GPUs."""
        return any(t.resources.get("GPU", 0) > 0 for t in self.node_types or [])


def read_cluster() -> ClusterView:
    """The nodes up, and the node types an autoscaler may add (when visible)."""
    types, max_nodes = autoscaler_node_types()
    return ClusterView(nodes_up(), types, max_nodes)


def nodes_up() -> list[dict[str, float]]:
    """The total resources of each node that is up."""
    import ray

    return [dict(node["Resources"]) for node in ray.nodes() if node["Alive"]]


def resolve_scaling(scaling: Scaling, amp: str) -> Scaling:
    """``scaling`` with num_workers and use_gpu filled in from the cluster (``amp``: the
    run's ``--amp``, which decides whether CPU workers can run it); refuses what cannot be
    placed, and waits (a bounded time) for the nodes of what can."""
    view = read_cluster()
    scaling = choose_workers(scaling, amp, view)
    # An elastic run needs its MIN workers to start; Ray Train starts it on as many as
    # fit, up to MAX, and asks an autoscaler for the rest.
    needed = dataclasses.replace(scaling, num_workers=scaling.worker_range[0])
    wait_for_nodes(needed, view)
    wait_until_free(needed)
    return scaling


def _joined_cluster(scaling: Scaling) -> bool:
    return bool(scaling.address or os.environ.get("RAY_ADDRESS"))


def choose_workers(scaling: Scaling, amp: str, view: ClusterView) -> Scaling:
    """The GPU rule and the worker count. ``--use-gpu``/``--no-gpu`` decide. Auto: GPU
    workers if GPUs are up or the cluster's autoscaler has a node type with GPUs; else CPU
    workers, said in one line on a cluster joined by address (never a silent CPU run
    where GPU nodes could be had). ``amp``: the run's ``--amp`` (fp16 needs GPUs)."""
    gpus = int(view.total("GPU"))
    use_gpu = scaling.use_gpu if scaling.use_gpu is not None else gpus > 0 or view.gpu_types
    if amp == "fp16" and not use_gpu:
        raise ConfigError("--amp fp16 needs GPU workers; use --amp bf16 or --amp off on CPU")
    if scaling.use_gpu is None and not use_gpu and _joined_cluster(scaling):
        print(f"CPU workers: {_why_no_gpus(view)}", flush=True)
    if not scaling.num_workers and use_gpu and gpus == 0:
        if view.gpu_types:  # GPU nodes can be had, but how many workers is not known
            raise ConfigError(
                "GPU workers on a cluster with no GPUs up yet: give --num-workers N (one per "
                "GPU to start) and --wait-for-resources SECONDS to wait for the autoscaler's "
                "nodes (or --no-gpu)"
            )
        raise ConfigError(_no_gpus(view, count_given=False))
    num_workers = scaling.num_workers or (gpus if use_gpu else DEFAULT_CPU_WORKERS)
    return dataclasses.replace(scaling, num_workers=num_workers, use_gpu=use_gpu)


def _why_no_gpus(view: ClusterView) -> str:
    if view.node_types is not None:
        return "the Ray cluster has no GPUs and none of its autoscaler's node types has one"
    return (
        "the Ray cluster has no GPUs up and no autoscaler's node types are visible from "
        "here; --use-gpu --num-workers N --wait-for-resources SECONDS asks an autoscaler "
        "for GPU nodes, --no-gpu silences this line"
    )


def _no_gpus(view: ClusterView, count_given: bool = True) -> str:
    if view.node_types is not None:  # an autoscaler without GPU node types
        return (
            "--use-gpu was given but the Ray cluster has no GPUs, nor a node type its "
            "autoscaler may start; drop it or use --no-gpu"
        )
    wait = "--wait-for-resources SECONDS" if count_given else (
        "--num-workers N and --wait-for-resources SECONDS"
    )  # fmt: skip
    return (
        "--use-gpu was given but the Ray cluster has no GPUs; use --no-gpu, or give "
        f"{wait} to ask an autoscaling cluster for GPU nodes"
    )


def wait_for_nodes(scaling: Scaling, view: ClusterView) -> None:
    """Return once the nodes up can hold the workers, counted node by node. A request no
    arrangement can hold (the nodes up, plus the node types the autoscaler may start,
    when known) is refused at once; otherwise, with ``--wait-for-resources``, the
    autoscaler is asked for one bundle per worker (``autoscaling.asking_for``: harmless
    where none runs) and the wait prints a progress line every ~10 s. The request is
    withdrawn however the wait ends, so the cluster can scale back down; the Train
    controller then asks for the same workers itself."""
    n, bundle = scaling.num_workers, worker_bundle(scaling)
    assert n is not None
    missing = _shortage(scaling, bundle, view)
    if missing is None:
        return
    known = view.node_types is not None  # an autoscaler whose node types we see
    if known:
        never = unplaceable(bundle, n, view.up, view.node_types, view.max_nodes)
        if never:
            raise ConfigError(never)
    if not scaling.wait_for_resources:
        hint = (
            "; the cluster's autoscaler can add nodes: --wait-for-resources SECONDS asks "
            "it for them and waits"
        )
        raise ConfigError(missing + (hint if known else ""))

    wait = f"{scaling.wait_for_resources:g} s"
    print(
        f"{missing}; asking the autoscaler for them; waiting up to {wait} for nodes"
        if known
        else f"{missing}; waiting up to {wait} for nodes (an autoscaler, if any, is asked)",
        flush=True,
    )
    started = time.monotonic()
    deadline, next_line = started + scaling.wait_for_resources, started + PROGRESS_EVERY_S
    with asking_for([bundle] * n, scaling.wait_for_resources + REQUEST_GRACE_S):
        while True:
            time.sleep(max(0.0, min(RESOURCE_POLL_S, deadline - time.monotonic())))
            view = dataclasses.replace(view, up=nodes_up())
            missing = _shortage(scaling, bundle, view)
            now = time.monotonic()
            if missing is None:
                fit = "fit" if n != 1 else "fits"
                print(f"{workers_text(n, bool(scaling.use_gpu))} {fit} on the nodes up after "
                      f"{now - started:.0f} s", flush=True)  # fmt: skip
                return
            if now >= deadline:
                late = "the autoscaler did not start them" if known else "not enough nodes joined"
                raise ConfigError(
                    f"{missing}; {late} in {wait}: raise --wait-for-resources, or see `ray status`"
                )
            if now >= next_line:
                up = capacity(bundle, [Nodes(node) for node in view.up])
                print(progress_line(n, up, deadline - now, bool(scaling.use_gpu)), flush=True)
                next_line += PROGRESS_EVERY_S


def _shortage(scaling: Scaling, bundle: dict[str, float], view: ClusterView) -> str | None:
    """What keeps the workers off the nodes up, as a message; None if they fit.

    On a cluster whose autoscaler's node types are known: node by node, with the figures
    of the nodes up. Otherwise the cluster's totals first (the clearest figures), then
    node by node."""
    n = scaling.num_workers
    assert n is not None
    fit = capacity(bundle, [Nodes(node) for node in view.up])
    if fit >= n:
        return None
    if view.node_types is not None:
        return (
            f"{workers_text(n)} x ({worker_text(bundle)}) do not fit on the nodes up: "
            f"{fit} of {n} fit ({nodes_text(bundle, view.up)})"
        )
    if scaling.use_gpu and view.total("GPU") == 0:
        return _no_gpus(view)
    for name, each in bundle.items():
        have = view.total(name)
        if n * each > have + 1e-9:
            return _total_short(scaling, name, each, have)
    return unplaceable(bundle, n, view.up)


def _total_short(scaling: Scaling, name: str, each: float, have: float) -> str:
    n = scaling.num_workers
    assert n is not None
    if name == "GPU":
        return f"{n} GPU workers asked, the Ray cluster has {have:g} GPUs; lower --num-workers"
    unit, flag = (
        ("CPUs", "--cpus-per-worker") if name == "CPU" else (name, "--resources-per-worker")
    )
    return (
        f"{n} workers x {each:g} {unit} = {n * each:g} {unit} asked, the Ray cluster has "
        f"{have:g}; lower --num-workers or {flag}"
    )


def wait_until_free(scaling: Scaling) -> None:
    """The nodes can hold the workers; wait (up to max(30 s, --wait-for-resources)) until
    what is free on them does, node by node: another job may hold some of it."""
    n, bundle = scaling.num_workers, worker_bundle(scaling)
    assert n is not None
    deadline = time.monotonic() + max(30.0, scaling.wait_for_resources)
    while (free := _free_capacity(bundle)) < n:
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"{workers_text(n)} x ({worker_text(bundle)}): {free} fit in what is free now on "
                "the nodes (other jobs hold the rest); try again later"
            )
        time.sleep(FREE_POLL_S)


def _free_capacity(bundle: dict[str, float]) -> int:
    return capacity(bundle, [Nodes(free) for free in free_resources_per_node()])


MIN_TASK_CPUS = 0.25
"""The least CPU share Ray Data's read-and-decode tasks (``--data-engine ray``) may run
with; with less left by the workers the run is refused (Ray Data would wait forever)."""


def data_task_cpus(scaling: Scaling, view: ClusterView | None = None) -> float:
    """The CPUs each of Ray Data's read-and-decode tasks asks for: 1, or what the workers
    leave of the cluster's CPUs where that is less. Refuses (ConfigError) a run whose
    workers leave less than ``MIN_TASK_CPUS``: Ray Data would wait for CPUs forever. On a
    cluster whose autoscaler can add nodes, says so and asks for 1."""
    if view is None:
        view = read_cluster()
    workers = scaling.num_workers or 0
    held = workers * scaling.cpus_per_worker
    left = view.total("CPU") - held
    if left >= 1:
        return 1.0
    if left >= MIN_TASK_CPUS:
        print(
            f"--data-engine ray: the workers leave {left:g} CPU for Ray Data's reading and "
            "decoding: training may wait for data (lower --cpus-per-worker to leave more)",
            flush=True,
        )
        return round(left, 2)
    total = view.total("CPU")
    if view.node_types:  # an autoscaler can add CPUs for Ray Data's tasks
        print(
            f"--data-engine ray: the workers hold {held:g} of the {total:g} CPUs up; Ray "
            "Data's tasks wait for the autoscaler to add CPUs",
            flush=True,
        )
        return 1.0
    each = math.floor((total - 1) / workers * 100) / 100 if workers else 0
    fix = f"--cpus-per-worker {each:g}" if each >= 0.01 else "fewer workers (--num-workers)"
    raise ConfigError(
        f"--data-engine ray reads and decodes in Ray tasks, which need CPUs the workers do "
        f"not hold: the cluster has {total:g} CPUs and {workers} workers x "
        f"{scaling.cpus_per_worker:g} take {held:g}; use {fix} to leave one for Ray Data, or "
        "add CPUs"
    )
