"""``--data-engine ray``: Ray Data reads and decodes, on the cluster's CPUs, and streams
batches into each training worker.

The driver side builds nothing until Ray Train starts the workers: the trainer gets a
builder per split (:class:`SplitBuilder`, called by Ray Train's controller), a
:class:`Splits` data config (the training split cut into equal shares, the validation
split into exact ones) and a check that the workers leave CPUs for Ray Data's tasks
(:func:`data_task_cpus`). A split is a small Ray Dataset of *items* (a Parquet split's row
groups, an ImageFolder split's files: the same files, rows and labels the torch engine
reads), then one ``map_batches`` that reads and decodes them with the torch engine's
transforms (:class:`Decode`).

The worker side (:func:`worker_data`) turns its shards into what ``train_epoch`` and
``evaluate`` take: a :class:`StreamOrder` with the interface of
``global_order.GlobalOrderBatches`` (``plan``, ``slots``, ``set_position``) whose slots
are built from the batches Ray delivers, a step at a time, and the loaders that yield them.

What holds in this mode (the README's "Ray Data engine" says it for users):

- every rank trains the same number of rows each epoch (``streaming_split(equal=True)``),
  so the same optimizer steps; the ``N mod world_size`` rows left over (and the
  unreadable ones) are not trained that epoch, and which ones varies;
- each training row at most once per epoch over all ranks; the step's gradient is the
  mean over its samples, whatever the last batch's size;
- the order is shuffled (row groups or files per epoch from ``--seed``, then a buffer of
  ``--shuffle-buffer`` rows) but not reproducible: Ray Data's tasks finish in any order,
  and so does augmentation's draw;
- evaluation is exact: every readable validation row on exactly one rank
  (``streaming_split(equal=False)``);
- a resume starts the epoch again from its first sample (``--checkpoint-every`` is
  refused), with the weights and optimizer of the checkpoint;
- an undecodable image is left out, named (``<file> row <n>``, or the file) in the run's
  ``bad_samples.csv`` and counted against ``--max-bad-samples`` (``ray_ddp.data.unreadable``):
  Ray Data's tasks hand the records to a small named actor (:class:`UnreadableRows`),
  rank 0 takes them at the end of each pass.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
from ray.train import DataConfig

from ray_ddp.reliability.hangs import watchdog as watch
from ray_ddp.config import ConfigError, TrainConfig
from ray_ddp.data.order.global_order import Slot

if TYPE_CHECKING:
    from ray_ddp.data.unreadable import BadSample

# This module is imported (to unpickle a split's Dataset) by Ray Train's controller, its
# DatasetManager and Ray Data's split coordinators: it imports neither torch nor
# torchvision at the top (~10 s on a 2-core machine); the decode tasks import them.

MIN_TASK_CPUS = 0.25
"""The least CPU share Ray Data's read-and-decode tasks may run with; with less left by
the workers the run is refused (Ray Data would wait for CPUs forever)."""
MAX_BLOCKS = 1000
"""Items (row groups, files) are spread over at most this many blocks: the unit Ray Data
shuffles per epoch and hands to its tasks."""
FILES_PER_TASK = 64
"""ImageFolder files one decode call reads."""
ROWS_PER_OUTPUT = 256
"""Decoded rows per output batch of a decode call (bounds Ray Data's block sizes)."""
ACTOR_NAMESPACE = "ray_ddp"


# ---------------------------------------------------------------- items of a split
def split_items(cfg: TrainConfig, split: str) -> tuple[list[dict[str, Any]], Any]:
    """What a split is made of, cheap to list (Parquet footers, a folder listing):
    ``(items, source)`` where ``source`` is the Parquet split's ``SplitLayout`` (its row
    groups are the items) or the ImageFolder split's root."""
    assert cfg.data_dir is not None
    if cfg.dataset == "parquet":
        from ray_ddp.data.parquet import split_path
        from ray_ddp.data.parquet_stream import SplitLayout

        path = split_path(cfg.data_dir, split)
        layout = SplitLayout(path, [cfg.feature_column or cfg.image_column, cfg.label_column])
        return [{"piece": number} for number in range(len(layout.pieces))], layout
    root = os.path.join(cfg.data_dir, split)
    items = [
        {"path": path, "label": label, "index": index}
        for index, (path, label) in enumerate(image_folder_files(root))
    ]
    return items, root


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
"""torchvision's ``IMG_EXTENSIONS`` (0.29), matched without case as it does."""


def image_folder_files(root: str) -> list[tuple[str, int]]:
    """``(path, class index)`` of every image under ``root``'s class folders: the list
    torchvision's ``ImageFolder`` makes (``find_classes`` + ``make_dataset``: sorted class
    folders, each walked in sorted order, links followed), without importing torchvision."""
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    found = []
    for label, name in enumerate(classes):
        for folder, _, names in sorted(os.walk(os.path.join(root, name), followlinks=True)):
            for file in sorted(names):
                if file.lower().endswith(IMAGE_EXTENSIONS):
                    found.append((os.path.join(folder, file), label))
    return found


def split_size(items: list[dict[str, Any]], source: Any) -> int:
    """Rows of a split (a Parquet split's rows, an ImageFolder split's files)."""
    return int(source.size) if hasattr(source, "size") else len(items)


# ---------------------------------------------------------------- decoding (Ray tasks)
class Decode:
    """``map_batches`` function: read and decode a batch of items into ``{"input",
    "label"}`` rows with the torch engine's transform (``image_decoder(cfg, train)``, made
    in the task); rows that cannot be read or decoded (``bad_samples.is_unreadable``) are
    left out and handed to ``report(split, records)``."""

    def __init__(self, source: Any, cfg: TrainConfig, split: str, report: Any) -> None:
        self.source, self.cfg, self.split, self.report = source, cfg, split, report
        self._decode: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_decode": None}  # made where it runs

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        import torch

        from ray_ddp.data.unreadable import BadSample, error_line, is_unreadable

        train = self.split == "train"
        if self._decode is None:
            self._decode = image_decoder(self.cfg, train=train)
        bad: list[BadSample] = []
        with torch.random.fork_rng(devices=[]):
            if train and _augmented(self.cfg):  # a fresh draw per call (not reproducible)
                torch.default_generator.manual_seed(int.from_bytes(os.urandom(8), "little"))
            good: list[tuple] = []
            for index, name, read in self._rows(batch):
                try:
                    good.append(self._decode(*read()))
                except Exception as exc:
                    if not is_unreadable(exc):
                        raise
                    bad.append(BadSample(index, name(), error_line(exc)))
                if len(good) >= ROWS_PER_OUTPUT:
                    yield _stacked(good)
                    good = []
            if good:
                yield _stacked(good)
        if bad and self.report is not None:
            self.report(self.split, bad)

    def _rows(self, batch: dict[str, np.ndarray]) -> Iterator[tuple[int, Any, Any]]:
        """``(index in the split, name(), read())`` per row; ``read()`` gives ``(input,
        label)``, ``name()`` where the row is (``<file> row <n>``, or the file)."""
        if "piece" in batch:  # Parquet: whole row groups
            layout = self.source
            for number in batch["piece"]:
                piece = layout.pieces[int(number)]
                inputs, labels = layout.read(piece)
                for offset, (value, label) in enumerate(zip(inputs, labels, strict=True)):
                    yield (
                        piece.first + offset,
                        lambda p=piece, o=offset: layout.source(p, o),
                        lambda v=value, y=label: (v, y),
                    )
            return
        for path, label, index in zip(batch["path"], batch["label"], batch["index"], strict=True):
            path = str(path)
            yield int(index), lambda p=path: p, lambda p=path, y=int(label): (_read_file(p), y)


def _read_file(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def _stacked(samples: list[tuple]) -> dict[str, np.ndarray]:
    import torch

    return {
        "input": torch.stack([s[0] for s in samples]).numpy(),
        "label": torch.stack([torch.as_tensor(s[1]) for s in samples]).to(torch.int64).numpy(),
    }


def image_decoder(cfg: TrainConfig, train: bool) -> Any:
    """``(input, label) -> (tensor, label tensor)``: the torch engine's decoding."""
    from ray_ddp.data.parquet_stream import decoder
    from ray_ddp.image_classification.transforms import image_transform

    if cfg.feature_column:
        return decoder(False, None)
    return decoder(True, image_transform(cfg, train=train))


# ---------------------------------------------------------------- unreadable rows
class UnreadableRows:
    """Records of rows Ray Data's tasks could not read, per split, until rank 0 takes
    them (a named actor per run: :func:`unreadable_actor`)."""

    def __init__(self) -> None:
        self.rows: dict[str, list[BadSample]] = {"train": [], "val": []}

    def add(self, split: str, records: list[BadSample]) -> None:
        self.rows[split].extend(records)

    def take(self, split: str) -> list[BadSample]:
        rows, self.rows[split] = self.rows[split], []
        return rows


def actor_name(cfg: TrainConfig) -> str:
    return "ray_ddp_unreadable_" + hashlib.sha1(cfg.run_dir.encode()).hexdigest()[:16]


def unreadable_actor(cfg: TrainConfig, create: bool = False):
    """The run's :class:`UnreadableRows` actor (created where ``create``; owned by the
    process that creates it: Ray Train's controller, for the run's length)."""
    if create:
        return (
            ray.remote(UnreadableRows)
            .options(
                name=actor_name(cfg), namespace=ACTOR_NAMESPACE, get_if_exists=True, num_cpus=0
            )
            .remote()
        )
    return ray.get_actor(actor_name(cfg), namespace=ACTOR_NAMESPACE)


class Reporter:
    """``report(split, records)`` for the decode tasks: waits until the actor has them, so
    a pass that has ended has reported all of its rows."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def __call__(self, split: str, records: list[BadSample]) -> None:
        ray.get(self.actor.add.remote(split, records))


# ---------------------------------------------------------------- driver side
class SplitBuilder:
    """What the trainer gets for a split: called by Ray Train's controller when a worker
    group starts (nothing is listed or read on the driver), it returns the split's
    Dataset."""

    def __init__(self, cfg: TrainConfig, split: str, task_cpus: float) -> None:
        self.cfg, self.split, self.task_cpus = cfg, split, task_cpus

    def __call__(self):
        from ray.data import RandomSeedConfig

        cfg, train = self.cfg, self.split == "train"
        items, source = split_items(cfg, self.split)
        decode = Decode(source, cfg, self.split, Reporter(unreadable_actor(cfg, create=True)))
        if train:  # a decode task's process imports torch and torchvision while Train starts
            ray.remote(_warm_up).options(num_cpus=self.task_cpus).remote()
        per_call = 1 if cfg.dataset == "parquet" else FILES_PER_TASK
        blocks = max(1, min(MAX_BLOCKS, math.ceil(len(items) / per_call)))
        ds = ray.data.from_items(items, override_num_blocks=blocks)
        if train:  # a new order of row groups / files every epoch, from --seed
            ds = ds.randomize_block_order(
                seed=RandomSeedConfig(cfg.seed, reseed_after_execution=True)
            )
        ds = ds.map_batches(decode, batch_size=per_call, num_cpus=self.task_cpus)
        ds.context.print_on_execution_start = False  # one line per epoch per split
        ds.context.enable_progress_bars = False
        return ds


def _warm_up() -> None:
    """Imports what the decode tasks use (Ray reuses the process for them)."""
    import ray_ddp.data.parquet_stream  # noqa: F401
    import ray_ddp.image_classification.transforms  # noqa: F401


def _augmented(cfg: TrainConfig) -> bool:
    from ray_ddp.image_classification.transforms import has_random_transform

    return has_random_transform(cfg)


class Splits(DataConfig):
    """Ray Train's split of each dataset over the workers: ``train`` in equal shares
    (every rank the same rows, so the same steps; the remainder is left out), ``val``
    exactly (every row on one rank; the shares may differ by a block)."""

    @staticmethod
    def default_ingest_options():
        """Ray Train's defaults, less ``exclude_resources`` (deprecated in Ray 2.60: its
        own default passes it, and every run would print the deprecation warning)."""
        from ray.data import ExecutionOptions
        from ray.data.context import DataContext

        options = DataContext.get_current().execution_options
        return ExecutionOptions(
            resource_limits=options.resource_limits,
            preserve_order=options.preserve_order,
            verbose_progress=options.verbose_progress,
        )

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        output: list[dict[str, Any]] = [{} for _ in range(world_size)]
        for name, ds in datasets.items():
            if name != "val":
                parts = super().configure(
                    {name: ds}, world_size, worker_handles, worker_node_ids, **kwargs
                )
            else:
                if ds.name is None:
                    ds.set_name(name)
                ds = ds.copy(ds)
                ds.context.execution_options = self.default_ingest_options()
                splits = ds.streaming_split(world_size, equal=False, locality_hints=worker_node_ids)
                parts = [{name: split} for split in splits]
            for mine, part in zip(output, parts, strict=True):
                mine.update(part)
        return output


def data_task_cpus(cfg: TrainConfig, view: Any = None) -> float:
    """The CPUs each of Ray Data's read-and-decode tasks asks for: 1, or what the workers
    leave of the cluster's CPUs where that is less. Refuses (ConfigError) a run whose
    workers leave less than ``MIN_TASK_CPUS``: Ray Data would wait for CPUs forever. On a
    cluster whose autoscaler can add nodes, says so and asks for 1."""
    if view is None:
        from ray_ddp.cluster.resources import read_cluster

        view = read_cluster()
    workers = cfg.num_workers or 0
    held = workers * cfg.cpus_per_worker
    left = view.total("CPU") - held
    if left >= 1:
        return 1.0
    if left >= MIN_TASK_CPUS:
        print(
            f"--data-engine ray: the workers leave {left:g} CPU for Ray Data's reading and "
            "decoding: training may wait for data (lower --cpus-per-worker to leave more)",
            flush=True,
        )
        return round(left, 2)
    total = view.total("CPU")
    if view.node_types:  # an autoscaler can add CPUs for Ray Data's tasks
        print(
            f"--data-engine ray: the workers hold {held:g} of the {total:g} CPUs up; Ray "
            "Data's tasks wait for the autoscaler to add CPUs",
            flush=True,
        )
        return 1.0
    each = math.floor((total - 1) / workers * 100) / 100 if workers else 0
    fix = f"--cpus-per-worker {each:g}" if each >= 0.01 else "fewer workers (--num-workers)"
    raise ConfigError(
        f"--data-engine ray reads and decodes in Ray tasks, which need CPUs the workers do "
        f"not hold: the cluster has {total:g} CPUs and {workers} workers x "
        f"{cfg.cpus_per_worker:g} take {held:g}; use {fix} to leave one for Ray Data, or "
        "add CPUs"
    )


def trainer_datasets(cfg: TrainConfig) -> dict[str, Any]:
    """The TorchTrainer's ``datasets`` and ``dataset_config`` for ``--data-engine ray``
    (a resolved config: workers known, Ray connected). Refuses what cannot run."""
    workers = cfg.num_workers or 1
    per_step = cfg.global_batch_size // cfg.batch_size
    if per_step % workers:
        raise ConfigError(
            f"--data-engine ray needs every worker to train the same micro-batches per step: "
            f"a global batch of {cfg.global_batch_size} makes {per_step} of {cfg.batch_size}, "
            f"which {workers} workers do not share equally"
        )
    cpus = data_task_cpus(cfg)
    return {
        "datasets": {split: SplitBuilder(cfg, split, cpus) for split in ("train", "val")},
        "dataset_config": Splits(),
    }


# ---------------------------------------------------------------- worker side
@dataclass(frozen=True)
class StreamSlot(Slot):
    """A micro-batch of Ray Data's stream: its rows are counted, not indexed."""

    rows: int = 0

    @property
    def size(self) -> int:
        return 0 if self.filler else self.rows


@dataclass(frozen=True)
class StreamPlan:
    """``global_order.EpochPlan``'s interface for a streamed epoch (always from its start)."""

    size: int
    """Training rows of the split (what the epoch's end position is)."""
    batch_size: int
    global_batch: int
    epoch: int
    steps: int
    """Optimizer steps expected (fewer where rows could not be read)."""
    start: int = 0
    first_step: int = 0

    def step_start(self, step: int) -> int:
        """A position for step ``step`` (the epoch's size past its last): a streamed epoch
        is only ever resumed from its start, so this only tells done from not done."""
        return self.size if step >= self.steps else min(self.size - 1, step * self.global_batch)


def expected_steps(size: int, world_size: int, batch_size: int, per_rank: int) -> int:
    """Optimizer steps of an epoch of ``size`` rows cut into equal shares, batches of
    ``batch_size`` (a last batch of one row joins the one before), ``per_rank`` a step."""
    rows = size // world_size
    batches = -(-rows // batch_size)
    if batches > 1 and rows % batch_size == 1:
        batches -= 1
    return -(-batches // per_rank)


class _Slots:
    """An epoch's slots, made as the stream delivers batches; ``len`` is the expected
    count (for the progress line's estimate)."""

    def __init__(self, order: StreamOrder, expected: int) -> None:
        self.order, self.expected = order, expected

    def __iter__(self) -> Iterator[StreamSlot]:
        return self.order._slots()

    def __len__(self) -> int:
        return self.expected


class StreamOrder:
    """``train_epoch``'s order over Ray Data's stream: the interface of
    ``global_order.GlobalOrderBatches``. Each step's batches are fetched before its first
    slot is handed out, so the slots carry the sizes Ray delivered: every rank receives the
    same rows (an equal split), hence the same batches and steps."""

    def __init__(
        self, shard: Any, *, size: int, batch_size: int, global_batch: int, seed: int,
        rank: int, world_size: int, shuffle_buffer: int, pin_memory: bool, take_bad: Any,
    ) -> None:  # fmt: skip
        self.shard, self.size, self.batch_size = shard, size, batch_size
        self.global_batch, self.seed = global_batch, seed
        self.rank, self.world_size = rank, world_size
        self.shuffle_buffer, self.pin_memory, self.take_bad = shuffle_buffer, pin_memory, take_bad
        self.per_rank = global_batch // batch_size // world_size
        self.steps = expected_steps(size, world_size, batch_size, self.per_rank)
        self.ready: deque = deque()
        self.unreadable: list[BadSample] = []
        self.set_position(0, 0)

    def set_position(self, epoch: int, start: int) -> None:
        if start:
            raise ValueError("a Ray Data epoch starts from its first sample")
        self.plan = StreamPlan(self.size, self.batch_size, self.global_batch, epoch, self.steps)
        expected = expected_steps(self.size, self.world_size, self.batch_size, 1)
        self.slots = _Slots(self, expected)

    def describe(self) -> str:
        rows = self.size // self.world_size
        left = self.size - rows * self.world_size
        dropped = f"; {left} of the {self.size} left out each epoch, which varies" if left else ""
        return (
            f"data engine: Ray Data, {rows} rows per worker per epoch (equal shares{dropped}), "
            f"shuffled by row group or file and a {self.shuffle_buffer}-row buffer, not "
            "reproducibly; a resume restarts its epoch"
        )

    def take_unreadable(self) -> list[BadSample]:
        """The training rows the last pass could not read (rank 0; empty elsewhere)."""
        rows, self.unreadable = self.unreadable, []
        return rows

    def _batches(self) -> Iterator[tuple]:
        """This rank's batches of the epoch; a last batch of one row joins the one before
        (BatchNorm cannot train on one)."""
        import torch

        if self.take_bad is not None:
            self.take_bad("train")  # an earlier attempt's, not this pass's
        seed = _words(self.seed, self.plan.epoch, self.rank)
        stream = self.shard.iter_torch_batches(
            batch_size=self.batch_size,
            local_shuffle_buffer_size=max(self.shuffle_buffer, self.batch_size),
            local_shuffle_seed=seed,
            pin_memory=self.pin_memory,
        )
        held: list[tuple] = []
        for item in stream:
            held.append((item["input"], item["label"]))
            if len(held) == 3:
                yield held.pop(0)
        if len(held) == 2 and len(held[1][1]) == 1:
            (x1, y1), (x2, y2) = held
            held = [(torch.cat([x1, x2]), torch.cat([y1, y2]))]
        yield from held
        if self.take_bad is not None:
            self.unreadable += self.take_bad("train")

    def _slots(self) -> Iterator[StreamSlot]:
        from ray_ddp.worker.epoch import WAITING_FOR_DATA

        self.ready.clear()
        batches = self._batches()
        step = 0
        while True:
            # A step's batches are fetched before its first slot (the first: Ray Data starts).
            watch.doing(WAITING_FOR_DATA, slow=step == 0)
            group = list(islice(batches, self.per_rank))
            if not group:
                break
            sizes = [len(labels) for _, labels in group]
            total = sum(sizes) * self.world_size  # every rank's batches are the same sizes
            for turn, (batch, rows) in enumerate(zip(group, sizes, strict=True)):
                self.ready.append(batch)
                yield StreamSlot(
                    indices=[],
                    step=step,
                    micro=turn * self.world_size + self.rank,
                    boundary=turn == len(group) - 1,
                    step_samples=total,
                    rows=rows,
                )
            step += 1


class TrainBatches:
    """The training loader: the batches of the slots ``order`` hands out, in turn."""

    def __init__(self, order: StreamOrder) -> None:
        self.order = order

    def __iter__(self) -> Iterator[tuple]:
        ready = self.order.ready
        while True:
            yield ready.popleft() if ready else None


class EvalBatches:
    """The evaluation loader: this rank's share of the validation split; rank 0 adds the
    rows the pass could not read (as ``bad_samples`` records, which ``evaluate`` counts)."""

    def __init__(self, shard: Any, batch_size: int, pin_memory: bool, take_bad: Any) -> None:
        self.shard, self.batch_size, self.pin_memory = shard, batch_size, pin_memory
        self.take_bad = take_bad

    def __iter__(self) -> Iterator[Any]:
        from ray_ddp.data.unreadable import BATCH, SKIPPED

        if self.take_bad is not None:
            self.take_bad("val")  # an earlier attempt's
        for item in self.shard.iter_torch_batches(
            batch_size=self.batch_size, pin_memory=self.pin_memory
        ):
            yield item["input"], item["label"]
        if self.take_bad is not None:
            bad = self.take_bad("val")
            if bad:
                yield {SKIPPED: bad, BATCH: None}


def _words(seed: int, epoch: int, rank: int) -> int:
    """The local shuffle's seed of (seed, epoch, rank)."""
    return int(np.random.SeedSequence(seed, spawn_key=(3, epoch, rank)).generate_state(1)[0])


def worker_data(cfg: TrainConfig, worker: Any) -> dict[str, Any]:
    """``train_worker.WorkerData``'s fields for this worker: its Ray Data shards (every
    worker calls this: getting a shard is a barrier)."""
    import ray.train

    train_shard = ray.train.get_dataset_shard("train")
    val_shard = ray.train.get_dataset_shard("val")
    sizes = [split_size(*split_items(cfg, split)) for split in ("train", "val")]
    take_bad = None
    if worker.is_main:
        actor = unreadable_actor(cfg)
        take_bad = lambda split: ray.get(actor.take.remote(split))  # noqa: E731
    pin = bool(cfg.pin_memory) if cfg.pin_memory is not None else worker.device.type == "cuda"
    order = StreamOrder(
        train_shard,
        size=sizes[0],
        batch_size=cfg.batch_size,
        global_batch=cfg.global_batch_size,
        seed=cfg.seed,
        rank=worker.rank,
        world_size=worker.world_size,
        shuffle_buffer=cfg.shuffle_buffer,
        pin_memory=pin,
        take_bad=take_bad,
    )
    return {
        "train_loader": TrainBatches(order),
        "train_order": order,
        "val_loader": EvalBatches(val_shard, cfg.batch_size * 2, pin, take_bad),
        "train_size": sizes[0],
        "val_size": sizes[1],
        "steps_per_epoch": order.steps,
        "accumulation": order.per_rank,
    }


def restart_epoch(cfg: TrainConfig, state: Any, worker: Any, steps_per_epoch: int, sums: Any):
    """After a restore: a position inside an epoch (a ``--max-steps`` stop) becomes the
    epoch's start (Ray Data's stream cannot start mid-epoch), and its steps and sums are
    undone. Returns the sums to continue with."""
    from ray_ddp.worker.optim import set_schedule_step
    from ray_ddp.worker.state import EpochSums

    progress = state.progress
    if not progress.sample:
        return sums
    progress.sample = 0
    progress.step = progress.epoch * steps_per_epoch
    set_schedule_step(state.scheduler, progress.step)
    worker.log(
        f"--data-engine ray: epoch {progress.epoch + 1} restarts from its first sample (a "
        f"Ray Data stream cannot resume inside an epoch); the LR schedule goes back to "
        f"step {progress.step}"
    )
    return EpochSums()  # no sample ledger with this engine (the driver refuses one)
