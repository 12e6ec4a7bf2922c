"""Where identical workers fit, counted node by node: pure functions, no Ray.

Ray places each worker (one bundle of CPUs, maybe a GPU, maybe custom resources) whole on
one node. Cluster-wide totals can hold a request that no node's share can: 4 workers of
13 CPUs + 1 GPU fit the totals of a 48-CPU/4-GPU node plus an 8-CPU head, but only 3 fit
on the nodes. The driver reads the nodes (and the node types an autoscaler may start) and
these functions say how many workers they hold and, when too few, what to change.

All workers of a run ask for the same bundle, so filling the nodes one by one is exact:
a node holds ``floor(its amount / the worker's amount)`` workers for its scarcest resource,
and a node type the autoscaler may start ``count`` times holds that many times as much.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

EPS = 1e-9
PLURAL = ("CPU", "GPU")  # resource names read as nouns: "2 CPUs"; custom names stay as given


@dataclass(frozen=True)
class Nodes:
    """``count`` nodes of one shape: a node that is up (count 1), or a node type an
    autoscaler may start up to ``count`` times."""

    resources: Mapping[str, float]
    count: int = 1


def fits_on(bundle: Mapping[str, float], resources: Mapping[str, float]) -> int:
    """How many workers of ``bundle`` one node with ``resources`` holds."""
    asked = {name: amount for name, amount in bundle.items() if amount > 0}
    if not asked:
        raise ValueError("a worker asks for no resources")
    return min(int(resources.get(name, 0.0) / amount + EPS) for name, amount in asked.items())


def capacity(
    bundle: Mapping[str, float], nodes: Iterable[Nodes], max_nodes: int | None = None
) -> int:
    """Workers of ``bundle`` the ``nodes`` hold, each worker whole on one node. With
    ``max_nodes``, at most that many nodes in all are counted, those holding most first
    (an autoscaler's cap on the nodes it starts)."""
    held = sorted(((fits_on(bundle, n.resources), n.count) for n in nodes), reverse=True)
    total, left = 0, max_nodes
    for fits, count in held:
        if left is not None:
            count = min(count, left)
            left -= count
        total += fits * count
    return total


def amount(value: float, name: str) -> str:
    """``2 CPUs``, ``1 GPU``, ``0.5 trainer_slot``."""
    plural = "s" if name in PLURAL and value != 1 else ""
    return f"{value:g} {name}{plural}"


def worker_text(bundle: Mapping[str, float]) -> str:
    """One worker's resources: ``13 CPUs + 1 GPU``."""
    return " + ".join(amount(value, name) for name, value in _ordered(bundle))


def node_text(bundle: Mapping[str, float], resources: Mapping[str, float]) -> str:
    """A node's amounts of the resources a worker asks for: ``48 CPUs / 4 GPUs``."""
    return " / ".join(amount(resources.get(name, 0.0), name) for name, _ in _ordered(bundle))


def _ordered(bundle: Mapping[str, float]) -> list[tuple[str, float]]:
    """CPU, GPU, then custom resources by name."""
    rank = {name: i for i, name in enumerate(PLURAL)}
    return sorted(bundle.items(), key=lambda kv: (rank.get(kv[0], len(PLURAL)), kv[0]))


def nodes_text(bundle: Mapping[str, float], up: Sequence[Mapping[str, float]]) -> str:
    """The nodes up by shape, most common first: ``2 x 1 CPU / 1 slot, 1 x 0 CPUs / 0 slot``."""
    shapes = Counter(node_text(bundle, node) for node in up)
    return ", ".join(f"{count} x {shape}" for shape, count in shapes.most_common()) or "no nodes"


def workers_text(n: int, use_gpu: bool = False) -> str:
    """``4 GPU workers``, ``1 worker``."""
    return f"{n} {'GPU ' if use_gpu else ''}worker{'s' if n != 1 else ''}"


def progress_line(n: int, up: int, left_s: float, use_gpu: bool) -> str:
    """The line the driver prints while it waits for the workers' nodes."""
    return f"waiting for {workers_text(n, use_gpu)}: {min(up, n)}/{n} up, {left_s:.0f} s left"


def _closest(bundle: Mapping[str, float], resources: Mapping[str, float]) -> tuple:
    """Which node to name as the largest: the one holding most workers, then the one with
    more of the kinds of resource a worker asks for, then the one with most CPUs."""
    kinds = sum(1 for name in bundle if resources.get(name, 0) > 0)
    return fits_on(bundle, resources), kinds, resources.get("CPU", 0)


def held(
    bundle: Mapping[str, float],
    up: list[Nodes],
    types: list[Nodes] | None = None,
    max_nodes: int | None = None,
) -> int:
    """Workers the nodes ``up`` hold, plus those the node ``types`` an autoscaler may start
    would hold (at most ``max_nodes`` new nodes)."""
    return capacity(bundle, up) + (capacity(bundle, types, max_nodes) if types else 0)


def cpus_that_fit(
    bundle: Mapping[str, float],
    n: int,
    up: list[Nodes],
    types: list[Nodes] | None = None,
    max_nodes: int | None = None,
) -> float | None:
    """The largest CPUs per worker (below the bundle's, to 2 decimals) at which ``n``
    workers fit; None if fewer CPUs would not help (GPUs or other resources are short)."""
    cpus = bundle.get("CPU", 0.0)
    candidates = {
        math.floor(node.resources.get("CPU", 0.0) / k * 100) / 100
        for node in [*up, *(types or [])]
        for k in range(1, n + 1)
    }
    for candidate in sorted((c for c in candidates if 0 < c < cpus), reverse=True):
        if held({**bundle, "CPU": candidate}, up, types, max_nodes) >= n:
            return candidate
    return None


def unplaceable(
    bundle: Mapping[str, float],
    n: int,
    up: Sequence[Mapping[str, float]],
    types: list[Nodes] | None = None,
    max_nodes: int | None = None,
) -> str | None:
    """Why ``n`` workers of ``bundle`` can never be placed on the nodes ``up`` plus the
    node ``types`` an autoscaler may start (at most ``max_nodes`` new nodes), as one line
    with the per-node figures; None if some arrangement holds them."""
    nodes = [Nodes(resources) for resources in up]
    most = held(bundle, nodes, types, max_nodes)
    if most >= n:
        return None
    shapes = [*nodes, *(types or [])]
    best = max(shapes, key=lambda shape: _closest(bundle, shape.resources))
    best_fits = fits_on(bundle, best.resources)
    where = "the nodes up and those the autoscaler may start" if types else "the nodes"
    if most == 0:
        figures = f"no node holds one (largest: {node_text(bundle, best.resources)})"
    else:
        figures = (
            f"{where} hold {most} (largest: {node_text(bundle, best.resources)}, fits {best_fits})"
        )
    fixes = [f"--num-workers to {most}"] if most else []
    cpus = cpus_that_fit(bundle, n, nodes, types, max_nodes)
    if cpus is not None:
        fixes.append(f"--cpus-per-worker to {cpus:g}")
    fix = f"; lower {' or '.join(fixes)}" if fixes else ""
    what = f"{workers_text(n)} x ({worker_text(bundle)})"
    return f"{what} do not fit, counted node by node: {figures}{fix}"
