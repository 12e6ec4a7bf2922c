"""What a Parquet image set costs each training worker in memory, by reader, as it grows.

A generated Parquet image set (96x96 PNG bytes of 10 learnable classes, noisy enough that
PNG hardly compresses them and decoding is real work; ``train/`` is a folder of shards of
several row groups each, ``val/`` likewise) at 1x, 4x and 16x a base size, trained with
``jobs/train.py --dataset parquet`` on 2 CPU workers under each reader:

- ``memory``: ``--parquet-read memory``, every worker reads each split whole (the old way);
- ``stream``: ``--parquet-read stream``, each worker reads its share a few row groups at
  a time (bounded by ``--shuffle-buffer``);
- ``ray``: ``--data-engine ray``, Ray Data reads and decodes on the cluster's CPUs.

For every run: the peak resident memory of each training worker process together with its
DataLoader worker processes (sampled from /proc every ``--sample-s``), the run's samples/s
and its data-wait fraction (from ``--summary-json``). A second part compares the samples/s
of the ray engine, at a fractional ``--cpus-per-worker`` that leaves CPUs to Ray Data,
with the DataLoader path at one size.

    python benchmarks/data_memory.py              # about 20 minutes on 2 cores
    python benchmarks/data_memory.py --quick      # 1x only, a few steps: a harness check

Writes benchmarks/results/data_memory.md, .json and .png. The data is generated once
under ``--work-dir`` (default /tmp/ray_ddp_data_memory) and reused by later runs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import io
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable

# ------------------------------------------------------------------------- the data
SIDE = 96  # stored image side (resized to --image-size for training)
CLASSES = 10
ROWS_PER_GROUP = 512  # train row groups; a shard holds GROUPS_PER_SHARD of them
GROUPS_PER_SHARD = 3
VAL_ROWS_PER_GROUP = 128  # val shards: one eighth of a train shard's rows
BASE_TRAIN_SHARDS = 2  # 1x: 2 train shards (3072 rows, about 80 MB) and 2 val shards
GENERATOR_VERSION = 1  # bump when the data changes, so the cache is rebuilt


def shard_rows(split: str) -> tuple[int, int]:
    """(rows per row group, row groups per shard) of a split's shards."""
    return (ROWS_PER_GROUP if split == "train" else VAL_ROWS_PER_GROUP), GROUPS_PER_SHARD


def make_images(seed: int, count: int) -> tuple[list[bytes], list[int]]:
    """``count`` PNG-encoded 96x96 RGB images and their labels: a sine grating whose
    orientation and tint follow the class, at a random phase and frequency, under strong
    uniform noise (learnable at 32x32, and PNG cannot squeeze the noise out: ~26 KB each)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, count)
    y, x = np.mgrid[0:SIDE, 0:SIDE].astype(np.float32) / SIDE
    angle = np.pi * labels / CLASSES
    phase = rng.uniform(0, 2 * np.pi, count)
    cycles = rng.uniform(2.5, 4.0, count)
    out = []
    for i in range(count):
        wave = 0.5 + 0.5 * np.sin(
            2 * np.pi * cycles[i] * (x * np.cos(angle[i]) + y * np.sin(angle[i])) + phase[i]
        )
        tint = 0.25 + 0.07 * labels[i]
        rgb = np.stack([wave * tint, wave, 1.0 - wave], axis=-1) * 170
        noise = rng.integers(0, 86, (SIDE, SIDE, 3), dtype=np.uint8)
        pixels = rgb.astype(np.uint8) + noise
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
        out.append(buffer.getvalue())
    return out, [int(v) for v in labels]


def write_shard(args: tuple[str, str, int, int]) -> str:
    """One Parquet shard file of GROUPS_PER_SHARD row groups (written one at a time)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, split, index, seed = args
    per_group, groups = shard_rows(split)
    schema = pa.schema([("image", pa.binary()), ("label", pa.int64())])
    tmp = path + ".tmp"
    with pq.ParquetWriter(tmp, schema) as writer:
        for group in range(groups):
            images, labels = make_images(
                seed * 1_000_003 + (0 if split == "train" else 500_000) + index * 97 + group,
                per_group,
            )
            writer.write_table(
                pa.table({"image": images, "label": labels}, schema=schema),
                row_group_size=per_group,
            )
    os.replace(tmp, path)
    return path


def generate(work_dir: str, multiples: list[int], seed: int, processes: int) -> dict[int, str]:
    """The data sets, ``<work>/x<M>/{train,val}/``: hard links to the shards under
    ``<work>/shards`` (1x's shards are 4x's first ones, and so on), generated once; a
    stamp records what was generated so a changed generator or seed starts over."""
    from multiprocessing import Pool

    shards_dir = os.path.join(work_dir, "shards")
    stamp_path = os.path.join(work_dir, "stamp.json")
    stamp = {
        "version": GENERATOR_VERSION, "seed": seed, "side": SIDE,
        "rows_per_group": ROWS_PER_GROUP, "groups_per_shard": GROUPS_PER_SHARD,
        "val_rows_per_group": VAL_ROWS_PER_GROUP,
    }  # fmt: skip
    try:
        with open(stamp_path) as f:
            fresh = json.load(f) != stamp
    except (OSError, ValueError):
        fresh = True
    if fresh:
        shutil.rmtree(work_dir, ignore_errors=True)
    os.makedirs(shards_dir, exist_ok=True)
    with open(stamp_path, "w") as f:
        json.dump(stamp, f)
    most = max(multiples) * BASE_TRAIN_SHARDS
    todo = [
        (os.path.join(shards_dir, f"{split}-{i:05d}.parquet"), split, i, seed)
        for split in ("train", "val")
        for i in range(most)
        if not os.path.exists(os.path.join(shards_dir, f"{split}-{i:05d}.parquet"))
    ]
    if todo:
        started = time.perf_counter()
        print(f"generating {len(todo)} Parquet shards under {shards_dir} ...", flush=True)
        with Pool(processes) as pool:
            for done, _ in enumerate(pool.imap_unordered(write_shard, todo), 1):
                if done % 8 == 0 or done == len(todo):
                    print(f"  {done}/{len(todo)} shards", flush=True)
        print(f"  generated in {time.perf_counter() - started:.0f} s", flush=True)
    dirs = {}
    for m in multiples:
        data_dir = os.path.join(work_dir, f"x{m}")
        for split in ("train", "val"):
            split_dir = os.path.join(data_dir, split)
            os.makedirs(split_dir, exist_ok=True)
            for i in range(m * BASE_TRAIN_SHARDS):
                link = os.path.join(split_dir, f"part-{i:05d}.parquet")
                if not os.path.exists(link):
                    os.link(os.path.join(shards_dir, f"{split}-{i:05d}.parquet"), link)
        dirs[m] = data_dir
    return dirs


