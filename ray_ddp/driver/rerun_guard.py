"""The config a named run was started with, kept beside its checkpoints.

Re-running a ``--name`` resumes it, which is only right if it is the same training: a
re-run whose flags change what is trained (model, data, batch, optimizer, seed, ...) would
silently continue someone else's run and mix two configs in one directory. The driver
refuses that before any Ray work, naming the flags that differ, unless
``--allow-config-change`` says it is meant. Fields marked ``resume_safe`` in their
definition (``ray_ddp.config.sections``) only change how the run is executed or logged, or extend
it (``--epochs``, ``--max-steps``), and may differ freely. The number of workers and the
accumulation are among them: what is trained is their product with the per-worker batch,
the global batch, which is compared instead (``ray_ddp.driver.elastic`` keeps it when only the
worker count changed).
"""

from __future__ import annotations

import json
from typing import Any

from ray_ddp.config import ConfigError, TrainConfig
from ray_ddp.config.batch import saved_global_batch
from ray_ddp.config.fields import flag_name, resume_safe_fields
from ray_ddp.config.sections import Checkpointing
from ray_ddp.io.storage import join, read_text, write_bytes

RECORD_FILE = "ray_ddp_config.json"

# Fields that may differ between runs of one name: extent, placement, output, logging.
RESUME_SAFE = resume_safe_fields(TrainConfig)


def record_path(checkpointing: Checkpointing) -> str:
    return join(checkpointing.run_dir, RECORD_FILE)


def config_changes(
    saved: dict[str, Any], current: dict[str, Any], global_batch: bool = True
) -> list[str]:
    """``--flag OLD -> NEW`` for every field that matters and differs. An unresolved
    value (None, e.g. num_workers before the cluster is known) is not compared, nor is a
    field this version no longer has."""
    changes = []
    for key, old in sorted(saved.items()):
        if key in RESUME_SAFE or key not in current:
            continue
        new = current[key]
        if old is not None and new is not None and old != new:
            changes.append(f"{flag_name(key)} {old} -> {new}")
    old_batch, new_batch = saved_global_batch(saved), saved_global_batch(current)
    if global_batch and old_batch and new_batch and old_batch != new_batch:
        changes.append(f"global batch {old_batch} -> {new_batch}")
    return changes


def recorded_config(checkpointing: Checkpointing) -> dict[str, Any] | None:
    """The config run ``checkpointing.name`` was recorded with; None for a new run."""
    if not checkpointing.name:
        return None
    path = record_path(checkpointing)
    text = read_text(path)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{path} is not readable JSON ({exc}); move it aside") from exc


def check_rerun(cfg: TrainConfig, global_batch: bool = True) -> None:
    """Refuse a re-run of run ``cfg.checkpointing.name`` whose training config differs from
    the recorded one.
    ``global_batch=False`` leaves the global batch out: before the driver has kept it
    (``world_size.keep_global_batch``) on a re-run with another worker count."""
    saved = recorded_config(cfg.checkpointing)
    if saved is None:
        return
    changes = config_changes(saved, cfg.to_dict(), global_batch)
    if changes and not cfg.checkpointing.allow_config_change:
        shown = "; ".join(changes[:4]) + ("; ..." if len(changes) > 4 else "")
        raise ConfigError(
            f"run '{cfg.checkpointing.name}' exists with another config ({shown}): re-run with "
            "its flags "
            "to resume it, pick a new --name, or pass --allow-config-change to continue it "
            "with these"
        )


def write_record(cfg: TrainConfig) -> None:
    """Record ``cfg`` for the next re-run."""
    record = json.dumps(cfg.to_dict(), indent=2, sort_keys=True)
    write_bytes(record_path(cfg.checkpointing), record.encode())
