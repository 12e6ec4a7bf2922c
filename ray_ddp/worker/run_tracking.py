"""Rank 0's experiment tracker over one run, as a part both loops use (the built-in
``worker.loop`` and an own loop's ``worker.own_loop``): opened on the tracker run the run
already has (kept in its folder, else named in its own checkpoint), its per-step points
sent by the ``Tracked`` step-level hook, each report's metrics sent at once (and waited
for after the run's last), its id carried into the next checkpoint, closed at the end with
one line saying exactly what did not arrive (``tracking.sender``).
"""

from __future__ import annotations

from typing import Any

from ray_ddp.tracking.params import Settings
from ray_ddp.tracking.tracker import Tracker, epoch_values, read_run_id
from ray_ddp.worker.hooks import Tracked
from ray_ddp.worker.identity import Worker


class RunTracking:
    """The tracker of a run whose folder is ``run_dir``: ``checkpoint_run`` is the tracker
    run named in the run's own checkpoint (None: a fresh run, or ``--resume-from`` another
    run's); ``since_ms``: when training last went back over steps the tracker has
    (``TrainProgress.tracked_since``)."""

    def __init__(
        self, settings: Settings, run_dir: str, worker: Worker, checkpoint_run: str | None,
        since_ms: int = 0,
    ) -> None:  # fmt: skip
        self.worker = worker
        kept = read_run_id(run_dir, settings.kind)
        self.tracker = Tracker(settings, kept or checkpoint_run, worker.log, since_ms=since_ms)

    def hook(self, every: int) -> Tracked:
        """The step-level hook that sends the training loss, lr and speed every ``every``
        optimizer steps."""
        return Tracked(self.tracker, every)

    def params(self, values: dict[str, Any]) -> None:
        self.tracker.params(values)

    def reported(self, step: int, metrics: dict[str, Any], last: bool) -> None:
        """A report's metrics at optimizer step ``step``, sent now; after the run's
        ``last`` report, waited for (5 s at most): a Tune trial ends at its last report,
        its process with it."""
        self.tracker.metrics(step, epoch_values(metrics))
        if last:
            self.tracker.sender.drain(5.0)
        else:
            self.tracker.sender.flush()

    @property
    def run_id(self) -> str | None:
        """The tracker run's id once the tracker has one (for the next checkpoint)."""
        return self.tracker.run_id if self.tracker.ready else None

    def close(self) -> dict[str, Any]:
        """Send what is left (for a while: the run ends); the summary's ``tracking``."""
        ended = {**self.tracker.close(), "warned": self.tracker.sender.warned}
        self.worker.log(self.tracker.sender.line())  # what did not reach it, exactly
        return ended
