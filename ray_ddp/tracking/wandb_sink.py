"""Weights & Biases through ``wandb.init(id=..., resume="allow")``: the sender's batches
as ``run.log`` rows keyed by the optimizer step, params as the run's config, files saved
with the run, and its end.

W&B keeps one row per step and takes steps in increasing order only. A run continued
after a restart or a re-run (the same id) starts above the last step the W&B server
holds for it (``run.step``), so the steps a failed attempt logged after its checkpoint are
not logged again. In offline mode (``WANDB_MODE=offline``) there is no server to ask:
each process writes a run folder of its own, and ``wandb sync`` merges them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

from ray_ddp.io.storage import is_uri
from ray_ddp.tracking.params import Settings
from ray_ddp.tracking.sender import METRICS, Item


class WandbSink:
    """One W&B run, opened on the first batch (``run_id``: the id kept with the run)."""

    def __init__(
        self, settings: Settings, run_id: str | None, opened: Callable[[str], None]
    ) -> None:
        import wandb

        self.wandb, self.settings, self.opened = wandb, settings, opened
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.run: Any = None
        self.ready = False
        self.floor = 0
        """Steps at or below this are the server's already (a continued run)."""
        self.last = 0

    def __call__(self, items: list[Item]) -> None:
        if self.run is None:
            self._open()
        rows: dict[int, dict[str, float]] = {}
        config, files, end = {}, [], None
        for item in items:
            kind = item[0]
            if kind in METRICS:
                _, key, value, step, _ = item
                if step > self.floor and step >= self.last:
                    rows.setdefault(step, {})[key] = value
            elif kind == "param" and item[1] not in self.run.config:
                config[item[1]] = item[2]
            elif kind == "tag":
                config[f"tag.{item[1]}"] = item[2]
            elif kind == "artifact":
                files.append((item[1], item[2]))
            elif kind == "end":
                end = item[1]
        if config:
            self.run.config.update(config, allow_val_change=True)
        for step in sorted(rows):
            self.run.log(rows[step], step=step)
            self.last = step
        for local, folder in files:  # copied: W&B links a saved file, and ours are temporary
            kept = os.path.join(self.run.dir, folder or "", os.path.basename(local))
            os.makedirs(os.path.dirname(kept), exist_ok=True)
            shutil.copyfile(local, kept)
            self.run.save(kept, base_path=self.run.dir, policy="now")
        if end:
            self._finish(0 if end == "FINISHED" else 1)

    def _open(self) -> None:
        s = self.settings
        local = s.run_dir if not is_uri(s.run_dir) else tempfile.mkdtemp(prefix="ray_ddp_wandb_")
        os.makedirs(local, exist_ok=True)
        os.environ.update(s.env)  # the driver's WANDB_MODE, server, entity
        self.run = self.wandb.init(
            project=s.experiment, name=s.run_name, id=self.run_id, resume="allow", dir=local,
            group=s.parent_run_id, reinit="create_new",
            settings=self.wandb.Settings(silent=True, console="off"),
        )  # fmt: skip
        tags = {f"tag.{k}": v for k, v in s.tags.items() if not k.startswith("mlflow.")}
        tags.update(run_name=s.run_name)
        if "mlflow.source.git.commit" in s.tags:
            tags["tag.git_commit"] = s.tags["mlflow.source.git.commit"]
        self.run.config.update(tags, allow_val_change=True)
        if self.run.resumed:
            self.floor = max(0, int(self.run.step) - 1)
        self.ready = True
        self.opened(self.run_id)

    def _finish(self, code: int) -> None:
        if self.run is not None:
            self.run.finish(exit_code=code)
            self.run = None

    def close(self) -> None:
        """The run's process side ended (another process may continue the run)."""
        self._finish(0)
