"""The driver's view of a training loop the user wrote (``ray_ddp.launch``): which
function every worker runs, what ranks its checkpoints, and its name.

An :class:`OwnLoop` goes where a ``Task`` goes on the driver (the checks, the TorchTrainer,
the summary), so an own loop is run with the same options and behaviour as the built-in
one; its model, data and loss are the loop's own, built in the workers, so the Task
methods that would build them are never called (each says so if it were).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ray_ddp.task.interface import Task


class OwnLoop(Task):
    """``function(run)`` run in every worker (``run``: ``ray_ddp.Run``)."""

    def __init__(
        self, function: Callable[[Any], None], best_metric: str = "loss", best_mode: str = "min"
    ) -> None:
        self.function = function
        self.best_metric = best_metric  # type: ignore[misc]
        self.best_mode = best_mode  # type: ignore[misc]

    @property
    def spec(self) -> str:
        """``module:function``, recorded as the run's ``task`` (a re-run of another loop
        under the same name is refused)."""
        return f"{self.function.__module__}:{self.function.__qualname__}"

    def name(self, cfg: Any) -> str:
        return self.function.__name__.replace("_", "-")

    def check(self, cfg: Any, facts: dict[str, Any]) -> tuple[int | None, int | None]:
        """Nothing to dry-run on the driver: the loop builds its data in the workers."""
        return None, None

    def _not_here(self, what: str) -> Any:
        raise TypeError(f"an own loop ({self.spec}) builds its {what} in its own function")

    def datasets(self, cfg, facts):
        return self._not_here("datasets")

    def model(self, cfg, facts):
        return self._not_here("model")

    def loss(self, model, batch):
        return self._not_here("loss")

    def metrics(self, model, batch):
        return self._not_here("metrics")
