"""MLflow through its client (``MlflowClient``): the run made or found again, and each
batch of the sender (``sender``) as ``log_batch`` calls, artifacts and the run's end.

No step of one line of training is logged twice. A run continued after a restart or a
re-run (the same run id) reads, for each metric it logs, the highest step the server
already holds (its high-water mark), and sends only the steps above it: the steps the
failed attempt logged after the checkpoint it resumed from are trained again
(bit-identical: ray_ddp resumes exactly) but not logged again. After a failed send the
marks are read again before the batch goes, so a batch that reached the server while its
answer was lost is not sent twice. Params already on the run are not sent again (MLflow
refuses to change one).

A restarted epoch (``--restart-epoch``, a Ray Data stream resumed inside an epoch) is
another line of training: its steps are trained again on another order, with other
values. The points logged before it (``TrainProgress.tracked_since``) set no mark, so the
steps trained again are logged again; MLflow keeps every value a step was given, the
earlier one, then the new one.

One training run makes one MLflow run. A new run is made with a key (the tag
``ray_ddp.run_key``) that is kept in ``<run>/tracking.json`` before the server is asked,
and every make first looks for a run with that key: a make the server did while its
answer was lost (the client's request timed out) is found by the next try, or by rank 0
after the driver gave up, and not made again. (Not covered: a server still making the
first run when the next try looks; later opens then take the older of the two.)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ray_ddp.tracking.params import Settings
from ray_ddp.tracking.sender import METRICS, Item, Rejected

RUN_KEY_TAG = "ray_ddp.run_key"
"""The tag a run is made with: its key, kept with the run before the server is asked
(``tracker.run_key``), so that a make whose answer was lost is found, not made again."""
# MLflow's own limits for one log_batch call.
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100


def quick_requests() -> None:
    """Each request of this process's MLflow client fails fast (10 s, no retry of its
    own): the sender retries, and a slow server must not hold a sending thread for
    minutes. Set where not set already."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


