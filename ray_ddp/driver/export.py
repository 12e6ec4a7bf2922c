"""Export a checkpoint for inference without Ray: a plain ``state_dict`` file, a
``torch.export`` program (``model.pt2``, batch dimension dynamic) where the task gives
example inputs, and a small JSON that says what the model expects.

    import torch
    program = torch.export.load("runs/<name>/export/model.pt2")
    logits = program.module()(images)          # no ray, no ray_ddp needed

    # or rebuild the architecture yourself and load the plain weights:
    state = torch.load("runs/<name>/export/model_state_dict.pt", weights_only=True)
"""

from __future__ import annotations

import json
import os

import torch

from ray_ddp.checkpoint.format import load_model, load_state, saved_config, saved_task_meta
from ray_ddp.io.storage import atomic_path, is_uri, join, write_bytes
from ray_ddp.task import Task
from ray_ddp.task.loading import load_task

STATE_DICT_FILE = "model_state_dict.pt"
PROGRAM_FILE = "model.pt2"
META_FILE = "model.json"


def export_checkpoint(
    checkpoint_dir: str, out_dir: str, task: Task | None = None, source: str | None = None
) -> dict[str, str]:
    """Write the files into local ``out_dir``; returns their paths. The program is written
    when the task gives ``example_inputs`` (the built-in classification does). Each file is
    written to a temporary name first, so a failed export never leaves a partial file.
    ``source``: where the checkpoint lives, for model.json (default ``checkpoint_dir``)."""
    os.makedirs(out_dir, exist_ok=True)
    state = load_state(checkpoint_dir)
    meta = saved_task_meta(state)
    task = task if task is not None else load_task(meta["task"])
    model = load_model(checkpoint_dir, task)
    paths = {"state_dict": os.path.join(out_dir, STATE_DICT_FILE)}
    with atomic_path(paths["state_dict"]) as tmp:
        torch.save(model.state_dict(), tmp)
    described: dict = {**meta, "source_checkpoint": source or checkpoint_dir}
    example = task.example_inputs(saved_config(state), meta["facts"])
    if example is not None:
        # Every input's batch dimension is dynamic; other sizes are whatever torch.export
        # finds (Dim.AUTO: static where the model needs them fixed).
        dynamic = tuple({0: torch.export.Dim.AUTO} for _ in example)
        program = torch.export.export(model, tuple(example), dynamic_shapes=dynamic)
        paths["program"] = os.path.join(out_dir, PROGRAM_FILE)
        with atomic_path(paths["program"]) as tmp:  # the temporary name keeps .pt2
            torch.export.save(program, tmp)
        described["inputs"] = [
            {"shape": list(t.shape[1:]), "dtype": str(t.dtype).removeprefix("torch.")}
            for t in example
        ]
    paths["meta"] = os.path.join(out_dir, META_FILE)
    write_bytes(paths["meta"], json.dumps(described).encode())
    return paths


def export_best(task: Task, checkpoint_path: str, run_dir: str) -> dict[str, str]:
    """Export ``checkpoint_path`` into ``<run_dir>/export`` (each a local path or a full
    URI such as ``s3://bucket/runs/<name>``; a URI export is made locally, then each file
    uploaded whole, model.json last)."""
    import tempfile

    import ray.train

    with ray.train.Checkpoint(checkpoint_path).as_directory() as local_checkpoint:
        if not is_uri(run_dir):
            return export_checkpoint(
                local_checkpoint, os.path.join(run_dir, "export"), task, source=checkpoint_path
            )
        with tempfile.TemporaryDirectory() as staging:
            paths = export_checkpoint(local_checkpoint, staging, task, source=checkpoint_path)
            uploaded = {}
            for name, path in paths.items():  # written in order: meta last
                target = join(run_dir, "export", os.path.basename(path))
                with open(path, "rb") as f:
                    write_bytes(target, f.read())
                uploaded[name] = target
            return uploaded
