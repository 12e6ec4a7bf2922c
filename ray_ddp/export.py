"""Export a checkpoint for inference without Ray: a plain ``state_dict`` file and a
``torch.export`` program (``model.pt2``, batch dimension dynamic) with a small JSON that
says what the model expects.

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

from ray_ddp.checkpoint import load_model, load_state
from ray_ddp.storage import atomic_path, is_uri, write_bytes

STATE_DICT_FILE = "model_state_dict.pt"
PROGRAM_FILE = "model.pt2"
META_FILE = "model.json"


def export_checkpoint(checkpoint_dir: str, out_dir: str) -> dict[str, str]:
    """Write the three files into ``out_dir``; returns their paths. Each is written to a
    temporary name first, so a failed export never leaves a partial file."""
    os.makedirs(out_dir, exist_ok=True)
    meta = load_state(checkpoint_dir)["model_meta"]
    model = load_model(checkpoint_dir)
    files = {"state_dict": STATE_DICT_FILE, "program": PROGRAM_FILE, "meta": META_FILE}
    paths = {name: os.path.join(out_dir, file) for name, file in files.items()}
    with atomic_path(paths["state_dict"]) as tmp:
        torch.save(model.state_dict(), tmp)
    example = torch.zeros(2, *meta["input_shape"])
    program = torch.export.export(model, (example,), dynamic_shapes=({0: torch.export.Dim.AUTO},))
    with atomic_path(paths["program"]) as tmp:  # the temporary name keeps the .pt2 suffix
        torch.export.save(program, tmp)
    write_bytes(
        paths["meta"],
        json.dumps(
            {**meta, "source_checkpoint": checkpoint_dir, "input_dtype": "float32"}
        ).encode(),
    )
    return paths


def export_best(checkpoint_path: str, run_dir: str) -> dict[str, str]:
    """Export ``checkpoint_path`` (local or URI) into ``<run_dir>/export``."""
    import tempfile

    import ray.train

    with ray.train.Checkpoint(checkpoint_path).as_directory() as local_checkpoint:
        if not is_uri(run_dir):
            return export_checkpoint(local_checkpoint, os.path.join(run_dir, "export"))
        with tempfile.TemporaryDirectory() as staging:
            paths = export_checkpoint(local_checkpoint, staging)
            uploaded = {}
            for name, path in paths.items():
                target = f"{run_dir}/export/{os.path.basename(path)}"
                with open(path, "rb") as f:
                    write_bytes(target, f.read())
                uploaded[name] = target
            return uploaded
