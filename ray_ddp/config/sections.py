"""The sections of a training run's configuration: one typed dataclass per concern, each
field defined once with its flag, help text, limits and whether a re-run may change it
(``option``, ``ray_ddp.config.fields``). A section's ``TITLE`` is its group in ``--help``;
a field's docstring is its help text, written for the person at the command line.
``TrainConfig`` (``ray_ddp.config.train``) is made of them.

No Ray, no torch.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, ClassVar

from ray_ddp.config.fields import NON_NEGATIVE, POSITIVE, Bound, option
from ray_ddp.io.storage import join

PLACEMENT_STRATEGIES = ("PACK", "SPREAD")
STRATEGIES = ("ddp", "fsdp2")
DATASETS = ("synthetic", "cifar10", "mnist", "fashion-mnist", "imagefolder", "parquet")
DATA_ENGINES = ("torch", "ray")
PARQUET_READS = ("stream", "memory")
AMP_MODES = ("off", "bf16", "fp16")
OPTIMIZERS = ("adamw", "sgd")
CHECKPOINT_MODES = ("sync", "async")
TRACKERS = ("none", "mlflow", "wandb")
AUGMENT_POLICIES = ("none", "crop", "crop-flip", "autoaugment", "trivialaugment")
BUILTIN_TASK = "ray_ddp.image_classification:ImageClassification"
# Flags that configure the built-in image classification only: a task of your own builds
# its own data and model, so setting one of them with --task is refused, not ignored.
IMAGE_TASK_FIELDS = (
    "dataset", "image_size", "augment", "label_column", "image_column", "feature_column",
    "model", "parquet_read", "shuffle_buffer", "data_engine",
)  # fmt: skip


def resources_problem(value: Any) -> str | None:
    """What is wrong with a ``resources_per_worker`` value, as one line; None if nothing."""
    example = """e.g. '{"trainer_slot": 1}'"""
    if not isinstance(value, dict) or not value:
        return f"--resources-per-worker must be a JSON object of resource amounts, {example}"
    for name, amount in value.items():
        if name in ("CPU", "GPU"):
            flag = "--cpus-per-worker" if name == "CPU" else "--use-gpu (one GPU per worker)"
            return f"--resources-per-worker: give {name} with {flag}"
        if not isinstance(name, str) or not name.strip():
            return f"--resources-per-worker: resource names must be non-empty strings, {example}"
        if isinstance(amount, bool) or not isinstance(amount, int | float) or not amount > 0:
            return f"--resources-per-worker: {name} must be a positive number, got {amount!r}"
    return None


def parse_resources(text: str) -> dict[str, float]:
    """The ``--resources-per-worker`` flag: a JSON object of resource names to amounts."""

    try:
        value = json.loads(text)
    except ValueError:
        value = None
    problem = resources_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(problem.removeprefix("--resources-per-worker: "))
    return {name: float(amount) for name, amount in value.items()}


def parse_step_range(text: str) -> str:
    """The ``--profile-steps`` flag: ``A-B`` (optimizer steps, 1-based, both included),
    or ``A`` for one step; kept as ``A-B``."""
    low, dash, high = text.strip().partition("-")
    try:
        first, last = int(low), int(high) if dash else int(low)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected optimizer steps A-B like 20-25, got {text!r}"
        ) from None
    return f"{first}-{last}"


def step_range(text: str | None) -> tuple[int, int] | None:
    """``--profile-steps``'s (first, last) step, or None."""
    if not text:
        return None
    first, _, last = text.partition("-")
    return int(first), int(last)


def parse_workers(text: str) -> int | tuple[int, int]:
    """The ``--num-workers`` flag: ``N``, or ``MIN-MAX`` for an elastic run."""

    low, dash, high = text.partition("-")
    try:
        values = (int(low), int(high)) if dash else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of workers or a MIN-MAX range like 2-4, got {text!r}"
        ) from None
    return values


