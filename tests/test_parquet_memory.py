"""A Parquet split larger than a worker's memory limit trains in streaming mode, and fails
in the old in-memory mode (issue 17). No Ray is started: each mode runs in a subprocess
that builds a training worker's data exactly as a worker's run does
(``ray_ddp.worker.builtin_parts``'s ``build_worker_data``: the task's datasets, then
``make_loaders``) and iterates its training loader over a whole epoch.

The limit is ``RLIMIT_DATA`` (private writable memory: the heap, anonymous mappings,
pyarrow's allocations, thread stacks), set to what the process holds after its imports
plus a margin smaller than the split. ``RLIMIT_AS`` would not do: torch and pyarrow
reserve gigabytes of address space they never touch, so an address-space limit fails on
some reservation, not on data. The DataLoader worker processes are forks: they inherit the
limit. Going over it makes an allocation fail, which Python raises as ``MemoryError``.

The one substitution: ``ray.train.torch.prepare_data_loader`` needs a Ray Train context;
on CPU it only wraps the loader to move batches to the CPU, so the child replaces it with
the identity.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SIDE = 256  # 256x256 RGB noise, stored PNG: ~197 KB a row that nothing can compress
TRAIN_ROWS = 2400  # ~450 MB
VAL_ROWS = 64
ROWS_PER_GROUP = 32
GROUPS_PER_FILE = 8
MARGIN_MB = 300  # the limit: the child's memory after its imports + this
SHUFFLE_BUFFER = 128  # rows (~25 MB)
BATCH_SIZE = 32
# Streaming holds at most (ceil(M/W) + 2) (ceil(B/g) + 2) + 2 = 3 x 6 + 2 = 20 row groups
# (docs/data.md, "Data larger than memory": M = W = 1, B = 128, g = 32), 20 x 6.3 MB = 126 MB,
# plus the DataLoader's prefetch; measured: about +160 MB over the imports, all included.

pytestmark = [
    # The slow tier: no Ray, but two whole epochs over ~450 MB of images in processes.
    pytest.mark.ray,
    pytest.mark.skipif(
        not os.path.exists("/proc/self/status"), reason="reads /proc/self/status (Linux)"
    ),
]

CHILD = r"""
import json, resource, sys, time, traceback

mode, data_dir, margin_mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
batch_size, shuffle_buffer = int(sys.argv[4]), int(sys.argv[5])

import torch
import ray.train.torch

# Device placement only, and it needs a Ray Train context: the identity on CPU.
ray.train.torch.prepare_data_loader = lambda loader, **options: loader

from ray_ddp.config import TrainConfig
from ray_ddp.image_classification.task import ImageClassification
from ray_ddp.testing.harness import NONE
from ray_ddp.worker.data import build_worker_data
from ray_ddp.worker.identity import Worker


def status_mb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) // 1024


def train_epoch(cfg, task, facts, batches=None):
    # As a worker's run does (worker.builtin_parts): its data, then the epoch from its start.
    data = build_worker_data(cfg, Worker(0, 0, 1, torch.device("cpu")), task, facts, NONE)
    data.train_order.set_position(0, 0)
    rows = count = peak = 0
    for inputs, labels in data.train_loader:
        assert inputs.shape[1:] == (3, 16, 16), inputs.shape
        rows += len(labels)
        count += 1
        peak = max(peak, status_mb("VmData"))
        if count == batches:
            break
    return {"rows": rows, "batches": count, "peak_data_mb": peak}


cfg = TrainConfig(
    dataset="parquet", data_dir=data_dir, parquet_read=mode, image_size=16,
    batch_size=batch_size, num_workers=1, cpus_per_worker=1, shuffle_buffer=shuffle_buffer,
)
task = ImageClassification()
facts = task.describe(cfg)  # the driver's part (labels only), before the limit
out = {"base_data_mb": status_mb("VmData"), "base_size_mb": status_mb("VmSize")}
soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
limit = (out["base_data_mb"] + margin_mb) * 2**20
resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
out["limit_mb"] = limit // 2**20
started = time.perf_counter()
try:
    out.update(ok=True, **train_epoch(cfg, task, facts))
