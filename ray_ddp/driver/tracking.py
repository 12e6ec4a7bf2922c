"""The driver's side of ``--tracking`` and ``--profile-steps``: the checks before any
cluster work (the tracker's package and server, the profiled steps within the run), the
settings rank 0 tracks with, and the run's end: curves.png, metrics.csv, the summary and
the profiles as the tracker run's artifacts, and its status."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import uuid
from typing import Any

from ray_ddp.config import ConfigError
from ray_ddp.config.batch import global_batch
from ray_ddp.config.sections import Checkpointing, Logging, Optimisation, Scaling
from ray_ddp.config.train import profile_problem
from ray_ddp.data.order.global_order import EpochPlan
from ray_ddp.io.run_logs import CURVES_PNG, METRICS_CSV
from ray_ddp.io.storage import exists, join, local_copy, read_bytes
from ray_ddp.tracking.params import (
    Settings,
    git_commit,
    passed_on,
    resolve_experiment,
    resolve_uri,
    run_tags,
)
from ray_ddp.tracking.tracker import NAMES, Tracker, read_run_id, write_run_id

PACKAGES = {"mlflow": "mlflow", "wandb": "wandb"}
FINISH_TIMEOUT_S = 60.0
OPEN_TIMEOUT_S = 20.0


def check_tracking(logging: Logging) -> None:
    """``--tracking`` without its package, or MLflow without a server: one line, before
    Ray starts."""
    if logging.tracking == "none":
        return
    package = PACKAGES[logging.tracking]
    if importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"--tracking {logging.tracking} needs the {package} package, which is not "
            "installed: "
            f"pip install -e '.[{logging.tracking}]' (or pip install {package})"
        )
    if logging.tracking == "mlflow" and resolve_uri("mlflow", logging.tracking_uri) is None:
        raise ConfigError(
            "--tracking mlflow needs a server: --tracking-uri URI or MLFLOW_TRACKING_URI "
            "(e.g. http://127.0.0.1:5000 of `mlflow server`, see docs/tracking.md)"
        )


def check_profile_steps(
    logging: Logging, optim: Optimisation, scaling: Scaling, train_size: int | None
) -> None:
    """``--profile-steps`` within the run's optimizer steps (known once the workers are)."""
    if not logging.profile_steps or train_size is None or not scaling.num_workers:
        return
    batch = global_batch(optim.batch_size, scaling.num_workers, optim.accum_steps)
    plan = EpochPlan(train_size, optim.batch_size, batch, optim.seed, epoch=0)
    steps = plan.steps * optim.epochs
    problem = profile_problem(logging, optim, steps)
    if problem:
        raise ConfigError(problem)


def settings_for(
    logging: Logging, checkpointing: Checkpointing, parent_run_id: str | None = None
) -> Settings | None:
    """Where rank 0 tracks the run named in ``checkpointing`` (resolved here: the workers
    may not share the driver's environment or working directory); None without
    ``--tracking``."""
    if logging.tracking == "none":
        return None
    assert checkpointing.name is not None
    return Settings(
        kind=logging.tracking,
        uri=resolve_uri(logging.tracking, logging.tracking_uri),
        experiment=resolve_experiment(logging.tracking, logging.experiment),
        run_name=checkpointing.name,
        run_dir=checkpointing.run_dir,
        tags=run_tags(checkpointing.name, checkpointing.run_dir, git_commit()),
        parent_run_id=parent_run_id,
        env=passed_on(logging.tracking),
    )


def open_tracking(settings: Settings | None) -> str | None:
    """The tracker run made (or found again) before any worker starts, its id kept in
    the run's folder, so that every attempt logs to the one run. A server that has not
    answered in 20 s is left to rank 0, which tries again and says it (so not here); a
    run the server made while its answer was lost is found by its key, not made again
    (``mlflow_sink``)."""
    if settings is None:
        return None
    kept = read_run_id(settings.run_dir, settings.kind)
    if settings.kind == "wandb":  # W&B takes the id its client makes: nothing to ask
        if kept is None:
            kept = uuid.uuid4().hex[:12]  # W&B's ids: lower-case letters and digits
            write_run_id(settings.run_dir, "wandb", kept, experiment=settings.experiment)
        return kept
    tracker = Tracker(settings, kept, lambda _: None, retry=False)
    run_id = tracker.wait_for_run(OPEN_TIMEOUT_S)
    tracker.close(1.0)
    return run_id


def warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def finish_tracking(
    settings: Settings | None, summary: dict[str, Any] | None, status: str = "FINISHED"
) -> str | None:
    """The run's artifacts (curves.png, metrics.csv, ``summary.json``, the profiles) and
    its ``status``, sent for at most a minute; a tracker that fails is said once (not at
    all where rank 0 said it already). Returns the tracker run's id."""
    if settings is None:
        return None
    worker_side = (summary or {}).get("tracking") or {}
    run_id = read_run_id(settings.run_dir, settings.kind) or worker_side.get("run_id")
    if run_id is None:
        if not worker_side.get("warned"):
            warn(f"warning: no {NAMES[settings.kind]} run was made for {settings.run_name}")
        return None
    staging = tempfile.mkdtemp(prefix="ray_ddp_artifacts_")
    # Where rank 0 found the tracker failing, one quiet try: its line has said it.
    quiet = bool(worker_side.get("warned"))
    say = (lambda _: None) if quiet else warn
    tracker = Tracker(settings, run_id, say, interval_s=0.2, retry=not quiet)
    try:
        for local, folder in _artifacts(settings.run_dir, summary, staging):
            tracker.artifact(local, folder)
        tracker.end(status)
        tracker.close(FINISH_TIMEOUT_S)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return run_id


def _artifacts(run_dir: str, summary: dict[str, Any] | None, staging: str):
    """``(local file, artifact folder)`` of everything the run leaves for the tracker."""
    for name in (CURVES_PNG, METRICS_CSV):
        data = read_bytes(join(run_dir, name))
        if data is not None:
            path = os.path.join(staging, name)
            with open(path, "wb") as f:
                f.write(data)
            yield path, None
    if summary is not None:
        path = os.path.join(staging, "summary.json")
        with open(path, "w") as f:
            json.dump(summary, f, indent=2, default=str)
        yield path, None
    profiles = join(run_dir, "profiles")
    if exists(profiles):
        target = os.path.join(staging, "profiles")
        with local_copy(profiles) as folder:
            shutil.copytree(folder, target)
        for attempt in sorted(os.listdir(target)):
            for name in sorted(os.listdir(os.path.join(target, attempt))):
                yield os.path.join(target, attempt, name), f"profiles/{attempt}"


def profile_lines(summary: dict[str, Any]) -> list[str]:
    """Where the traces are, and rank 0's top operators by self time."""
    profile = summary.get("profile")
    if not profile:
        return []
    return [
        f"profile of steps {profile['steps']}: one trace per rank in {profile['folder']} "
        "(open in https://ui.perfetto.dev or chrome://tracing)",
        f"rank 0's top operators by {profile['sorted_by'].replace('_', ' ')}:",
        profile["top"],
    ]


# ----------------------------------------------------------------------------- sweeps
def open_sweep(
    logging: Logging, checkpointing: Checkpointing, name: str, sweep_dir: str,
    params: dict[str, Any],
) -> tuple[Settings | None, str | None]:  # fmt: skip
    """A sweep's parent run (its search space and base config as params): its settings
    and id, which every trial's run names as its parent. (None, None) without
    ``--tracking``, or (settings, None) where the server could not make it."""
    if logging.tracking == "none":
        return None, None
    settings = settings_for(logging, dataclasses.replace(checkpointing, name=name))
    assert settings is not None
    settings = dataclasses.replace(
        settings, run_dir=sweep_dir, tags={**settings.tags, "ray_ddp.sweep": "true"}
    )
    parent = open_tracking(settings)
    if parent is not None:
        tracker = Tracker(settings, parent, warn)
        tracker.params(params)
        tracker.close()
    return settings, parent


def finish_sweep(
    settings: Settings | None, parent: str | None, summary: dict[str, Any], train_dir: str
) -> None:
    """Each trial's run tagged with how it ended (``ray_ddp.asha_stopped``: stopped early
    by ASHA, status KILLED), then the parent's best figures, results and end."""
    if settings is None or parent is None:
        return
    for trial in summary["trials"]:
        child = dataclasses.replace(settings, run_name=trial["trial"],
                                    run_dir=join(train_dir, trial["trial"]))  # fmt: skip
        run_id = read_run_id(child.run_dir, child.kind)
        if run_id is None:
            continue
        stopped = trial["status"] == "stopped early"
        tracker = Tracker(child, run_id, warn)
        tracker.tags({"ray_ddp.trial_status": trial["status"],
                      "ray_ddp.asha_stopped": str(stopped).lower(),
                      "ray_ddp.epochs_run": trial["epochs_run"]})  # fmt: skip
        tracker.close()
        status = "KILLED" if stopped else "FAILED" if trial["status"] == "error" else "FINISHED"
        finish_tracking(child, None, status)  # its curves.png and metrics.csv, its end
    best = summary["best"]
    tracker = Tracker(settings, parent, warn)
    tracker.metrics(0, {f"best_{summary['metric']}": best["best_value"]})
    tracker.tags({"ray_ddp.best_trial": best["trial"]})
    for file in ("results.csv", "sweep.png"):
        data = read_bytes(join(summary["sweep_dir"], file))
        if data is not None:
            staging = tempfile.mkdtemp(prefix="ray_ddp_artifacts_")
            with open(os.path.join(staging, file), "wb") as f:
                f.write(data)
            tracker.artifact(os.path.join(staging, file))
    tracker.end("FINISHED")
    tracker.close(FINISH_TIMEOUT_S)