@dataclass
class Scaling:
    """How many workers, on what, where."""

    TITLE: ClassVar[str] = "scaling (who runs)"

    num_workers: int | None = option(
        None, bound=POSITIVE, resume_safe=True, parse=parse_workers, metavar="N|MIN-MAX"
    )
    """Training workers (= DDP processes). Auto: one per GPU up in the cluster, else 2 CPU
    workers. GPU workers on a cluster whose GPU nodes are not up yet: give it. ``MIN-MAX``
    (e.g. ``4-8``): elastic, the run starts on as many as fit, continues on fewer when
    workers are lost (down to MIN) and grows back when room appears, keeping its global
    batch (MAX x --accum-steps micro-batches a step) by changing the accumulation. A count
    that does not divide the micro-batches splits them unevenly (16 on 6 workers: 3 on ranks
    0-3, 2 on ranks 4-5, which wait for them); a range where some count would keep the
    workers under 75% busy is refused, with settings that fix it. A re-run on another count
    continues the same run (same global batch, same data order) where that count x
    --batch-size divides the global batch, else it is refused, naming the counts that do."""
    min_workers: int | None = option(None, bound=POSITIVE, resume_safe=True, cli=False)
    """The fewest workers an elastic run continues on (``--num-workers MIN-MAX`` sets it
    and ``num_workers`` to MAX); None: a fixed number of workers."""
    resize_check_s: float = option(
        60.0, bound=POSITIVE, resume_safe=True, metavar="SECONDS", sweep=False
    )
    """Seconds between tries to grow. An elastic run (``--num-workers MIN-MAX``) looks this
    often, while the group is healthy, for room for more workers. Growing restarts the group
    from the latest checkpoint, so the steps since it are trained again: pair it with
    ``--checkpoint-every``."""
    cpus_per_worker: float = option(1.0, bound=POSITIVE, resume_safe=True)
    """CPUs reserved per worker. Fractions are allowed (e.g. to fit a Tune trial's driver
    beside its workers); the worker's torch thread count is its whole part, at least 1."""
    resources_per_worker: dict[str, float] | None = option(
        None, parse=parse_resources, metavar="JSON", resume_safe=True
    )
    """Other Ray resources per worker, as JSON. Those each worker needs besides its CPUs and
    GPU: a custom resource some nodes advertise (``'{"trainer_slot": 1}'``) or a GPU model
    (``'{"accelerator_type:A100": 0.001}'``). Workers are placed only on nodes that have
    them, and an autoscaler is asked for such nodes."""
    use_gpu: bool | None = option(None, negative="--no-gpu", resume_safe=True)
    """One GPU per worker, on NCCL. Off: CPU workers on gloo even if GPUs exist. Auto: GPU
    workers if GPUs are up, or if the cluster's autoscaler has a node type with GPUs (then
    give --num-workers and --wait-for-resources: the GPU nodes are asked for and waited
    for); else CPU workers, and on a cluster a line says why. On an autoscaling cluster
    whose node types this driver cannot see, --use-gpu asks for GPU nodes."""
    strategy: str = option("ddp", choices=STRATEGIES)
    """How the workers share the model. ``ddp``: every worker holds the whole
    model, its gradients and optimizer state (fastest while they fit on one GPU).
    ``fsdp2``: PyTorch's ``fully_shard``: each worker holds 1/N of them and gathers a
    block's parameters only while computing it, for models larger than one GPU;
    checkpoints are sharded (every worker writes its part) and resume at any worker
    count. See docs/fsdp2.md."""
    address: str | None = option(None, resume_safe=True)
    """Ray cluster address to join. Else RAY_ADDRESS, else a local Ray is started."""
    placement_strategy: str = option(
        "PACK", choices=PLACEMENT_STRATEGIES, parse=str.upper, resume_safe=True
    )
    """How workers are placed on nodes. ``PACK`` fills a node's GPUs/CPUs before the next
    (fast intra-node all-reduce); ``SPREAD`` puts workers on as many nodes as it can."""
    wait_for_resources: float = option(0.0, bound=NON_NEGATIVE, metavar="SECONDS", resume_safe=True)
    """Seconds to wait for nodes. When the nodes up cannot hold the workers, the
    cluster's autoscaler is asked for one worker's resources per worker (and the request
    is withdrawn when the wait ends), with a progress line every 10 s. 0: refuse at once,
    with what was asked and what exists. A request no node (up, or of a node type the
    autoscaler may start) can hold is refused at once whatever this says."""

    @property
    def worker_range(self) -> tuple[int, int]:
        """The fewest and the most workers (equal unless elastic; needs num_workers)."""
        if self.num_workers is None:
            raise ValueError("num_workers is not resolved yet")
        return (self.min_workers or self.num_workers, self.num_workers)

    @property
    def elastic(self) -> bool:
        """A MIN-MAX range of workers (``--num-workers MIN-MAX`` with MIN < MAX)."""
        return self.min_workers is not None and self.min_workers != self.num_workers


