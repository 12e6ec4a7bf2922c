"""A training run in a background thread, so that a test can act on the cluster (remove
or add nodes) while it trains."""

from __future__ import annotations

import threading
from typing import Any

from ray_ddp.config import TrainConfig
from ray_ddp.driver.run import run_training
from ray_ddp.testing.harness import Harness


class BackgroundRun:
    def __init__(self, cfg: TrainConfig, harness: Harness | None = None) -> None:
        self.summary: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(cfg, harness))
        self.thread.start()

    def _run(self, cfg: TrainConfig, harness: Harness | None) -> None:
        try:
            self.summary = run_training(cfg, harness=harness)
        except BaseException as exc:  # noqa: BLE001 - surfaced by finish()
            self.error = exc

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    def finish(self, timeout: float) -> dict[str, Any]:
        """The summary, once the run ends within ``timeout`` seconds and succeeds."""
        self.thread.join(timeout=timeout)
        assert not self.thread.is_alive(), f"the run did not finish in {timeout:.0f} s"
        assert self.error is None, self.error
        assert self.summary is not None
        return self.summary