def data_facts(data_dir: str) -> dict[str, Any]:
    import pyarrow.parquet as pq

    facts: dict[str, Any] = {}
    for split in ("train", "val"):
        folder = os.path.join(data_dir, split)
        files = sorted(os.listdir(folder))
        rows = groups = size = 0
        for name in files:
            meta = pq.ParquetFile(os.path.join(folder, name)).metadata
            rows += meta.num_rows
            groups += meta.num_row_groups
            size += os.path.getsize(os.path.join(folder, name))
        facts[split] = {"files": len(files), "row_groups": groups, "rows": rows, "mb": size / 2**20}
    return facts


# ------------------------------------------------------------------- memory sampling
TRAIN_WORKER_TITLE = "ray::RayTrainWorker"  # Ray Train's worker actor (ps shows this title)


PAGE = os.sysconf("SC_PAGE_SIZE")


def process_table(pids: Iterable[int] | None = None) -> dict[int, tuple[int, int]]:
    """``pid -> (parent pid, resident bytes)`` of ``pids`` (default: every process), from
    /proc/<pid>/stat; processes that have gone are left out."""
    if pids is None:
        pids = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()  # after "pid (comm) "
        out[pid] = (int(fields[1]), int(fields[21]) * PAGE)  # ppid, rss
    return out


def title(pid: int) -> str:
    """The process's title: argv[0], which Ray sets to ``ray::<actor class>...``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return ""


def pss_bytes(pid: int) -> int:
    """Proportional set size: each resident page divided by the processes that map it, so
    a DataLoader worker's copy-on-write pages shared with its parent count once."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def status_kb(pid: int, *fields: str) -> int:
    """The sum of the named /proc/<pid>/status fields (kB)."""
    total = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.split(":", 1)[0] in fields:
                    total += int(line.split()[1])
    except OSError:
        pass
    return total


class MemorySampler(threading.Thread):
    """Samples every process under ``root_pid`` (the driver: Ray's raylet and its worker
    processes descend from it) every ``period_s``, from /proc.

    A training worker is a process titled ``ray::RayTrainWorker...`` whose parent is not
    (its DataLoader worker processes are forks that keep the title). For each: the peak
    RSS of the process alone, the peak of RSS summed over it and its descendants, and the
    peak of PSS summed likewise (read every ``slow_every`` samples, as it costs a walk of
    the page tables). RSS counts a page shared by a fork in both processes (a DataLoader
    worker forked from a worker that holds the whole split shows the split in its RSS at
    once); PSS divides it between them, so the PSS sum is the memory the tree really
    holds. Also: the peak of both sums over all workers at the same instant, the driver's
    peak RSS, and (every ``slow_every`` samples) the rest of the job: every other
    process's anonymous RSS plus the raylet's shared memory, where the object store
    lives."""

    def __init__(self, root_pid: int, period_s: float = 0.2, slow_every: int = 5) -> None:
        super().__init__(daemon=True)
        self.root_pid = root_pid
        self.period_s = period_s
        self.slow_every = slow_every
        self.stop = threading.Event()
        self.workers: dict[int, dict[str, Any]] = {}
        self.peak: dict[str, float] = {
            "sum_rss_tree": 0, "sum_pss_tree": 0, "driver_rss": 0, "rest_anon_shmem": 0,
        }  # fmt: skip
        self.samples = 0
        self.seen: set[int] = set()
        self.cost_s = 0.0
        self.job: list[int] = []
        self.children: dict[int, list[int]] = {}
        self.names: dict[int, str] = {}

    def run(self) -> None:
        while not self.stop.wait(self.period_s):
            started = time.process_time()
            try:
                self.sample()
            except Exception as exc:  # noqa: BLE001 - processes come and go mid-sample
                print(f"  (memory sample skipped: {exc!r})", flush=True)
            self.cost_s += time.process_time() - started

    def sample(self) -> None:
        slow = self.samples % self.slow_every == 0
        if slow or not self.job:
            # Find the job's processes again (new ones: DataLoader workers, Ray Data's).
            table = process_table()
            if self.root_pid not in table:
                return
            children: dict[int, list[int]] = {}
            for pid, (ppid, _) in table.items():
                children.setdefault(ppid, []).append(pid)
            self.children = children
            self.job = self.tree(self.root_pid)
            self.names = {pid: title(pid) for pid in self.job}
            self.seen.update(self.job)
        else:
            table = process_table(self.job)
            if self.root_pid not in table:
                return
        rss = {pid: table[pid][1] for pid in self.job if pid in table}
        is_worker = {pid: self.names[pid].startswith(TRAIN_WORKER_TITLE) for pid in rss}
        workers = [p for p in rss if is_worker[p] and not is_worker.get(table[p][0], False)]
        in_trees: set[int] = set()
        sum_rss = sum_pss = 0
        for pid in workers:
            members = [m for m in self.tree(pid) if m in rss]
            in_trees.update(members)
            w = self.workers.setdefault(
                pid, {"rss_self": 0, "rss_tree": 0, "pss_tree": 0, "children": set()}
            )
            w["children"].update(m for m in members if m != pid)
            tree_rss = sum(rss[m] for m in members)
            w["rss_self"] = max(w["rss_self"], rss[pid])
            w["rss_tree"] = max(w["rss_tree"], tree_rss)
            sum_rss += tree_rss
            if slow:
                tree_pss = sum(pss_bytes(m) for m in members)
                w["pss_tree"] = max(w["pss_tree"], tree_pss)
                sum_pss += tree_pss
        self.peak["sum_rss_tree"] = max(self.peak["sum_rss_tree"], sum_rss)
        self.peak["driver_rss"] = max(self.peak["driver_rss"], rss.get(self.root_pid, 0))
        if slow:
            self.peak["sum_pss_tree"] = max(self.peak["sum_pss_tree"], sum_pss)
            rest = 0
            for pid in rss:
                if pid in in_trees or pid == self.root_pid:
                    continue
                raylet = "raylet" in self.names[pid]
                fields = ("RssAnon", "RssShmem") if raylet else ("RssAnon",)
                rest += status_kb(pid, *fields) * 1024
            self.peak["rest_anon_shmem"] = max(self.peak["rest_anon_shmem"], rest)
        self.samples += 1

    def tree(self, pid: int) -> list[int]:
        """``pid`` and its descendants, as of the last full scan."""
        out, todo = [], [pid]
        while todo:
            here = todo.pop()
            out.append(here)
            todo.extend(self.children.get(here, []))
        return out

    def figures(self, pid_rank: dict[int, int]) -> dict[str, Any]:
        mb = 2**20
        workers = []
        for pid, w in self.workers.items():
            workers.append(
                {
                    "pid": pid,
                    "rank": pid_rank.get(pid),
                    "rss_self_mb": w["rss_self"] / mb,
                    "rss_tree_mb": w["rss_tree"] / mb,
                    "pss_tree_mb": w["pss_tree"] / mb,
                    "child_processes": len(w["children"]),
                }
            )
        workers.sort(key=lambda w: (w["rank"] is None, w["rank"], w["pid"]))
        return {
            "workers": workers,
            "sum_rss_tree_mb": self.peak["sum_rss_tree"] / mb,
            "sum_pss_tree_mb": self.peak["sum_pss_tree"] / mb,
            "driver_rss_mb": self.peak["driver_rss"] / mb,
            "rest_of_job_mb": self.peak["rest_anon_shmem"] / mb,
            "samples": self.samples,
            "sampler_cpu_s": self.cost_s,
        }