@dataclass
class Reliability:
    """What a lost worker, a failure or a hang does to the run."""

    TITLE: ClassVar[str] = "failures and hangs"

    max_failures: int | None = option(
        None, bound=Bound("must be -1 (no limit) or more", lambda v: v >= -1), resume_safe=True
    )
    """Restarts after a lost worker. After a worker or node is lost, all workers restart
    from the latest checkpoint, up to this many times (-1: without limit). Auto: 0 with a
    fixed number of workers; -1 for an elastic run (``--num-workers MIN-MAX``), whose lost
    workers are what it is for (a failure that repeats itself identically still stops
    it)."""
    preemption_check_steps: int = option(10, bound=NON_NEGATIVE, resume_safe=True, metavar="STEPS")
    """Steps between spot-reclaim checks. Every this many optimizer steps, ask Ray
    whether a node of the run is about to be
    reclaimed (a spot instance's notice; Ray 2.60): on a notice, checkpoint at that step,
    train on to the last step whose checkpoint is done before the deadline, checkpoint
    there and hold until the node goes; the restart resumes there (counted under Ray's own
    preemption retries where the node goes at its deadline, else --max-failures). Each ask
    is a barrier of every worker (a few ms). 0: never ask."""

    hang_timeout: float | None = option(
        None, bound=NON_NEGATIVE, resume_safe=True, metavar="SECONDS"
    )
    """Seconds a rank may stall. A rank that finishes no optimizer step or evaluation batch
    in this long is hung: every rank's stacks go to ``<run>/hangs/attempt-<N>/``, the driver
    names the stuck rank, and the attempt fails (``--max-failures`` restarts it from the
    latest checkpoint). Auto: 20 x the median step time, at least 120 s and at most
    ``--hang-grace``. 0 turns the watchdog off."""
    hang_grace: float = option(600.0, bound=POSITIVE, resume_safe=True, metavar="SECONDS")
    """Seconds slow phases may take. The hang watchdog's allowance for what is slow by
    nature: an attempt's start and first
    step, the first batch of each pass over a loader, checkpoints and reports (at least
    ``--hang-timeout``). The process group's timeout, the backstop where the watchdog
    cannot run, is 2 x this + 60 s."""


@dataclass
class Optimisation:
    """What each optimizer step does and how many there are."""

    TITLE: ClassVar[str] = "optimisation"

    epochs: int = option(10, bound=POSITIVE, resume_safe=True)
    """Total epochs of the run. A resumed run continues up to this number."""
    batch_size: int = option(64, bound=POSITIVE)
    """Per-worker micro-batch size. Samples per forward pass on one worker."""
    accum_steps: int = option(1, bound=POSITIVE, resume_safe=True)
    """Micro-batches per optimizer step. Their gradients are accumulated; global batch =
    batch_size x num_workers x accum_steps (with MIN-MAX workers: at MAX; fewer workers
    accumulate more to keep it)."""
    lr: float = option(3e-3, bound=POSITIVE, sweep=False)
    """Peak learning rate. It is reached after warm-up, then decays (cosine) to
    ``min_lr_ratio``."""
    optimizer: str = option("adamw", choices=OPTIMIZERS)
    """``adamw``, or ``sgd`` with momentum. SGD's momentum is not Nesterov's."""
    momentum: float = option(0.9, bound=Bound("must be in [0, 1)", lambda v: 0 <= v < 1))
    """SGD momentum (ignored by AdamW)."""
    weight_decay: float = option(0.01, bound=NON_NEGATIVE)
    """Weight decay. Decoupled (AdamW) or an L2 penalty (SGD)."""
    warmup_steps: int | None = option(None, bound=NON_NEGATIVE)
    """Linear warm-up, in optimizer steps. Auto: 5% of all steps."""
    min_lr_ratio: float = option(0.01, bound=Bound("must be in [0, 1]", lambda v: 0 <= v <= 1))
    """Cosine decay ends at lr x this. The schedule ends at ``lr * min_lr_ratio``."""
    grad_clip: float = option(1.0, bound=NON_NEGATIVE)
    """Clip the global gradient norm to this. Clipped after un-scaling under fp16; 0 turns
    it off."""
    amp: str = option("off", choices=AMP_MODES)
    """Mixed precision. ``off``, ``bf16`` (autocast, no scaler) or ``fp16`` (GPU only,
    autocast + GradScaler)."""
    seed: int = option(0, bound=Bound("must be in 0..2**63-1", lambda v: 0 <= v < 2**63))
    """One seed for weights and data. The initial weights (identical on every rank), the
    data order and the built-in dataset."""
    max_steps: int | None = option(None, bound=POSITIVE, resume_safe=True)
    """Stop after this many optimizer steps in total. With a checkpoint there (smoke tests,
    benchmarks). It stops the run and does not reshape it: the LR schedule still spans
    --epochs, so a re-run without it continues as if the run had never stopped."""


