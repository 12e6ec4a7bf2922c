"""Command-line flags -> TrainConfig, and the exit codes of the entry scripts.

Exit codes: 0 success, 1 training failed, 2 bad input (flags, data, checkpoint, resources),
each with one line on stderr saying what to change; 130 stopped by Ctrl-C (resumable).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

# Ray reads this once, when it is first imported: every worker prints the same rank-table
# header and restart lines, and deduplication would fold a restarted group's lines away.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

from ray_ddp.config import (
    AMP_MODES,
    DATASETS,
    OPTIMIZERS,
    PLACEMENT_STRATEGIES,
    ConfigError,
    TrainConfig,
)

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
EXIT_INTERRUPTED = 130  # the shell's code for a process stopped by SIGINT


def add_training_arguments(parser: argparse.ArgumentParser, sweep: bool = False) -> None:
    """The flags shared by training and tuning. With ``sweep``, --lr is left out (it is
    swept) and --batch-size becomes the reference batch of --scale-lr."""
    d = TrainConfig()
    g = parser.add_argument_group("scaling (who runs)")
    g.add_argument(
        "--num-workers",
        type=int,
        default=None,
        help="Ray training workers = DDP processes (default: one per GPU in the "
        "cluster, else 2 CPU workers)",
    )
    g.add_argument(
        "--cpus-per-worker",
        type=float,
        default=d.cpus_per_worker,
        help="CPUs reserved per worker (fractions allowed); its torch threads = the whole "
        "part (default: %(default)s)",
    )
    gpu = g.add_mutually_exclusive_group()
    gpu.add_argument(
        "--use-gpu",
        dest="use_gpu",
        action="store_const",
        const=True,
        default=None,
        help="one GPU per worker, NCCL (default: auto, GPUs if the cluster has them)",
    )
    gpu.add_argument(
        "--no-gpu",
        dest="use_gpu",
        action="store_const",
        const=False,
        help="CPU workers on gloo even if GPUs exist",
    )
    g.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join (default: RAY_ADDRESS, else start a local Ray)",
    )
    g.add_argument(
        "--placement-strategy",
        type=str.upper,
        choices=PLACEMENT_STRATEGIES,
        default=d.placement_strategy,
        help="PACK: fill nodes one by one (default); SPREAD: one worker per node first",
    )
    g.add_argument(
        "--max-failures",
        type=int,
        default=d.max_failures,
        help="restart all workers from the latest checkpoint after a lost worker or node, "
        "up to N times (-1: no limit; default: %(default)s)",
    )
    g.add_argument(
        "--wait-for-resources",
        type=float,
        default=d.wait_for_resources,
        metavar="SECONDS",
        help="on an autoscaling cluster, wait this long for nodes to join when the cluster "
        "is smaller than the request (default: refuse at once)",
    )

    g = parser.add_argument_group("optimisation")
    g.add_argument(
        "--epochs", type=int, default=d.epochs, help="total epochs (default: %(default)s)"
    )
    g.add_argument(
        "--batch-size",
        type=int,
        default=d.batch_size,
        help=(
            "reference PER-WORKER batch for --scale-lr (the swept sizes are --batch-sizes)"
            if sweep
            else "PER-WORKER micro-batch size; global batch = batch-size x workers x "
            "accum-steps (default: %(default)s)"
        ),
    )
    g.add_argument(
        "--accum-steps",
        type=int,
        default=d.accum_steps,
        help="micro-batches accumulated per optimizer step (default: %(default)s)",
    )
    if not sweep:
        g.add_argument(
            "--lr", type=float, default=d.lr, help="peak learning rate (default: %(default)s)"
        )
    g.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer)
    g.add_argument("--momentum", type=float, default=d.momentum, help="SGD momentum")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="linear LR warm-up in optimizer steps (default: 5%% of all steps)",
    )
    g.add_argument(
        "--min-lr-ratio",
        type=float,
        default=d.min_lr_ratio,
        help="cosine decay ends at lr x this (default: %(default)s)",
    )
    g.add_argument(
        "--grad-clip",
        type=float,
        default=d.grad_clip,
        help="max global gradient norm, 0 = off (default: %(default)s)",
    )
    g.add_argument(
        "--amp",
        default=d.amp,
        help=f"mixed precision: {', '.join(AMP_MODES)} (fp16 needs GPUs; default: off)",
    )
    g.add_argument("--seed", type=int, default=d.seed, help="weights, data order, built-in data")
    g.add_argument(
        "--max-steps", type=int, default=None, help="stop after this many optimizer steps in total"
    )

    g = parser.add_argument_group("data")
    g.add_argument(
        "--dataset",
        default=d.dataset,
        help=f"one of: {', '.join(DATASETS)} (default: synthetic, built in)",
    )
    g.add_argument("--data-dir", default=None, help="dataset location, readable from every node")
    g.add_argument(
        "--download",
        action="store_true",
        help="let torchvision download cifar10/mnist/fashion-mnist",
    )
    g.add_argument(
        "--train-samples",
        type=int,
        default=None,
        help="built-in: samples to generate (12000); others: a seeded random subset",
    )
    g.add_argument(
        "--val-samples",
        type=int,
        default=None,
        help="built-in: samples to generate (2000); others: a seeded random subset",
    )
    g.add_argument(
        "--image-size",
        type=int,
        default=None,
        help="resize images to this square size (ImageFolder/Parquet default: 32)",
    )
    g.add_argument("--label-column", default=d.label_column, help="Parquet label column")
    g.add_argument("--image-column", default=d.image_column, help="Parquet image-bytes column")
    g.add_argument(
        "--feature-column", default=None, help="Parquet list<float> column (with --model mlp)"
    )
    g.add_argument(
        "--loader-workers",
        type=int,
        default=None,
        help="DataLoader processes per training worker (default: 0 built-in, else "
        "min(4, cpus-per-worker))",
    )
    pin = g.add_mutually_exclusive_group()
    pin.add_argument(
        "--pin-memory",
        dest="pin_memory",
        action="store_const",
        const=True,
        default=None,
        help="pin host memory (default: on with GPUs)",
    )
    pin.add_argument("--no-pin-memory", dest="pin_memory", action="store_const", const=False)
    nhwc = g.add_mutually_exclusive_group()
    nhwc.add_argument(
        "--channels-last",
        dest="channels_last",
        action="store_const",
        const=True,
        default=None,
        help="NHWC memory format (default: on for convolutional models on GPU workers)",
    )
    nhwc.add_argument("--no-channels-last", dest="channels_last", action="store_const", const=False)

    g = parser.add_argument_group("model")
    g.add_argument(
        "--model",
        default=d.model,
        help="small_cnn, mlp, or a torchvision classifier name, e.g. resnet18 "
        "(default: %(default)s)",
    )

    g = parser.add_argument_group("output and checkpoints")
    g.add_argument(
        "--storage-path",
        default=d.storage_path,
        help="local path or s3:// / gs:// URI for runs (default: ./runs)",
    )
    g.add_argument(
        "--name",
        default=None,
        help="run name; re-running an existing name resumes it (default: a new timestamped name)",
    )
    g.add_argument("--resume-from", default=None, help="start from this checkpoint directory")
    if not sweep:
        g.add_argument(
            "--allow-config-change",
            action="store_true",
            help="let a re-run of an existing --name continue it with different training "
            "flags (refused by default)",
        )
    g.add_argument(
        "--keep-checkpoints",
        type=int,
        default=d.keep_checkpoints,
        help="best checkpoints kept by val_acc; the latest is kept too (default: %(default)s)",
    )
    if not sweep:  # Tune's schedulers compare trials at epoch reports only
        g.add_argument(
            "--checkpoint-every",
            type=int,
            default=None,
            metavar="STEPS",
            help="also checkpoint every STEPS optimizer steps inside an epoch (data position "
            "and RNG included: a lost worker or a re-run resumes exactly there)",
        )
    g.add_argument("--summary-json", default=None, help="write the final summary as JSON here")
    g.add_argument(
        "--no-tensorboard",
        dest="tensorboard",
        action="store_false",
        help="no TensorBoard event files (metrics.csv and curves.png are still written)",
    )
    g.add_argument(
        "--log-every-steps",
        type=int,
        default=d.log_every_steps,
        help="TensorBoard: training loss and lr every N optimizer steps (default: %(default)s)",
    )
    g.add_argument(
        "--log-all-ranks",
        action="store_true",
        help="every rank prints its lines, tagged [rank N] (default: rank 0 only)",
    )
    g.add_argument(
        "--no-export",
        dest="export",
        action="store_false",
        help="skip exporting the best checkpoint to <run>/export at the end",
    )
    g.add_argument(
        "--comm-stats",
        action="store_true",
        help="count gradient all-reduces per optimizer step (a DDP comm hook)",
    )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = {k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__}
    return TrainConfig(**values)


def train_main(argv: Sequence[str] | None = None) -> int:
    """``jobs/train.py``: parse, validate, train; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="jobs/train.py",
        description="Distributed data-parallel training on Ray: one worker per GPU (or CPU "
        "workers on gloo), rank-0 checkpoints, resumable by --name.",
    )
    add_training_arguments(parser)
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    if sys.stdout.isatty():
        cfg.progress_interval_s = 5.0

    from ray_ddp import reporting
    from ray_ddp.trainer import Interrupted, run_training, write_summary

    try:
        summary = run_training(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Interrupted as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - Ray wraps worker errors; report and fail
        from ray.train import TrainingFailedError

        if not isinstance(exc, TrainingFailedError):
            raise
        print(f"training failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(reporting.summary_text(summary), flush=True)
    if cfg.summary_json:
        write_summary(summary, cfg.summary_json)
    return EXIT_OK


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers like 32,64,128, got {text!r}"
        ) from None


def tune_main(argv: Sequence[str] | None = None) -> int:
    """``jobs/tune.py``: a Ray Tune sweep over lr and per-worker batch size."""
    from ray_ddp.tune import SweepConfig

    d = SweepConfig()
    parser = argparse.ArgumentParser(
        prog="jobs/tune.py",
        description="Sweep learning rate and per-worker batch size with Ray Tune; every "
        "trial is a full distributed run of the jobs/train.py loop.",
    )
    g = parser.add_argument_group("search space and scheduler")
    g.add_argument("--lr-min", type=float, default=d.lr_min, help="default: %(default)s")
    g.add_argument("--lr-max", type=float, default=d.lr_max, help="default: %(default)s")
    g.add_argument(
        "--batch-sizes",
        type=_int_list,
        default=d.batch_sizes,
        help="per-worker batch sizes to choose from, comma-separated (default: 32,64,128)",
    )
    g.add_argument("--num-samples", type=int, default=d.num_samples, help="trials to run")
    g.add_argument(
        "--max-concurrent-trials",
        type=int,
        default=None,
        help="at most this many trials at once (default: as many as the cluster fits)",
    )
    g.add_argument(
        "--grace-period",
        type=int,
        default=d.grace_period,
        help="ASHA: epochs before a trial can be stopped (default: %(default)s)",
    )
    g.add_argument(
        "--reduction-factor",
        type=float,
        default=d.reduction_factor,
        help="ASHA: keep the top 1/this at each rung (default: %(default)s)",
    )
    g.add_argument(
        "--no-early-stop",
        dest="early_stop",
        action="store_false",
        help="run every trial to the last epoch (no ASHA)",
    )
    g.add_argument(
        "--scale-lr",
        action="store_true",
        help="scale each trial's lr linearly with its global batch, relative to --batch-size",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted sweep --name from --storage-path",
    )
    add_training_arguments(parser, sweep=True)
    args = parser.parse_args(argv)
    sweep = SweepConfig(
        **{k: v for k, v in vars(args).items() if k in SweepConfig.__dataclass_fields__}
    )
    cfg = config_from_args(args)
    cfg.progress_interval_s = 0  # trials interleave: per-epoch lines only

    from ray_ddp.trainer import write_summary
    from ray_ddp.tune import results_table, run_sweep

    try:
        summary = run_sweep(cfg, sweep)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(results_table(summary), flush=True)
    if args.summary_json:
        write_summary(summary, args.summary_json)
    return EXIT_OK


def evaluate_main(argv: Sequence[str] | None = None) -> int:
    """``jobs/evaluate.py``: exact distributed evaluation of a checkpoint."""
    parser = argparse.ArgumentParser(
        prog="jobs/evaluate.py",
        description="Evaluate a checkpoint (local directory or storage URI) with N Ray "
        "workers: loss, accuracy and per-class accuracy, every sample counted once.",
    )
    parser.add_argument("checkpoint", help="a checkpoint directory or URI (…/checkpoint_*)")
    parser.add_argument("--split", default="val", help="val (default) or train")
    parser.add_argument("--num-workers", type=int, default=None)
    parser.add_argument("--cpus-per-worker", type=float, default=None)
    gpu = parser.add_mutually_exclusive_group()
    gpu.add_argument("--use-gpu", dest="use_gpu", action="store_const", const=True)
    gpu.add_argument("--no-gpu", dest="use_gpu", action="store_const", const=False)
    parser.add_argument("--address", default=None)
    parser.add_argument("--data-dir", default=None, help="default: the one it was trained on")
    parser.add_argument("--batch-size", type=int, default=None, help="per worker")
    parser.add_argument("--storage-path", default=None, help="where Ray keeps this run")
    parser.add_argument("--predictions", default=None, help="write predictions to this Parquet")
    parser.add_argument("--summary-json", default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    overrides = {
        key: getattr(args, key)
        for key in (
            "num_workers",
            "cpus_per_worker",
            "use_gpu",
            "address",
            "data_dir",
            "batch_size",
            "storage_path",
        )  # fmt: skip
    }
    overrides["summary_json"] = None

    from ray_ddp.checkpoint_eval import results_text, run_evaluation
    from ray_ddp.trainer import write_summary

    try:
        results = run_evaluation(args.checkpoint, args.split, overrides, args.predictions)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(results_text(results), flush=True)
    if args.summary_json:
        write_summary(results, args.summary_json)
    return EXIT_OK