# ------------------------------------------------------------------------- the modes
MODES = {
    "memory": {"flags": ["--parquet-read", "memory"], "label": "torch, --parquet-read memory"},
    "stream": {"flags": ["--parquet-read", "stream"], "label": "torch, --parquet-read stream"},
    "ray": {
        "flags": ["--data-engine", "ray"],
        "label": "--data-engine ray (training worker only; Ray Data's processes not counted)",
    },
}
# What a mode needs beyond its flag: the flags were defined (in ray_ddp/config/train.py) before
# the code that reads them, so a flag in --help alone does not say the mode exists (an
# unimplemented --parquet-read stream silently reads the whole split, as memory does).
MODE_FIELD = {"stream": "parquet_read", "ray": "data_engine"}
FLAG_DEFINITIONS = {"config.py", "cli.py", "flags.py"}


def train_help() -> str:
    proc = subprocess.run(
        [PY, "-m", "jobs.train", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    return proc.stdout


def mode_available(mode: str, help_text: str) -> tuple[bool, str]:
    """(available, why not): the flag is in ``jobs/train.py --help`` and some module of
    ray_ddp other than the flag definitions reads its config field."""
    if mode == "memory":
        return True, ""
    flag = MODES[mode]["flags"][0]
    if flag not in help_text:
        return False, f"`{flag}` is not in `jobs/train.py --help`"
    field = MODE_FIELD[mode]
    package = os.path.join(ROOT, "ray_ddp")
    for name in sorted(os.listdir(package)):
        if name.endswith(".py") and name not in FLAG_DEFINITIONS:
            with open(os.path.join(package, name)) as f:
                if f"{field}" in f.read():
                    return True, ""
    return False, (
        f"`{flag}` is defined but no module of ray_ddp reads `{field}` yet (the "
        "implementation has not landed)"
    )


# --------------------------------------------------------------------------- one run
def train_command(
    mode: str, data_dir: str, args: argparse.Namespace, cpus: float, storage: str, name: str,
    summary: str,
) -> list[str]:  # fmt: skip
    return [
        PY, os.path.join(ROOT, "jobs", "train.py"),
        "--dataset", "parquet", "--data-dir", data_dir, *MODES[mode]["flags"],
        "--num-workers", "2", "--cpus-per-worker", f"{cpus:g}", "--no-gpu",
        "--image-size", str(args.image_size), "--model", args.model,
        "--batch-size", str(args.batch_size), "--epochs", "1000", "--max-steps", str(args.steps),
        "--seed", "0", "--no-export", "--no-tensorboard",
        "--storage-path", storage, "--name", name, "--summary-json", summary,
    ]  # fmt: skip


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONUNBUFFERED="1",
        PYTHONWARNINGS="ignore",
    )
    env.pop("RAY_ADDRESS", None)  # a local Ray of its own, as `python jobs/train.py` starts
    return env


class RunLock:
    """An exclusive flock on ``path`` while a run trains (others start Ray on this machine
    too: a second Ray instance would share the 2 cores and the figures); no-op without."""

    def __init__(self, path: str | None) -> None:
        self.path, self.file = path, None

    def __enter__(self) -> RunLock:
        if self.path:
            self.file = open(self.path, "a")  # noqa: SIM115 - held until __exit__
            fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()


def end_tree(proc: subprocess.Popen, pids: set[int]) -> None:
    """SIGKILL the run: its process group, then every process the sampler saw under it
    (Ray's worker processes have process groups of their own)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def summary_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """From ``--summary-json``: samples/s (steady: ray_ddp's StepTimer leaves out the
    first 10 steps, epoch ends and checkpoints; all workers) and the whole training
    phase's; the data wait (per epoch, the largest fraction of a rank's training time spent
    waiting for the next batch, ``data_wait_max`` in metrics.csv; averaged over the epochs
    weighted by their time); the workers' own peak RSS as ray_ddp reports it."""
    world = summary.get("world_size") or 1
    timing = summary.get("timing") or {}
    steady = timing.get("steady_samples_per_s_per_worker")
    waits = [
        (e["data_wait_max"], e.get("epoch_s") or 1.0)
        for e in summary.get("history") or []
        if e.get("data_wait_max") is not None
    ]
    return {
        "world_size": world,
        "steps": summary.get("steps"),
        "epochs_completed": summary.get("epochs_completed"),
        "samples_per_s": steady * world if steady else None,
        "samples_per_s_run": summary.get("samples_per_s"),
        "step_time_median_s": timing.get("step_time_median_s"),
        "data_wait": sum(w * s for w, s in waits) / sum(s for _, s in waits) if waits else None,
        "ray_ddp_peak_rss_mb": {
            r["rank"]: r["peak_memory_mb"] for r in summary.get("per_rank") or []
        },
        "final_val_acc": (summary.get("final") or {}).get("val_acc"),
    }