class MlflowSink:
    """One MLflow run: made on the first batch (or found again by ``run_id``)."""

    def __init__(
        self,
        settings: Settings,
        run_id: str | None,
        opened: Callable[[str], None],
        run_key: Callable[[], str],
        since_ms: int = 0,
    ) -> None:
        quick_requests()
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=settings.uri)
        self.settings, self.run_id, self.opened = settings, run_id, opened
        self.run_key = run_key
        """The key (kept with the run) that a run this sink makes is tagged with."""
        self.since_ms = since_ms
        """Points logged before this (ms) are of steps trained before the training went
        back (a restarted epoch): they set no high-water mark."""
        self.ready = self.stale = False
        self.params: set[str] = set()
        self.marks: dict[str, int] = {}
        """Each metric's highest step on the server (read, or sent by this sink)."""
        self.on_server: set[str] = set()
        """Metrics the run had before this sink (their marks are read from the server)."""

    @property
    def where(self) -> str:
        return self.client.tracking_uri

    def url(self) -> str | None:
        uri = self.client.tracking_uri
        if self.run_id is None or not uri.startswith("http"):
            return None
        run = self.client.get_run(self.run_id)
        return f"{uri.rstrip('/')}/#/experiments/{run.info.experiment_id}/runs/{self.run_id}"

    def __call__(self, items: list[Item]) -> None:
        try:
            self._deliver(items)
        except Exception as exc:
            self.stale = True  # it may have reached the server: read the marks again
            from mlflow.exceptions import MlflowException

            status = exc.get_http_status_code() if isinstance(exc, MlflowException) else 0
            if 400 <= status < 500 and status != 429:
                raise Rejected(str(exc).splitlines()[0][:200]) from exc
            raise

    @property
    def opened_id(self) -> str:
        """The run's id, once ``_open`` has found or made the run."""
        assert self.run_id is not None, "the run is opened first"
        return self.run_id

    def _deliver(self, items: list[Item]) -> None:
        if not self.ready:
            self._open()
        if self.stale:
            self._reread()
        metrics, params, tags, files, end = self._sort(items)
        for chunk in _chunks(metrics, MAX_METRICS):
            self.client.log_batch(self.opened_id, metrics=chunk, synchronous=True)
        for chunk in _chunks(params, MAX_PARAMS):
            self.client.log_batch(self.opened_id, params=chunk, synchronous=True)
        for chunk in _chunks(tags, MAX_TAGS):
            self.client.log_batch(self.opened_id, tags=chunk, synchronous=True)
        # Counted as sent once the server has them.
        for m in metrics:
            self.marks[m.key] = max(m.step, self.marks.get(m.key, m.step))
        self.params.update(p.key for p in params)
        for local, folder in files:
            self.client.log_artifact(self.opened_id, local, folder)
        if end:
            self.client.set_terminated(self.opened_id, end)

    def _sort(self, items: list[Item]) -> tuple[list, list, list, list, str | None]:
        """The batch as MLflow's entities, without what the run already has."""
        from mlflow.entities import Metric, Param, RunTag

        metrics: list[Any] = []
        params: dict[str, Any] = {}
        tags: dict[str, Any] = {}
        files: list[tuple[str, str | None]] = []
        end: str | None = None
        seen: set[tuple[Any, Any]] = set()
        for item in items:
            kind = item[0]
            if kind in METRICS:
                _, key, value, step, ms = item
                if step <= self.marks.get(key, -1) or (key, step) in seen:
                    continue
                seen.add((key, step))
                metrics.append(Metric(key, value, ms, step))
            elif kind == "param" and item[1] not in self.params:
                params.setdefault(item[1], Param(item[1], item[2]))
            elif kind == "tag":
                tags[item[1]] = RunTag(item[1], item[2])
            elif kind == "artifact":
                files.append((item[1], item[2]))
            elif kind == "end":
                end = item[1]
        return metrics, list(params.values()), list(tags.values()), files, end

    def _open(self) -> None:
        """Find the run again (set back to running), or make it; say its id."""
        run = self._existing()
        if run is None:
            experiment_id = self._experiment()
            key = self.run_key()
            run = self._made_with(experiment_id, key)
            if run is None:
                self.run_id = self._create(experiment_id, key)
        if run is not None:
            self.run_id = run.info.run_id
            self.params = set(run.data.params)
            self.on_server = set(run.data.metrics)
            self.stale = True
            if run.info.status != "RUNNING":
                self.client.update_run(self.run_id, status="RUNNING")
        self.ready = True
        self.opened(self.opened_id)

    def _existing(self) -> Any:
        if self.run_id is None:
            return None
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(self.run_id)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            return None  # another server, or deleted: a new run

    def _experiment(self) -> str:
        name = self.settings.experiment
        experiment = self.client.get_experiment_by_name(name)
        return experiment.experiment_id if experiment else self.client.create_experiment(name)

    def _made_with(self, experiment_id: str, key: str) -> Any:
        """The run made with ``key`` already (a make whose answer was lost, this sink's
        or another's), or None. Where a race made two, every sink takes the first."""
        runs = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{key}'",
            max_results=1, order_by=["attributes.start_time ASC"],
        )  # fmt: skip
        return runs[0] if runs else None

    def _create(self, experiment_id: str, key: str) -> str:
        tags = {**self.settings.tags, RUN_KEY_TAG: key}
        if self.settings.parent_run_id:
            tags["mlflow.parentRunId"] = self.settings.parent_run_id
        run = self.client.create_run(experiment_id, run_name=self.settings.run_name, tags=tags)
        return run.info.run_id

    def _reread(self) -> None:
        """The high-water marks of every metric this run has on the server (of the points
        logged since ``since_ms``)."""
        known = self.on_server | set(self.marks)
        for key in known:
            history = self.client.get_metric_history(self.opened_id, key)
            steps = [m.step for m in history if m.timestamp >= self.since_ms]
            if steps:
                self.marks[key] = max(steps)
        self.stale = False

    def close(self) -> None:
        """Nothing held open: every call above is a request of its own."""


def _chunks(values: list, size: int) -> list[list]:
    return [values[i : i + size] for i in range(0, len(values), size)]
