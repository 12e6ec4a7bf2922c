"""What W&B wrote in offline mode, read back: the records of a ``run-<id>.wandb`` file
(W&B's transaction log: a 7-byte header, then LevelDB-style chunks in 32 KiB blocks, each
record a ``wandb_internal_pb2.Record``), for the tests to check what a run logged."""

from __future__ import annotations

import glob
import json
import os
import struct
from typing import Any

BLOCK, CHUNK_HEADER, FILE_HEADER = 32768, 7, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:7]
    out, pending, offset = [], b"", FILE_HEADER
    while offset + CHUNK_HEADER <= len(data):
        left_in_block = BLOCK - offset % BLOCK
        if left_in_block < CHUNK_HEADER:  # the block's tail is padding
            offset += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + CHUNK_HEADER])
        body = data[offset + CHUNK_HEADER : offset + CHUNK_HEADER + length]
        offset += CHUNK_HEADER + length
        if kind == 0 and length == 0:
            continue
        pending = body if kind in (FULL, FIRST) else pending + body
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def offline_runs(folder: str) -> list[str]:
    """Every offline run's transaction log under ``folder`` (one per process that ran)."""
    return sorted(glob.glob(os.path.join(folder, "**", "offline-run-*", "run-*.wandb"),
                            recursive=True))  # fmt: skip


def history(paths: list[str]) -> list[dict[str, Any]]:
    """Every logged row of the runs' logs, in order: ``{"_step": n, key: value, ...}``."""
    rows = []
    for path in paths:
        for record in records(path):
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                             for i in record.history.item})  # fmt: skip
    return rows


def config(paths: list[str]) -> dict[str, Any]:
    """The runs' config (params), later updates over earlier ones."""
    values: dict[str, Any] = {}
    for path in paths:
        for record in records(path):
            kind = record.WhichOneof("record_type")
            items = record.config.update if kind == "config" else (
                record.run.config.update if kind == "run" else [])  # fmt: skip
            for item in items:
                value = json.loads(item.value_json)
                values[item.key] = value.get("value", value) if isinstance(value, dict) else value
    return values


def saved_files(paths: list[str]) -> set[str]:
    return {os.path.relpath(f, os.path.join(os.path.dirname(p), "files"))
            for p in paths for f in glob.glob(os.path.join(os.path.dirname(p), "files", "**"),
                                              recursive=True) if os.path.isfile(f)}  # fmt: skip