@dataclass
class Target:
    """What is trained: the task, and the built-in task's model."""

    TITLE: ClassVar[str] = "task and model (what is trained)"

    task: str = option(BUILTIN_TASK, metavar="MODULE:NAME", shown="built-in")
    """What to train: a ``ray_ddp.Task``. As ``package.module:Name`` of a ``Task`` subclass
    or instance: your model, data, loss and metrics (see docs/tasks.md). The default
    is the built-in image classification, which the data and model flags below configure."""
    model: str = "small_resnet"
    """The built-in task's model. ``small_resnet`` (a small ResNet with BatchNorm, fast on
    CPU, good on small real image sets), ``small_cnn`` (three convolutions, no
    normalisation), ``mlp``, or any torchvision classification model name (e.g.
    ``resnet18``), built with the dataset's class count and no pretrained weights."""

    compile: bool = option(False, resume_safe=True)
    """torch.compile the model (TorchInductor). It is compiled after DDP wraps it, as DDP
    expects: its
    graph is split at the gradient buckets so the all-reduces still overlap the backward.
    The first steps take longer (the compile); checkpoints hold the plain model's weights
    and load with or without it."""


@dataclass
class Data:
    """The built-in task's data, and how every task's data is read."""

    TITLE: ClassVar[str] = "data"

    dataset: str = option("synthetic", choices=DATASETS)
    """The built-in task's dataset. ``synthetic`` (built in, generated from the seed),
    ``cifar10``, ``mnist``, ``fashion-mnist``, ``imagefolder`` (train/ and val/ class
    folders) or ``parquet``."""
    data_dir: str | None = option(None, metavar="DIR")
    """Where the dataset lives. It must be readable from every node."""
    download: bool = option(False, resume_safe=True)
    """Let the task fetch its data into ``data_dir``. The built-in one fetches torchvision's
    cifar10, mnist, fashion-mnist: once per node, the first node before the others, so nodes
    sharing one ``data_dir`` (NFS) never write it at the same time."""
    train_samples: int | None = option(None, bound=POSITIVE)
    """Training samples to use. Built-in dataset: samples to generate (default 12000).
    Others: a seeded random subset of this size (default: all)."""
    val_samples: int | None = option(None, bound=POSITIVE)
    """Validation samples to use. Like ``train_samples`` for the validation split (built-in
    default 2000)."""
    image_size: int | None = option(None, bound=POSITIVE)
    """Resize images to this square size. Default: native for built-in, CIFAR and MNIST
    data; 32 for ImageFolder and Parquet images."""
    augment: str | None = option(None, choices=AUGMENT_POLICIES)
    """Augmentation of training images. Random, drawn per sample from (seed, epoch, index):
    ``none``; ``crop`` (pad by 1/8 of the side, crop back at a random place: small shifts);
    ``crop-flip`` (crop, and a horizontal flip half the time); ``autoaugment`` (crop-flip,
    then AutoAugment's CIFAR-10 policy); ``trivialaugment`` (crop-flip, then
    TrivialAugmentWide). Auto: crop-flip for cifar10 and imagefolder, none for mnist,
    fashion-mnist and parquet. Flips are wrong for digits and text: use crop or none there.
    The built-in dataset and Parquet feature columns take none."""
    label_column: str = option("label", metavar="COLUMN")
    """Parquet: the integer class column."""
    image_column: str = option("image", metavar="COLUMN")
    """Parquet: the image column. Encoded image bytes (PNG/JPEG), or a struct with a
    ``bytes`` field as Hugging Face writes it."""
    feature_column: str | None = option(None, metavar="COLUMN")
    """Parquet: a list<float> column instead of images. A feature column; it needs ``--model
    mlp``."""
    parquet_read: str = option("stream", choices=PARQUET_READS)
    """How Parquet is read. With ``--data-engine torch``: ``stream`` reads each worker's
    share a few row groups at a time (memory bounded by ``--shuffle-buffer``, not the
    dataset's size; local files, folders of shards, s3:// and gs:// URIs); ``memory`` reads
    each split whole into every worker (the old way: fast for small data, one copy per
    worker)."""
    shuffle_buffer: int = option(2048, bound=POSITIVE)
    """Rows shuffled together. In streamed Parquet, each epoch permutes the row groups, then
    each run of this many rows is permuted; a larger buffer is closer to a full shuffle and
    holds more rows in memory (see docs/data.md, "Data larger than memory")."""
    data_engine: str = option("torch", choices=DATA_ENGINES)
    """Who reads and decodes. ``torch`` (DataLoader worker processes beside each training
    worker) or ``ray`` (Ray Data: read and decode on the cluster's CPUs, CPU-only nodes
    included, streamed into each worker; Parquet and ImageFolder data)."""
    max_bad_samples: int = option(100, bound=NON_NEGATIVE, resume_safe=True)
    """Unreadable samples an epoch may skip, over all workers. Each (a truncated image file,
    undecodable bytes in a Parquet row) is named in ``bad_samples.csv`` in the run. One more
    stops the run with a line naming the first of them. 0: stop at the first."""
    loader_workers: int | None = option(None, bound=NON_NEGATIVE, resume_safe=True)
    """DataLoader processes per worker. DataLoader worker processes beside each training
    worker. Auto: 0 for the in-memory built-in
    dataset, else min(4, cpus_per_worker)."""
    channels_last: bool | None = None
    """NHWC memory for convolutions. Conv weights and image batches in NHWC (channels_last)
    memory, which GPU tensor cores want. Auto: on for convolutional models on image data on
    GPU workers (ResNet-50 on an H200 with AMP: about 1.9x the samples/s); off on CPU, where
    2 DDP workers of the small CNN measured no faster with it."""
    pin_memory: bool | None = option(None, resume_safe=True)
    """Pin host memory for GPU copies. Pinned memory makes host-to-GPU copies faster.
    Auto: on with GPUs."""


