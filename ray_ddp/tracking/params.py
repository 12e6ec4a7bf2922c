"""What a tracker is told about a run, as plain values (no Ray, no torch, no tracker):
the flattened config and the facts of the run, the tags, and the settings the driver
hands to the workers."""

from __future__ import annotations

import os
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any

RUN_FILE = "tracking.json"
"""``<run>/tracking.json``: the tracker's run id, kept with the run so that a re-run or a
restart continues the same tracker run."""
DEFAULT_EXPERIMENT = "ray_ddp"
PARAM_LIMIT = 6000  # MLflow's longest param value


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested dicts as dotted keys, every value as text (``None``: ``auto``), lists as
    comma-separated text: ``{"a": {"b": 1}, "c": None}`` -> ``{"a.b": "1", "c": "auto"}``."""
    flat: dict[str, str] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        elif value is None:
            flat[name] = "auto"
        elif isinstance(value, (list, tuple)):
            flat[name] = ",".join(map(str, value))
        else:
            flat[name] = str(value)[:PARAM_LIMIT]
    return flat


def git_commit(directory: str | None = None) -> str | None:
    """The commit checked out in ``directory`` (default: the working directory), or None
    outside a git repository (or without git)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=directory or os.getcwd(),
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and len(commit) == 40 else None


@dataclass(frozen=True)
class Settings:
    """Where a run is tracked: what the driver resolves and hands to rank 0 (plain values,
    pickled to the workers)."""

    kind: str
    """``mlflow`` or ``wandb``."""
    uri: str | None
    """MLflow's tracking URI (resolved on the driver: the workers may not share its
    environment)."""
    experiment: str
    run_name: str
    run_dir: str
    tags: dict[str, str] = field(default_factory=dict)
    parent_run_id: str | None = None
    """A sweep's parent run, for a trial's run."""
    env: dict[str, str] = field(default_factory=dict)
    """The driver's tracker settings a worker's environment may lack (W&B's mode, server,
    entity; never a key or token: those belong in the workers' environment)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Settings | None:
        return cls(**data) if data else None


def run_tags(run_name: str, run_dir: str, commit: str | None) -> dict[str, str]:
    """The tags of a run: its name, where it lives, the code's commit (when known)."""
    tags = {"mlflow.runName": run_name, "ray_ddp.run_dir": run_dir}
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return tags


PASSED_ON = ("WANDB_MODE", "WANDB_BASE_URL", "WANDB_ENTITY")


def passed_on(kind: str) -> dict[str, str]:
    """What of the driver's environment rank 0 tracks with too."""
    if kind != "wandb":
        return {}
    return {name: os.environ[name] for name in PASSED_ON if os.environ.get(name)}


def resolve_experiment(kind: str, given: str | None) -> str:
    env = "MLFLOW_EXPERIMENT_NAME" if kind == "mlflow" else "WANDB_PROJECT"
    return given or os.environ.get(env) or DEFAULT_EXPERIMENT


def resolve_uri(kind: str, given: str | None) -> str | None:
    """MLflow's tracking URI: the flag, else MLFLOW_TRACKING_URI; None for W&B."""
    if kind != "mlflow":
        return None
    return given or os.environ.get("MLFLOW_TRACKING_URI") or None


def versions() -> dict[str, str]:
    """The versions that say what ran (imported lazily: the driver has them loaded)."""
    import ray
    import torch

    from ray_ddp import __version__

    return {"ray_version": ray.__version__, "torch_version": torch.__version__,
            "ray_ddp_version": __version__}  # fmt: skip