def pid_ranks(summary: dict[str, Any]) -> dict[int, int]:
    return {r["pid"]: r["rank"] for r in summary.get("ranks") or [] if "pid" in r}


def run_once(
    mode: str, multiple: int, data_dir: str, cpus: float, repeat: int,
    args: argparse.Namespace, log_dir: str,
) -> dict[str, Any]:  # fmt: skip
    tag = f"{mode}-x{multiple}-cpw{cpus:g}-{repeat}"
    storage = os.path.join(args.work_dir, "runs")
    summary_path = os.path.join(args.work_dir, f"{tag}.json")
    if os.path.exists(summary_path):
        os.remove(summary_path)
    log_path = os.path.join(log_dir, f"{tag}.log")
    cmd = train_command(mode, data_dir, args, cpus, storage, tag, summary_path)
    with RunLock(args.lock), open(log_path, "w") as log:
        load_before = os.getloadavg()[0]
        launch = time.time()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=environment(), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        sampler = MemorySampler(proc.pid, args.sample_s)
        sampler.start()
        try:
            rc: int | str = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            end_tree(proc, sampler.seen)
            rc = f"killed after the {args.timeout:.0f} s timeout"
        wall = time.time() - launch
        sampler.stop.set()
        sampler.join()
        load_after = os.getloadavg()[0]
    shutil.rmtree(os.path.join(storage, tag), ignore_errors=True)
    record: dict[str, Any] = {
        "mode": mode, "multiple": multiple, "cpus_per_worker": cpus, "repeat": repeat,
        "command": " ".join(cmd[1:]).replace(ROOT + os.sep, ""), "wall_s": wall, "rc": rc,
        "log": log_path, "load_average_1min": [load_before, load_after],
    }  # fmt: skip
    summary: dict[str, Any] = {}
    if rc == 0 and os.path.exists(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
        record.update(summary_figures(summary))
    else:
        with open(log_path) as f:
            record["error_tail"] = "".join(f.readlines()[-15:])
    record["memory"] = sampler.figures(pid_ranks(summary))
    return record


# --------------------------------------------------------------------------- summary
def spread(values: list[float | None]) -> dict[str, float] | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    return {"median": statistics.median(present), "min": min(present), "max": max(present)}


def cell_figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One (mode, size) cell over its repeats: medians with min-max."""
    ok = [r for r in records if r["rc"] == 0 and "memory" in r]

    def per_worker(key: str) -> list[float]:  # the larger worker of each run
        return [max((w[key] for w in r["memory"]["workers"]), default=0.0) for r in ok]

    return {
        "runs": len(records),
        "failed": [f"repeat {r['repeat']}: exit {r['rc']}" for r in records if r["rc"] != 0],
        "rss_tree_per_worker_mb": spread(per_worker("rss_tree_mb")),
        "pss_tree_per_worker_mb": spread(per_worker("pss_tree_mb")),
        "rss_self_per_worker_mb": spread(per_worker("rss_self_mb")),
        "child_processes": max(
            (w["child_processes"] for r in ok for w in r["memory"]["workers"]), default=0
        ),  # fmt: skip
        "sum_rss_tree_mb": spread([r["memory"]["sum_rss_tree_mb"] for r in ok]),
        "sum_pss_tree_mb": spread([r["memory"]["sum_pss_tree_mb"] for r in ok]),
        "driver_rss_mb": spread([r["memory"]["driver_rss_mb"] for r in ok]),
        "rest_of_job_mb": spread([r["memory"]["rest_of_job_mb"] for r in ok]),
        "samples_per_s": spread([r.get("samples_per_s") for r in ok]),
        "samples_per_s_run": spread([r.get("samples_per_s_run") for r in ok]),
        "data_wait": spread([r.get("data_wait") for r in ok]),
        "wall_s": spread([r["wall_s"] for r in ok]),
        "sampler_cpu_share": spread([r["memory"]["sampler_cpu_s"] / r["wall_s"] for r in ok]),
    }


def fmt(
    stat: dict[str, float] | None, scale: float = 1.0, digits: int = 0, pct: bool = False
) -> str:
    if not stat:
        return "–"
    med, lo, hi = (stat[k] * scale * (100 if pct else 1) for k in ("median", "min", "max"))
    unit = "%" if pct else ""
    if f"{lo:.{digits}f}" == f"{hi:.{digits}f}":
        return f"{med:.{digits}f}{unit}"
    return f"{med:.{digits}f}{unit} ({lo:.{digits}f}–{hi:.{digits}f})"


def machine() -> dict[str, Any]:
    from importlib.metadata import version

    cpu = platform.machine()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    return {
        "cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_kb / 2**20, 1),
        "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
        **{pkg: version(pkg) for pkg in ("torch", "ray", "pyarrow", "pillow")},
    }  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    a = result["settings"]
    m = result["machine"]
    cells = result["cells"]
    lines = [
        f"# Parquet data: memory per training worker by reader and size ({result['date']})",
        "",
        f"`{result['command']}`, {result['elapsed_s'] / 60:.1f} min. Machine: {m['cpu']}, "
        f"{m['cores']} cores, {m['memory_gib']} GiB, {m['os']}; Python {m['python']}, torch "
        f"{m['torch']}, ray {m['ray']}, pyarrow {m['pyarrow']}, Pillow {m['pillow']}.",
        "",
        "## What ran",
        "",
        f"Generated Parquet image sets ({SIDE}x{SIDE} RGB PNG bytes, ~26 KB a row, 10 classes "
        "told apart by a noisy sine grating's orientation and tint; PNG barely compresses "
        "the noise, and decoding is most of the loader's work). `train/` and `val/` are "
        f"folders of shard files of {GROUPS_PER_SHARD} row groups ({ROWS_PER_GROUP} rows a "
        f"train group, {VAL_ROWS_PER_GROUP} a val group):",
        "",
        "| size | train: files / row groups / rows / MB on disk | val: files / rows / MB |",
        "|---|---|---|",
    ]
    for mult, facts in result["data"].items():
        t, v = facts["train"], facts["val"]
        lines.append(
            f"| {mult}x | {t['files']} / {t['row_groups']} / {t['rows']} / {t['mb']:.0f} | "
            f"{v['files']} / {v['rows']} / {v['mb']:.0f} |"
        )
    lines += [
        "",
        f"Each run: `python jobs/train.py --dataset parquet --data-dir <size> --num-workers 2 "
        f"--no-gpu --model {a['model']} --image-size {a['image_size']} --batch-size "
        f"{a['batch_size']} --max-steps {a['steps']} --epochs 1000 --no-export "
        "--no-tensorboard --summary-json ...` plus the mode's flags:",
        "",
        "| mode | flags | CPUs per worker (Ray) | DataLoader processes per worker |",
        "|---|---|---|---|",
    ]
    for mode in result["modes_run"]:
        cpus = a["ray_cpus"] if mode == "ray" else 1.0
        loaders = (
            "none (Ray Data's own processes)"
            if mode == "ray"
            else "1 for training + 1 for validation (auto: min(4, CPUs per worker); persistent)"
        )
        lines.append(f"| {mode} | `{' '.join(MODES[mode]['flags'])}` | {cpus:g} | {loaders} |")
    for mode, why in result["skipped"].items():
        lines.append(f"| {mode} | skipped: {why} | | |")
    lines += [
        "",
        f"Every {a['steps']} optimizer steps of 2 x {a['batch_size']} samples, so the same "
        "training work at every size (the 1x set is 24 steps an epoch, so its runs cross "
        "epoch ends; the larger ones stop inside the first epoch; every epoch end and the "
        "stop evaluate the whole val split). Ray is local, started by each run, one run at "
        "a time"
        + (f" (under an exclusive lock on `{a['lock']}`)" if a["lock"] else "")
        + ". Repeats: "
        f"{a['repeats']} at 1x (interleaved: each round runs every mode, in a rotated "
        "order), 1 at the larger sizes. Figures with repeats are the median (min–max).",
        "",
        "## How memory is measured",
        "",
        f"A thread of this script reads /proc every {a['sample_s']} s for every process "
        "under the `jobs/train.py` process (Ray's raylet and its worker processes descend "
        f"from it). A training worker is a process titled `{TRAIN_WORKER_TITLE}` "
        "(Ray's Train worker actor, as `ps` shows it) whose parent is not one; its "
        "DataLoader worker processes are its forked children (which keep the title). Per "
        "worker, over the run:",
        "",
        "- **RSS, worker + loaders**: the peak of the resident set summed over the worker "
        "process and its descendants. It counts every page the processes share once per "
        "process: torch's and Ray's libraries, and after fork the parent's whole heap (a "
        "DataLoader worker forked from a process that holds the whole split shows the "
        "split in its own RSS at once), so it over-states what the tree holds;",
        f"- **PSS, worker + loaders**: the peak of the proportional set size summed likewise "
        f"(/proc/<pid>/smaps_rollup, every {a['sample_s'] * 5:g} s as it walks the page "
        "tables): shared pages divided among the processes that map them, so the sum is "
        "what the tree really holds;",
        "- **worker alone**: the peak RSS of the training process only (ray_ddp's own "
        "per-rank `peak_memory_mb`, its ru_maxrss, is in the JSON beside it: it also "
        "catches peaks between two samples);",
        "- the **sum** columns: the peak over time of both workers' trees at the same "
        "instant; **driver**: the `jobs/train.py` process's peak RSS; **rest of Ray**: every "
        "other process of the job (Train's controller and helper actors, Ray's daemons, "
        "Ray Data's workers), anonymous RSS plus the raylet's shared memory (the object "
        "store), peak of the sum.",
        "",
        "The table gives the larger of the two workers (they differ by a few MB). "
        "**samples/s** is ray_ddp's steady figure from `--summary-json` (`timing`: the "
        "first 10 steps, epoch ends and checkpoints left out; both workers); **data wait** "
        "the fraction of training time the slowest-to-feed rank waited for its next batch "
        "(`data_wait_max` per epoch in metrics.csv and the summary's history, averaged "
        "over the epochs by their time).",
        "",
        "## Memory",
        "",
        "| size | mode | RSS, worker + loaders (MB) | PSS, worker + loaders (MB) "
        "| worker alone (MB) | sum of 2 workers: RSS / PSS (MB) | driver (MB) "
        "| rest of Ray (MB) | samples/s | data wait | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, cell in cells.items():
        mode, mult = key.split("@")
        lines.append(
            f"| {mult} | {mode} | {fmt(cell['rss_tree_per_worker_mb'])} | "
            f"{fmt(cell['pss_tree_per_worker_mb'])} | {fmt(cell['rss_self_per_worker_mb'])} | "
            f"{fmt(cell['sum_rss_tree_mb'])} / {fmt(cell['sum_pss_tree_mb'])} | "
            f"{fmt(cell['driver_rss_mb'])} | {fmt(cell['rest_of_job_mb'])} | "
            f"{fmt(cell['samples_per_s'])} | {fmt(cell['data_wait'], digits=1, pct=True)} | "
            f"{fmt(cell['wall_s'])} |"
            + (f" failed: {'; '.join(cell['failed'])}" if cell["failed"] else "")
        )
    lines += ["", "![peak memory per worker](data_memory.png)", "", "## Speed at 1x", ""]
    lines += result["speed_text"]
    if result["notes"]:
        lines += ["", "## Notes", "", *[f"- {n}" for n in result["notes"]]]
    lines += [
        "",
        "## Reproduce",
        "",
        "```bash",
        ".venv/bin/pip install -e .",
        f"flock {a['lock'] or '/tmp/ray_tests.lock'} .venv/bin/python benchmarks/data_memory.py"
        if not a["lock"]
        else ".venv/bin/python benchmarks/data_memory.py --lock " + a["lock"],
        "```",
        "",
        f"The data is generated once under `--work-dir` ({a['work_dir']}; about "
        f"{result['data'][str(max(a['sizes']))]['train']['mb'] * 1.25 / 1024:.1f} GB, a few "
        "minutes on 2 cores) and reused. Each run's log is kept under "
        "`<work-dir>/logs/`; every run's figures are in `data_memory.json`.",
        "",
    ]
    return "\n".join(lines)


def speed_text(result: dict[str, Any]) -> list[str]:
    a = result["settings"]
    rows = [
        "Two CPUs, 2 training workers, the 1x set; the same model, batch and steps in every "
        "mode. What differs is who decodes and what Ray reserves: the DataLoader modes give "
        "each worker 1 CPU (`--cpus-per-worker 1`) and one DataLoader process that decodes "
        "beside it; the ray engine gives each worker "
        f"{a['ray_cpus']:g} CPU (`--cpus-per-worker {a['ray_cpus']:g}`), leaving "
        f"{2 - 2 * a['ray_cpus']:g} of Ray's 2 CPUs to Ray Data's read and decode tasks. "
        "Ray's CPUs are reservations, not pinning: every mode's processes share the same 2 "
        "cores.",
        "",
        "| mode | CPUs per worker | steady samples/s | whole-run samples/s | data wait | wall (s) "
        "| runs |",
        "|---|---|---|---|---|---|---|",
    ]
    base = base_run = None
    for key, cell in result["cells"].items():
        mode, mult = key.split("@")
        if mult != "1x":
            continue
        cpus = a["ray_cpus"] if mode == "ray" else 1.0
        rows.append(
            f"| {mode} | {cpus:g} | {fmt(cell['samples_per_s'])} | "
            f"{fmt(cell['samples_per_s_run'])} | {fmt(cell['data_wait'], digits=1, pct=True)} "
            f"| {fmt(cell['wall_s'])} | {cell['runs']} |"
        )
        if mode == "memory" and cell["samples_per_s"] and cell["samples_per_s_run"]:
            base = cell["samples_per_s"]["median"]
            base_run = cell["samples_per_s_run"]["median"]
    ratios = []
    for key, cell in result["cells"].items():
        mode, mult = key.split("@")
        if mult == "1x" and mode != "memory" and base and cell["samples_per_s"]:
            ratios.append(
                f"{mode} {cell['samples_per_s']['median'] / base:.2f}x steady, "
                f"{cell['samples_per_s_run']['median'] / base_run:.2f}x whole-run"
            )
    if ratios:
        rows += [
            "",
            "Against the in-memory DataLoader path (medians): " + "; ".join(ratios) + ". "
            "Steady figures leave out each epoch's start; the whole-run ones (ray_ddp's "
            "`samples_per_s`: samples over the training phase's time, evaluation excluded) "
            "include it, and the 1x runs start 3 epochs (24 steps each). With a data wait "
            "of a few percent in the DataLoader modes, decoding is not what limits these "
            "runs on 2 cores (the model's steps are), so moving it to Ray Data cannot make "
            "them faster; what it changes is where the memory and the epoch start-up go.",
        ]
    return rows


def chart(result: dict[str, Any], path: str) -> None:
    sys.path.insert(0, ROOT)
    from ray_ddp.io.plots import figure, png_bytes  # matplotlib only, no Ray

    colours = {"memory": "#c44e52", "stream": "#4c72b0", "ray": "#55a868"}
    panels = (
        ("rss_tree_per_worker_mb", "peak RSS per worker + its DataLoader processes (MB)"),
        ("pss_tree_per_worker_mb", "peak PSS per worker + its DataLoader processes (MB)"),
    )
    fig, axes = figure(2, (12, 4.2), sharey=True)
    sizes = {f"{m}x": result["data"][str(m)]["train"]["mb"] for m in result["settings"]["sizes"]}
    for ax, (key, heading) in zip(axes, panels, strict=True):
        for mode in result["modes_run"]:
            xs, meds, lo, hi = [], [], [], []
            for mult, mb in sizes.items():
                stat = result["cells"].get(f"{mode}@{mult}", {}).get(key)
                if stat:
                    xs.append(mb)
                    meds.append(stat["median"])
                    lo.append(stat["median"] - stat["min"])
                    hi.append(stat["max"] - stat["median"])
            if xs:
                ax.errorbar(xs, meds, yerr=[lo, hi], marker="o", capsize=3,
                            color=colours.get(mode), label=MODES[mode]["label"])  # fmt: skip
        ax.set_xscale("log")
        ax.set_xticks(list(sizes.values()), [f"{k}\n{v:.0f} MB" for k, v in sizes.items()])
        ax.minorticks_off()
        ax.set_xlabel("train split (Parquet on disk)")
        ax.set_title(heading, fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"2 CPU training workers, {result['settings']['steps']} steps of 2 x "
        f"{result['settings']['batch_size']} samples ({result['date']})",
        fontsize=10,
    )
    with open(path, "wb") as f:
        f.write(png_bytes(fig, dpi=110))


# ------------------------------------------------------------------------------ main
def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1x only, 1 repeat, 20 steps")
    p.add_argument("--sizes", default="1,4,16", help="multiples of the base size")
    p.add_argument("--modes", default=None, help="comma-separated (default: those available)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds at 1x")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    p.add_argument("--model", default="small_cnn")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--ray-cpus", type=float, default=0.5,
                   help="--cpus-per-worker of the ray engine's runs")  # fmt: skip
    p.add_argument("--sample-s", type=float, default=0.2)
    p.add_argument("--timeout", type=float, default=900, help="per run, seconds")
    p.add_argument("--lock", default=None,
                   help="hold an exclusive flock on this file during each run")  # fmt: skip
    p.add_argument("--work-dir", default="/tmp/ray_ddp_data_memory")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--retries", type=int, default=1, help="runs again a run that fails")
    p.add_argument(
        "--rerun",
        default=None,
        metavar="MODE@Mx,...",
        help="run these cells of the .json under --out again (e.g. stream@16x), keeping the rest",
    )
    p.add_argument("--note", default=None, help="with --rerun: a line for the .md's notes")
    p.add_argument(
        "--render",
        action="store_true",
        help="run nothing: rewrite the .md and .png from the .json under --out",
    )
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    if args.quick:
        args.sizes, args.repeats, args.steps = [1], 1, 20
    return args


def write(result: dict[str, Any], out: str) -> str:
    result["speed_text"] = speed_text(result)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "data_memory.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    text = markdown(result)
    with open(os.path.join(out, "data_memory.md"), "w") as f:
        f.write(text)
    chart(result, os.path.join(out, "data_memory.png"))
    return text


def run_plan(
    plan: list[tuple[str, int, int]], dirs: dict[int, str], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Every run of ``plan``; a run that fails is run once more (``--retries``), and the
    failed attempt is kept, marked ``superseded``."""
    log_dir = os.path.join(args.work_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    records = []
    for i, (mode, mult, rep) in enumerate(plan, 1):
        cpus = args.ray_cpus if mode == "ray" else 1.0
        for attempt in range(1 + args.retries):
            record = run_once(mode, mult, dirs[mult], cpus, rep, args, log_dir)
            record["attempt"] = attempt
            if record["rc"] != 0:  # keep its log beside the next attempt's
                kept = record["log"].replace(".log", f".attempt{attempt}.log")
                os.replace(record["log"], kept)
                record["log"] = kept
            records.append(record)
            mem = record["memory"]
            worst = max((w["rss_tree_mb"] for w in mem["workers"]), default=0)
            worst_pss = max((w["pss_tree_mb"] for w in mem["workers"]), default=0)
            print(
                f"[{i}/{len(plan)}] {mode:>6} {mult:>2}x #{rep}: exit {record['rc']}, "
                f"RSS/worker+loaders {worst:.0f} MB, PSS {worst_pss:.0f} MB, "
                f"{record.get('samples_per_s') or 0:.0f} samples/s, data wait "
                f"{100 * (record.get('data_wait') or 0):.1f}%, {record['wall_s']:.0f} s",
                flush=True,
            )
            if record["rc"] == 0:
                break
            print(record.get("error_tail", ""), flush=True)
            if attempt < args.retries:
                record["superseded"] = True
    return records


def summarize(result: dict[str, Any]) -> None:
    """``cells`` and ``notes`` from ``records`` (superseded attempts left out of cells)."""
    settings, records = result["settings"], result["records"]
    current = [r for r in records if not r.get("superseded")]
    cells = {}
    for mult in settings["sizes"]:
        for mode in result["modes_run"]:
            mine = [r for r in current if r["mode"] == mode and r["multiple"] == mult]
            if mine:
                cells[f"{mode}@{mult}x"] = cell_figures(mine)
    notes = [f"{mode}: not run, {why}." for mode, why in result["skipped"].items()]
    for r in records:
        if r.get("superseded"):
            notes.append(
                f"{r['mode']} at {r['multiple']}x (repeat {r['repeat']}) failed once (exit "
                f"{r['rc']}, log `{r['log']}`) and was run again; the table has the new run."
            )
    notes += result.get("extra_notes", [])
    notes += observations(result, cells)
    big = max(settings["sizes"])
    stream_big = (cells.get(f"stream@{big}x") or {}).get("pss_tree_per_worker_mb")
    memory_big = (cells.get(f"memory@{big}x") or {}).get("pss_tree_per_worker_mb")
    if big > 1 and stream_big and memory_big and stream_big["median"] > 0.8 * memory_big["median"]:
        notes.append(
            f"stream held nearly as much as memory at {big}x: check that --parquet-read "
            "stream reaches the streaming reader."
        )
    share = [c["sampler_cpu_share"]["median"] for c in cells.values() if c["sampler_cpu_share"]]
    if share:
        notes.append(
            f"The sampling thread itself used {100 * statistics.median(share):.1f}% of one core "
            "(median over runs) during the runs."
        )
    result["cells"], result["notes"] = cells, notes


def observations(result: dict[str, Any], cells: dict[str, Any]) -> list[str]:
    """What the table says, in numbers: growth per MB of data by mode, the ray engine's
    data wait, the spread of the runs' machine load."""
    sizes = sorted(result["settings"]["sizes"])
    small, big = f"{sizes[-2] if len(sizes) > 2 else sizes[0]}x", f"{sizes[-1]}x"
    disk = {f"{m}x": f["train"]["mb"] + f["val"]["mb"] for m, f in
            ((int(k), v) for k, v in result["data"].items())}  # fmt: skip
    out = []
    for mode in result["modes_run"]:
        lo = (cells.get(f"{mode}@{small}") or {}).get("pss_tree_per_worker_mb")
        hi = (cells.get(f"{mode}@{big}") or {}).get("pss_tree_per_worker_mb")
        if not (lo and hi) or small == big:
            continue
        slope = (hi["median"] - lo["median"]) / (disk[big] - disk[small])
        out.append(
            f"{mode}: PSS per worker {lo['median']:.0f} MB at {small} and {hi['median']:.0f} MB "
            f"at {big}: {slope:.2f} MB more per MB of Parquet (train + val on disk) added."
        )
    ray = [c for k, c in cells.items() if k.startswith("ray@")]
    if ray and all((c["data_wait"] or {}).get("max", 0) < 0.005 for c in ray):
        out.append(
            "ray: a data wait of 0% is not a measurement of Ray Data's stalls: ray_ddp times "
            "the wait for each batch (`next()` on the loader), and with the Ray Data engine "
            "the wait for an epoch's stream to start falls inside `iter()`, which is not "
            "timed. Compare its whole-run samples/s with the others' instead."
        )
    loads = [r["load_average_1min"] for r in result["records"] if "load_average_1min" in r]
    if loads:
        flat = [x for pair in loads for x in pair]
        out.append(
            f"Machine load (1-minute load average at each run's start and end): "
            f"{min(flat):.1f}-{max(flat):.1f} on 2 cores."
        )
    return out


def rerun(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Run the ``--rerun`` cells (``mode@<M>x``, each repeat it had) again with the saved
    settings; their earlier runs are kept in the JSON, marked superseded."""
    path = os.path.join(args.out, "data_memory.json")
    with open(path) as f:
        result = json.load(f)
    saved = argparse.Namespace(**{**result["settings"], "lock": args.lock, "out": args.out})
    saved.retries = args.retries
    dirs = generate(saved.work_dir, sorted(set([*saved.sizes, 1])), seed=0, processes=2)
    plan = []
    for cell in args.rerun.split(","):
        mode, mult = cell.split("@")
        mult_n = int(mult.rstrip("x"))
        old = [r for r in result["records"] if r["mode"] == mode and r["multiple"] == mult_n]
        for r in old:
            r["superseded"] = True
            if r["rc"] != 0 and os.path.exists(r["log"]) and ".attempt" not in r["log"]:
                kept = r["log"].replace(".log", ".attempt0.log")
                os.replace(r["log"], kept)
                r["log"] = kept
        repeats = sorted({r["repeat"] for r in old}) or [0]
        plan += [(mode, mult_n, rep) for rep in repeats]
    started = time.time()
    result["records"] += run_plan(plan, dirs, saved)
    words = list(argv or sys.argv[1:])
    if "--note" in words:  # the note is in the notes
        words[words.index("--note") + 1 : words.index("--note") + 2] = ["'...'"]
    result["command"] += " && python benchmarks/data_memory.py " + " ".join(words)
    result["elapsed_s"] += time.time() - started
    if args.note:
        result.setdefault("extra_notes", []).append(args.note)
    summarize(result)
    print(write(result, args.out))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.render:
        with open(os.path.join(args.out, "data_memory.json")) as f:
            result = json.load(f)
        summarize(result)
        print(write(result, args.out))
        return 0
    if args.rerun:
        return rerun(args, argv)
    started = time.time()
    dirs = generate(args.work_dir, sorted(set([*args.sizes, 1])), seed=0, processes=2)
    data = {str(m): data_facts(dirs[m]) for m in args.sizes}
    help_text = train_help()
    skipped: dict[str, str] = {}
    modes = []
    for mode in args.modes.split(",") if args.modes else list(MODES):
        ok, why = mode_available(mode, help_text)
        if ok or args.modes:
            modes.append(mode)
        else:
            skipped[mode] = why
            print(f"skipping {mode}: {why}", flush=True)
    plan = []
    for mult in args.sizes:
        rounds = args.repeats if mult == 1 else 1
        for rep in range(rounds):
            shift = rep % len(modes)
            plan += [(mode, mult, rep) for mode in modes[shift:] + modes[:shift]]
    records = run_plan(plan, dirs, args)
    result: dict[str, Any] = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "command": "python benchmarks/data_memory.py " + " ".join(argv or sys.argv[1:]),
        "elapsed_s": time.time() - started,
        "machine": machine(),
        "settings": {**vars(args)},
        "data": data,
        "modes_run": modes,
        "skipped": skipped,
        "records": records,
    }
    summarize(result)
    print(write(result, args.out))
    return 0 if all(r["rc"] == 0 for r in records if not r.get("superseded")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