@dataclass
class Checkpointing:
    """Where the run lives, what it resumes from, what it keeps."""

    TITLE: ClassVar[str] = "output and checkpoints"

    storage_path: str = option("runs", resume_safe=True, metavar="PATH")
    """Where runs are stored. A local path (absolute or relative) or a pyarrow URI
    (``s3://``, ``gs://``)."""
    name: str | None = option(None, resume_safe=True)
    """Run name. Re-running an existing name resumes it from its latest checkpoint. Auto:
    ``<dataset>-<model>-<timestamp>`` (always a fresh run)."""
    allow_config_change: bool = option(False, resume_safe=True, sweep=False)
    """Let a re-run change the training config. Without it, a re-run of an
    existing ``--name`` with a different training config (model, data, batch, optimizer,
    ...) is refused."""
    resume_from: str | None = option(None, resume_safe=True, metavar="DIR")
    """Start from this checkpoint directory. Its weights, optimizer, schedule and
    progress."""
    restart_epoch: bool = option(False, resume_safe=True, sweep=False)
    """Start over an epoch whose order changed. A checkpoint inside an epoch whose order no
    longer names the same samples (the
    training files changed; or, for streamed Parquet, --batch-size, the global batch or
    --shuffle-buffer did) is refused; this starts that epoch over instead, undoing its
    steps."""
    keep_checkpoints: int = option(2, bound=POSITIVE, resume_safe=True)
    """Best checkpoints to keep. The best by validation accuracy; the
    latest is always kept as well."""
    checkpoint_every: int | None = option(
        None, bound=POSITIVE, resume_safe=True, metavar="STEPS", sweep=False
    )
    """Also checkpoint every this many optimizer steps. Inside an epoch, with the data
    position (in samples of the epoch's order), so a lost worker, a re-run or a resized
    elastic group resumes mid-epoch exactly where it stopped, at any number of workers.
    Off by default: every epoch's end is checkpointed anyway. (Not in sweeps: Tune's
    schedulers compare trials at epoch ends only.)"""
    checkpoint_mode: str = option("async", choices=CHECKPOINT_MODES, resume_safe=True)
    """How checkpoints are written. ``async``: training waits only for a copy of the state
    in host memory (one state's size, reused); Ray's upload thread writes and uploads it and
    registers it once complete. At most one upload in flight: the next checkpoint waits for
    it. Needs Ray 2.60 (sync otherwise, said once). ``sync``: every worker waits while rank
    0 writes a checkpoint and Ray uploads it."""
    export: bool = option(True, resume_safe=True)
    """Export the best checkpoint at the end. To ``<run>/export``, for use without Ray: a
    plain state_dict and a torch.export program."""

    @property
    def run_dir(self) -> str:
        """``<storage_path>/<name>``: where the run's checkpoints, logs and records live (a
        local path or a URI)."""
        return join(self.storage_path, self.name or "")


