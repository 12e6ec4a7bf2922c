"""Whether Ray's reclaim notice has reached this worker yet, read from the worker's own copy
(``ray.train.get_preemption_info`` is a broadcast from rank 0, a barrier; this is not).

Only the test harness asks it: a rank held in a step until the notice is there (not a
sleep long enough on a quiet machine) makes a reclaim test act at a known step."""

from __future__ import annotations


def arrived_here() -> bool:
    """The preemption watcher has told this worker of a reclaim (False where this Ray has
    no such context, or outside a Ray Train worker)."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().preemption_context.preemption_info is not None
    except (ImportError, AttributeError, RuntimeError):
        return False
