"""A run's tracker: rank 0's during training (:class:`Tracker`: params and metrics put on
the sender's queue, never waited for) and the driver's at the end (:func:`finish`: the
artifacts and the run's status). The tracker's run id is kept with the run, in
``<run>/tracking.json`` (and in every checkpoint), so a re-run of the same ``--name`` or
a restart after a failure continues the same tracker run."""

from __future__ import annotations

import contextlib
import json
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from ray_ddp.io.storage import join, read_text, write_bytes
from ray_ddp.tracking.params import RUN_FILE, Settings, flatten
from ray_ddp.tracking.sender import POINT, Sender

NAMES = {"mlflow": "MLflow", "wandb": "W&B"}


def _kept(run_dir: str) -> dict[str, Any]:
    """``<run>/tracking.json`` as kept ({} where there is none, or it cannot be read)."""
    try:
        text = read_text(join(run_dir, RUN_FILE))
        return json.loads(text) if text else {}
    except (OSError, ValueError):
        return {}


def read_run_id(run_dir: str, kind: str) -> str | None:
    """The tracker run id kept in ``<run>/tracking.json`` for ``kind`` (None: none yet)."""
    return _kept(run_dir).get(kind, {}).get("run_id")


def write_run_id(run_dir: str, kind: str, run_id: str, **more: Any) -> None:
    """Keep ``run_id`` in ``<run>/tracking.json`` (other trackers' ids, and this one's
    run key, stay)."""
    kept = _kept(run_dir)
    kept[kind] = {**kept.get(kind, {}), "run_id": run_id, **more}
    write_bytes(join(run_dir, RUN_FILE), json.dumps(kept, indent=2).encode())


def run_key(run_dir: str, kind: str) -> str:
    """The key a new tracker run is made with (a tag), kept in ``<run>/tracking.json``
    before the server is asked: a run whose making was answered too late (the client
    gave up, the server had made it) is found by it, by every later try and by rank 0,
    rather than made again."""
    kept = _kept(run_dir)
    key = kept.get(kind, {}).get("run_key")
    if not key:
        key = uuid.uuid4().hex
        kept[kind] = {**kept.get(kind, {}), "run_key": key}
        write_bytes(join(run_dir, RUN_FILE), json.dumps(kept, indent=2).encode())
    return key


def open_sink(
    settings: Settings, run_id: str | None, opened: Callable[[str], None], since_ms: int = 0
):
    """The tracker's client for ``settings.kind``, for one run (``since_ms``: when the
    training last went back over steps the tracker has, ``TrainProgress.tracked_since``)."""
    if settings.kind == "mlflow":
        from ray_ddp.tracking.mlflow_sink import MlflowSink

        key = lambda: run_key(settings.run_dir, "mlflow")  # noqa: E731
        return MlflowSink(settings, run_id, opened, key, since_ms)
    from ray_ddp.tracking.wandb_sink import WandbSink

    return WandbSink(settings, run_id, opened)


def describe(settings: Settings) -> str:
    where = settings.uri or "W&B"
    return f"{NAMES[settings.kind]} tracking ({where})"


class Tracker:
    """One tracker run, fed from the training thread: every call returns at once."""

    def __init__(
        self, settings: Settings, run_id: str | None, log: Callable[[str], None],
        interval_s: float = 1.0, retry: bool = True, capacity: int = 100_000,
        since_ms: int = 0,
    ) -> None:  # fmt: skip
        self.settings, self.first_id, self.since_ms = settings, run_id, since_ms
        # The tracker's client, imported here, before training: importing it takes a
        # second or two of CPU, which a background thread would take from the first steps.
        # (Where that fails, the sending thread tries again, and says it.)
        self.sink: Any = None
        with contextlib.suppress(Exception):  # retried and reported by the sender
            self.sink = open_sink(settings, run_id, self._opened, since_ms)
        backoff = (0.5, 1.0, 2.0, 4.0) if retry else ()
        self.sender = Sender(self._deliver, log, describe(settings), interval_s, backoff,
                             capacity)  # fmt: skip
        self.sender.put(("open",))  # the client imported and the run found at once
        self.sender.flush()

    def _deliver(self, items: list) -> None:
        if self.sink is None:
            self.sink = open_sink(self.settings, self.first_id, self._opened, self.since_ms)
        self.sink(items)

    def _opened(self, run_id: str) -> None:
        """The run exists on the server: keep its id with the run (the sending thread)."""
        s = self.settings
        write_run_id(s.run_dir, s.kind, run_id, uri=s.uri, experiment=s.experiment)

    @property
    def ready(self) -> bool:
        """The run exists on the server (made, or found again)."""
        return self.sink is not None and self.sink.ready

    @property
    def run_id(self) -> str | None:
        return self.sink.run_id if self.sink is not None else self.first_id

    def wait_for_run(self, timeout_s: float = 30.0) -> str | None:
        """The run's id once the server has made or found it (None: not in time)."""
        end = time.monotonic() + timeout_s
        while not self.ready and time.monotonic() < end and not self.sender.failing:
            time.sleep(0.05)
        return self.run_id if self.ready else None

    def params(self, values: dict[str, Any]) -> None:
        self.sender.put(*(("param", k, v) for k, v in flatten(values).items()))

    def tags(self, values: dict[str, str]) -> None:
        self.sender.put(*(("tag", k, str(v)) for k, v in values.items()))

    def metrics(self, step: int, values: dict[str, Any], kind: str = "metric") -> None:
        """Numbers of ``values`` at optimizer step ``step`` (others are left out), never
        dropped: an epoch's figures, a sweep's best."""
        ms = int(time.time() * 1000)
        self.sender.put(*(
            (kind, k, float(v), step, ms) for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        ))  # fmt: skip

    def points(self, step: int, values: dict[str, Any]) -> None:
        """A step's figures (loss, lr, speed): thinned out, and counted, where the tracker
        lags too far behind (``sender``)."""
        self.metrics(step, values, POINT)

    def artifact(self, local_path: str, folder: str | None = None) -> None:
        self.sender.put(("artifact", local_path, folder))

    def end(self, status: str) -> None:
        """The run's status on the server: FINISHED, FAILED or KILLED."""
        self.sender.put(("end", status))

    def close(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """Send what is left (for at most ``timeout_s``); what was sent and what was not
        (``sender.line()`` says it in one line)."""
        complete = self.sender.close(timeout_s)
        if self.sink is not None:
            self.sink.close()
        return {"kind": self.settings.kind, "run_id": self.run_id, **self.sender.report(),
                "complete": complete}  # fmt: skip


EPOCH_RENAMED = {"train_loss": "epoch_train_loss", "samples_per_s": "epoch_samples_per_s"}
EPOCH_LEFT_OUT = {"step", "lr"}  # the step is the tracker's step; lr is logged per step


def epoch_values(metrics: dict[str, Any]) -> dict[str, Any]:
    """An epoch's metrics as the tracker gets them: the epoch averages named apart from
    the per-step figures of the same quantity."""
    return {EPOCH_RENAMED.get(k, k): v for k, v in metrics.items() if k not in EPOCH_LEFT_OUT}