@dataclass
class Logging:
    """What the run prints and writes besides checkpoints."""

    TITLE: ClassVar[str] = "logs and reports"

    summary_json: str | None = option(None, resume_safe=True, metavar="PATH")
    """Write the final summary as JSON to this path."""
    progress_interval_s: float = option(30.0, resume_safe=True, cli=False)
    """Seconds between rank 0's in-epoch progress lines (a text bar with loss, speed and
    ETA); the CLI uses 5 when attached to a terminal, 0 in sweeps. 0 turns them off."""
    tensorboard: bool = option(True, resume_safe=True)
    """Rank 0 writes TensorBoard event files. To ``<run>/tensorboard``, besides metrics.csv
    and curves.png."""
    log_every_steps: int = option(50, bound=POSITIVE, resume_safe=True)
    """Steps between loss and lr logs. The training loss and lr go to TensorBoard
    (and a tracker) every this many optimizer steps."""
    log_all_ranks: bool = option(False, resume_safe=True)
    """Every rank prints its lines, not only rank 0. Each tagged ``[rank N]``."""
    comm_stats: bool = option(False, resume_safe=True)
    """Count and report gradient all-reduces. With a DDP communication hook, per optimizer
    step (a check that accumulation really skips the all-reduce)."""

    tracking: str = option("none", choices=TRACKERS, resume_safe=True)
    """Also log the run to a tracker. An experiment tracker: ``mlflow`` (``pip install -e
    '.[mlflow]'``) or ``wandb`` (``'.[wandb]'``). Rank 0 logs the resolved config as
    params, the training loss, lr and speed every --log-every-steps optimizer steps and
    each epoch's metrics (the optimizer step as the tracker's step), and the driver adds
    curves.png, metrics.csv, the summary and any profiles at the end. A re-run of the same
    --name, or a restart after a failure, continues the same tracker run. Logging runs in
    a background thread: a tracker that is down or slow is retried, said once, and never
    stops or slows training. See docs/tracking.md."""
    tracking_uri: str | None = option(None, resume_safe=True, metavar="URI")
    """MLflow: the tracking server. One every worker can reach (``http://host:5000``,
    ``databricks``). Auto: MLFLOW_TRACKING_URI (one of them is needed). W&B reads its
    server from WANDB_BASE_URL and WANDB_MODE instead."""
    experiment: str | None = option(None, resume_safe=True)
    """MLflow experiment / W&B project. The run's, created if missing. Auto:
    MLFLOW_EXPERIMENT_NAME or WANDB_PROJECT, else ``ray_ddp``."""
    profile_steps: str | None = option(
        None, parse=parse_step_range, resume_safe=True, metavar="A-B"
    )
    """Profile optimizer steps A to B with torch.profiler. Steps 1-based, counted over the
    run, on every rank: CPU (and CUDA) activity with shapes and memory, after one warm-up
    step. One Chrome/Perfetto trace per rank goes to ``<run>/profiles/attempt-<N>/`` (open
    it in https://ui.perfetto.dev), with a CUDA memory snapshot on GPUs, and to the tracker
    when --tracking is on; the driver prints rank 0's top operators by self time."""

    # set by the code, not by a flag
    log_prefix: str = option("", resume_safe=True, cli=False)
    """A Tune trial's tag for its rank-0 lines (trials interleave in one output)."""
