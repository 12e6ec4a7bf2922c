"""A spot reclaim announced ahead of time: a checkpoint at the next step boundary.

A cloud provider's reclaim notice (AWS gives two minutes) reaches Ray as a drain of the
node with the preemption reason and a deadline; Ray Train 2.60 fans it out to the workers
(``ray.train.get_preemption_info``). Without a look at it, a reclaimed node costs every
step since the last periodic checkpoint. :class:`PreemptionWatch` asks every
``--preemption-check-steps`` optimizer steps (Ray's call is a barrier across the workers,
so not every step), and on a new notice asks the step for a checkpoint there: training
goes on until the node goes, and the restart resumes from that step (counted under Ray's
own ``max_preemption_failures`` where the node goes at its deadline, the way a reclaimed
one does; one gone before its deadline died unexpectedly: ``--max-failures``)."""

from __future__ import annotations

import time
from collections.abc import Callable

import ray.train


def notices_supported() -> bool:
    """This Ray announces reclaims to the workers (Ray 2.60)."""
    return hasattr(ray.train, "get_preemption_info")


class PreemptionWatch:
    """Called at every optimizer-step boundary with the step just taken (on every rank,
    alike: the same steps ask Ray); True once per notice, where the checkpoint is due."""

    def __init__(self, every_steps: int, log: Callable[[str], None]) -> None:
        self.every = every_steps if notices_supported() else 0
        self.log = log
        self.seen: set[str] = set()
        self.asked = 0
        self.asking_s = 0.0
        """Calls made and the seconds they took (the cost, for benchmarks)."""

    def __call__(self, step: int) -> bool:
        if not self.every or step % self.every:
            return False
        started = time.perf_counter()
        info = ray.train.get_preemption_info()  # a barrier: every rank asks at this step
        self.asked += 1
        self.asking_s += time.perf_counter() - started
        if info is None or set(info.preempted_node_ids) <= self.seen:
            return False
        new = sorted(set(info.preempted_node_ids) - self.seen)
        self.seen |= set(new)
        left = (
            f"in {max(0.0, info.deadline_ms / 1000 - time.time()):.0f} s"
            if info.deadline_ms
            else "soon"
        )
        ranks = ", ".join(map(str, info.preempted_ranks))
        self.log(
            f"node {', '.join(n[:12] for n in new)} reclaimed {left} (ranks {ranks}): "
            f"checkpoint at step {step}"
        )
        return True