except MemoryError as exc:
    frames = traceback.extract_tb(exc.__traceback__)
    out.update(ok=False, error=type(exc).__name__, where=[f"{f.filename}:{f.name}" for f in frames])
out["seconds"] = time.perf_counter() - started
if not out["ok"]:  # control: without the limit, the same process trains (it was the limit)
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    out["unlimited"] = train_epoch(cfg, task, facts, batches=2)
print("RESULT " + json.dumps(out))
"""


def png(raw: bytes, side: int) -> bytes:
    """An RGB PNG of ``raw`` scanlines (filter byte + pixels each), stored uncompressed."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 0))
        + chunk(b"IEND", b"")
    )


def write_split(folder: str, rows: int, seed: int) -> None:
    """Shards of GROUPS_PER_FILE row groups of distinct noise images (each a different
    window of a random pool, cut at scanline boundaries), no Parquet compression or
    dictionary: what is on disk is what a reader must hold."""
    os.makedirs(folder)
    rng = np.random.default_rng(seed)
    stride = 1 + 3 * SIDE
    size = SIDE * stride
    pool = bytearray(rng.bytes(32 * 2**20 + size))
    pool[::stride] = bytes(len(pool[::stride]))  # every scanline's filter byte: none
    pool = bytes(pool)
    starts = rng.choice((32 * 2**20) // stride, rows, replace=False) * stride
    schema = pa.schema([("image", pa.binary()), ("label", pa.int64())])
    for file_start in range(0, rows, ROWS_PER_GROUP * GROUPS_PER_FILE):
        path = os.path.join(folder, f"part-{file_start // ROWS_PER_GROUP:05d}.parquet")
        with pq.ParquetWriter(path, schema, compression="none", use_dictionary=False) as w:
            end = min(rows, file_start + ROWS_PER_GROUP * GROUPS_PER_FILE)
            for begin in range(file_start, end, ROWS_PER_GROUP):
                group = starts[begin : min(end, begin + ROWS_PER_GROUP)]
                images = [png(pool[s : s + size], SIDE) for s in group]
                labels = rng.integers(0, 10, len(group))
                w.write_table(pa.table({"image": images, "label": labels}, schema=schema))


def split_mb(folder: str) -> float:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / 2**20


def run_child(mode: str, data_dir: str) -> subprocess.Popen:
    args = [mode, data_dir, str(MARGIN_MB), str(BATCH_SIZE), str(SHUFFLE_BUFFER)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def result(proc: subprocess.Popen) -> dict:
    output, _ = proc.communicate(timeout=240)
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, output[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_split_larger_than_the_memory_limit_streams_and_fails_in_memory(tmp_path):
    data_dir = str(tmp_path / "data")
    write_split(os.path.join(data_dir, "train"), TRAIN_ROWS, seed=0)
    write_split(os.path.join(data_dir, "val"), VAL_ROWS, seed=1)
    train_mb = split_mb(os.path.join(data_dir, "train"))
    assert train_mb > 1.4 * MARGIN_MB, train_mb

    # Both at once (2 cores; no timing is asserted).
    children = {mode: run_child(mode, data_dir) for mode in ("stream", "memory")}
    stream, memory = (result(children[mode]) for mode in ("stream", "memory"))

    # Streaming: the whole epoch, every row once, under the limit, with room to spare.
    assert stream["ok"], stream
    assert stream["rows"] == TRAIN_ROWS, stream
    assert stream["peak_data_mb"] <= stream["limit_mb"], stream
    assert stream["peak_data_mb"] - stream["base_data_mb"] < 0.75 * MARGIN_MB, stream

    # In memory: reading the split whole fails for the limit, in the Parquet reader.
    assert not memory["ok"], memory
    assert memory["error"] == "MemoryError", memory
    assert any("image_classification/parquet.py" in frame for frame in memory["where"]), memory[
        "where"
    ]
    # ... and the same process trains in memory mode once the limit is lifted.
    assert memory["unlimited"]["batches"] == 2, memory
