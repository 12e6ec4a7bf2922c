"""A spot reclaim announced ahead of time: a checkpoint at the next step boundary, and the
last one just before the node goes.

A cloud provider's reclaim notice (AWS gives two minutes) reaches Ray as a drain of the
node with the preemption reason and a deadline; Ray Train 2.60 fans it out to the workers
(``ray.train.get_preemption_info``). Without a look at it, a reclaimed node costs every
step since the last periodic checkpoint. :class:`PreemptionWatch` asks every
``--preemption-check-steps`` optimizer steps (Ray's call is a barrier across the workers,
so not every step). On a new notice:

1. a checkpoint at that step boundary (insurance: the notice may come late);
2. training goes on while another step and a checkpoint fit before the deadline (rank 0
   decides at each boundary, from the step time and what the first checkpoint took, and
   every rank follows: one small collective a step, only until the deadline); then a
   checkpoint there (or none more where an epoch's own checkpoint came last);
3. after that checkpoint every rank holds: a step trained now would be lost with the
   node. The restart resumes from it, having redone nothing (at most the one step trained
   after the first checkpoint where there is no time for a second). If the node is still
   there ``HOLD_GRACE_S`` past its deadline (a drain cancelled), training goes on.

Ray counts the restart under its own ``max_preemption_failures`` where the node goes at
its deadline, the way a reclaimed one does; one gone before its deadline died
unexpectedly: ``--max-failures``."""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

import ray.train

from ray_ddp.worker.collectives import all_gather, is_distributed

HOLD_GRACE_S = 30.0
"""How long past the notice's deadline the held ranks wait for the node to go."""
MARGIN_S = 5.0
"""Kept free before the deadline beyond what the notice's checkpoint took to be written
and registered (a later one may wait longer for the controller's poll; a step may be
slower than the median). Held, not lost: a few steps' time once per reclaim."""
TRAIN_ON, CHECKPOINT_AND_HOLD, HOLD = 0, 1, 2


def notices_supported() -> bool:
    """This Ray announces reclaims to the workers (Ray 2.60)."""
    return hasattr(ray.train, "get_preemption_info")


def registered(timeout_s: float) -> bool:
    """Wait (``timeout_s`` at most) until Ray Train has registered every checkpoint this
    worker reported: True once it has (False where this Ray cannot say)."""
    wait = getattr(ray.train, "get_all_reported_checkpoints", None)
    if wait is None or timeout_s <= 0:
        return False
    try:
        wait(timeout_s=timeout_s)
    except Exception:  # noqa: BLE001 - a timeout, or a Ray without the argument
        return False
    return True


class PreemptionWatch:
    """Called at every optimizer-step boundary with the step just taken (on every rank,
    alike: the same steps ask Ray); True where a checkpoint is due for a notice: at the
    first boundary that sees it, and at the planned last one before its deadline."""

    def __init__(
        self,
        every_steps: int,
        log: Callable[[str], None],
        wait_upload: Callable[[], object] = lambda: None,
        holding: Callable[[], None] = lambda: None,
        registered: Callable[[float], bool] = registered,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.every = every_steps if notices_supported() else 0
        self.log = log
        self.wait_upload, self.holding, self.registered = wait_upload, holding, registered
        """What a hold waits for first (rank 0's checkpoint upload), and tells (the hang
        watchdog: the wait is not a hang); and how to wait for Ray to register the
        checkpoints reported."""
        self.clock, self.sleep = clock, sleep
        """Seconds since the epoch, the notice's deadline's clock (step times and what the
        checkpoint took are read off it too, so the plan compares like with like), and
        the hold's wait: a test's own, to place time rather than sleep."""
        self.hold_grace_s, self.margin_s = HOLD_GRACE_S, MARGIN_S
        self.seen: set[str] = set()
        self.asked = 0
        self.asking_s = 0.0
        """Calls made and the seconds they took (the cost, for benchmarks)."""
        self.steps_s: deque[float] = deque(maxlen=9)
        """The last intervals between two boundaries (their median: a step's time)."""
        self.last: tuple[int, float] | None = None
        self.deadline: float | None = None
        """The notice's deadline (seconds since the epoch) once its checkpoint is due."""
        self.insured: tuple[int, float] | None = None
        """The step of the notice's first checkpoint and when it was due."""
        self.checkpoint_s: float | None = None
        """What the notice's checkpoint took (with its report), measured by the step after."""
        self.final: int | None = None
        """The step of the last checkpoint before the deadline, once decided."""
        self.hold_due = False
        """Set where the last checkpoint before the deadline is due: hold after it."""

    def __call__(self, step: int) -> bool:
        now = self.clock()
        if self.last is not None and self.last[0] == step - 1:
            self.steps_s.append(now - self.last[1])
        self.last = (step, now)
        if self.insured is not None and self.final is None:
            return self._closing(step)
        return self._ask(step)

    def _ask(self, step: int) -> bool:
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
        self.deadline = info.deadline_ms / 1000 if info.deadline_ms else None
        left = f"in {max(0.0, self.deadline - self.clock()):.0f} s" if self.deadline else "soon"
        ranks = ", ".join(map(str, info.preempted_ranks))
        self.log(
            f"node {', '.join(n[:12] for n in new)} reclaimed {left} (ranks {ranks}): "
            f"checkpoint at step {step}"
        )
        if self.deadline is not None:  # without one, there is nothing to plan for
            self.insured, self.final, self.hold_due = (step, self.clock()), None, False
            self.checkpoint_s = None
        return True

    def _closing(self, step: int) -> bool:
        """At each boundary after the notice's checkpoint, rank 0 decides and every rank
        follows (one small collective a step, only until the deadline): train on while
        another step and a checkpoint still fit before it; else checkpoint here and hold
        after; and where not even a checkpoint fits, hold now."""
        assert self.insured is not None and self.deadline is not None
        if self.checkpoint_s is None:  # the notice's checkpoint, written and registered
            self.registered(self.deadline - self.clock())
            self.checkpoint_s = max(0.0, self.clock() - self.insured[1] - self._step_s())
        decision = self._decide()
        if decision == TRAIN_ON:
            return False
        self.final, self.hold_due = step, True
        if decision == HOLD:
            self.log("no time for another checkpoint before the deadline")
            self.hold_if_due(step)
            return False
        self.log(f"last checkpoint before the deadline: at step {step}")
        return True

    def after_checkpoint(self, step: int) -> None:
        """After a checkpoint of the run's own (an epoch's end, ``--checkpoint-every``):
        hold where it was the planned last one. Inside a notice's close it may be the last
        one without having been planned (an epoch ends between two boundaries' decisions,
        and its validation and checkpoint take the room the decision counted on): where
        another step and a checkpoint no longer fit before the deadline, hold after it
        rather than train a step that would be lost with the node."""
        closing = self.insured is not None and self.final is None and not self.hold_due
        measured = self.deadline is not None and self.checkpoint_s is not None
        if closing and measured and self._decide() != TRAIN_ON:  # this checkpoint is the last
            self.final, self.hold_due = step, True
            self.log(f"last checkpoint before the deadline: at step {step}")
        self.hold_if_due(step)

    def _step_s(self) -> float:
        """A step's time: the median of the last intervals between two boundaries."""
        return statistics.median(self.steps_s) if self.steps_s else 0.0

    def _decide(self) -> int:
        """Rank 0's decision, which every rank follows (one small collective): train on
        while another step and a checkpoint still fit before the deadline; else checkpoint
        and hold; where not even a checkpoint fits, hold now."""
        assert self.deadline is not None and self.checkpoint_s is not None
        left = self.deadline - self.clock()
        if left < self.checkpoint_s + self.margin_s:
            decision = HOLD
        elif left < self._step_s() + self.checkpoint_s + self.margin_s:
            decision = CHECKPOINT_AND_HOLD
        else:
            decision = TRAIN_ON
        return all_gather(decision)[0] if is_distributed() else decision  # rank 0's

    def hold_if_due(self, step: int) -> None:
        """After the last checkpoint before the deadline (``hold_due``): wait until it is
        on storage, then until the node goes (this process with it) or ``HOLD_GRACE_S``
        past the deadline."""
        if not self.hold_due or self.deadline is None:
            return
        self.hold_due = False
        self.wait_upload()
        self.holding()
        kept = "registered" if self.registered(self.deadline - self.clock()) else "not registered"
        left = self.deadline - self.clock()
        self.log(f"holding at step {step} until the node goes ({max(0.0, left):.0f} s to its "
                 f"deadline; its checkpoint {kept}): a step trained now would be lost "
                 "with it")  # fmt: skip
        while self.clock() < self.deadline + self.hold_grace_s:
            self.sleep(0.2)
        self.log(f"the node was not reclaimed by {self.hold_grace_s:.0f} s past its deadline: "
                 "training on")  # fmt: skip
        self.deadline = self.insured = self.final = None
