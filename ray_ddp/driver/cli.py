"""The entry points of ``jobs/train.py``, ``jobs/tune.py`` and ``jobs/evaluate.py``.

Each turns argv into an exit code: parse (flags generated from the config dataclasses by
``ray_ddp.config.fields``), refuse bad values before any library import, call the library, print
the result. One wrapper, :func:`exit_code`, maps how a job ended:

    0    success
    1    training failed (a worker error, or a sweep where no trial reported a result)
         or an evaluation stopped by more unreadable samples than --max-bad-samples
    2    bad input (flags, data, checkpoint, resources): one line ``error: ...`` on stderr
         saying what to change; argparse's own errors exit 2 as well
    130  stopped by Ctrl-C (a run resumes with the same flags and --name)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ray_ddp.config import ConfigError, SweepConfig, TrainConfig, validate, validate_sweep
from ray_ddp.config.fields import first_problem
from ray_ddp.config.flags import add_fields, field_parser, from_args

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
EXIT_INTERRUPTED = 130  # the shell's code for a process stopped by SIGINT

# The TrainConfig fields jobs/evaluate.py may change in the config saved in a checkpoint.
EVAL_OVERRIDES = (
    "num_workers", "cpus_per_worker", "use_gpu", "address", "data_dir", "batch_size",
    "storage_path", "task", "max_bad_samples",
)  # fmt: skip
EVAL_HELP = {
    "max_bad_samples": "Unreadable samples the evaluation may skip. Over all workers; each "
    "is named in the summary, --summary-json and --predictions. One more stops it (exit 1) "
    "with a line naming the first of them. 0: stop at the first.",
}


def _raised(exc: BaseException, module: str, name: str) -> bool:
    """``exc`` is a ``module.name``. Looked up, not imported: an instance exists only if
    its module was imported, and a run refused early should not pay for importing Ray."""
    cls = getattr(sys.modules.get(module), name, None)
    return cls is not None and isinstance(exc, cls)


def exit_code(job: Callable[[], None], failed: tuple[type[Exception], ...] = ()) -> int:
    """Run an entry point's ``job``; return its exit code, with one line on stderr if it
    did not succeed. ``failed``: more exception types that mean the training failed."""
    # Ray reads this once, when it is first imported, so it is set before the job imports
    # anything. Every worker prints the same rank-table header and restart lines, and
    # Ray's deduplication would fold them into one. (Set here, not on import of this
    # module: importing a module should not change the process's environment.)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        job()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        # The trainer turns Ctrl-C into Interrupted: Ray's SIGINT handler has already
        # stopped the workers, and the message says how to resume.
        if _raised(exc, "ray_ddp.driver.run", "Interrupted"):
            print(exc, file=sys.stderr)
            return EXIT_INTERRUPTED
        if (
            isinstance(exc, failed)
            or _raised(exc, "ray.train", "TrainingFailedError")
            or _raised(exc, "ray_ddp.driver.run", "TrainingHung")  # the watchdog's line
        ):
            # ray_ddp's own stops in Ray Train's controller (a non-finite loss, too many
            # unreadable samples, a repeated failure) are one line: without Ray's prefix.
            failure = getattr(exc, "controller_failure", None)
            shown = failure if type(failure).__module__.startswith("ray_ddp.") else exc
            print(f"training failed: {shown}", file=sys.stderr)
            return EXIT_FAILED
        raise  # a bug: keep its traceback
    return EXIT_OK


def exit_process(code: int) -> NoReturn:
    """End a job's process with ``code`` now that its work is done: Ray disconnected (a
    Ray started here is stopped with it), logs and output flushed, then ``os._exit``.
    Python's own teardown would spend about a second more freeing torch's and Ray's
    modules (1.3 s measured on 2 cores) with nothing left to do."""
    from ray_ddp.io.timeline import mark

    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            from ray_ddp.cluster.connect import shutdown

            shutdown()  # a Ray started here: with any of its workers left hanging
            mark("Ray shut down")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ----------------------------------------------------------------------------- train
def train_parser() -> argparse.ArgumentParser:
    parser = field_parser(
        prog="jobs/train.py",
        description="Distributed data-parallel training on Ray: one worker per GPU (or CPU "
        "workers on gloo), rank-0 checkpoints, resumable by --name.",
    )
    add_fields(parser, TrainConfig)
    return parser


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of parsed flags; ``--num-workers MIN-MAX`` sets ``min_workers`` and
    ``num_workers`` (the MAX)."""
    if isinstance(args.num_workers, tuple):
        args = argparse.Namespace(**vars(args))
        args.min_workers, args.num_workers = args.num_workers
    return from_args(TrainConfig, args)


def _train(argv: Sequence[str] | None) -> None:
    cfg = train_config(train_parser().parse_args(argv))
    if sys.stdout.isatty():
        cfg = cfg.replace(progress_interval_s=5.0)
    validate(cfg)  # bad flags are refused before torch and Ray are imported

    from ray_ddp.driver.run import run_training
    from ray_ddp.driver.summary import write_summary
    from ray_ddp.io import reporting
    from ray_ddp.io.timeline import mark

    mark("flags parsed")
    summary = run_training(cfg)
    print(reporting.summary_text(summary), flush=True)
    if cfg.logging.summary_json:
        write_summary(summary, cfg.logging.summary_json)
    mark("summary printed")


def train_main(argv: Sequence[str] | None = None) -> int:
    """``jobs/train.py``: parse, validate, train; returns the exit code."""
    return exit_code(lambda: _train(argv))


# ----------------------------------------------------------------------------- tune
def tune_parser() -> argparse.ArgumentParser:
    parser = field_parser(
        prog="jobs/tune.py",
        description="Sweep learning rate and per-worker batch size with Ray Tune; every "
        "trial is a full distributed run of the jobs/train.py loop.",
    )
    add_fields(parser, SweepConfig)
    add_fields(
        parser,
        TrainConfig,
        sweep=True,
        help_text={
            "batch_size": "Reference per-worker batch of --scale-lr (the swept sizes are "
            "--batch-sizes)."
        },
    )
    return parser


def tune_configs(args: argparse.Namespace) -> tuple[TrainConfig, SweepConfig]:
    """The trials' TrainConfig and the SweepConfig of parsed ``tune_parser`` flags, each
    bad value refused (before torch and Ray are imported)."""
    sweep = from_args(SweepConfig, args)
    # Trials interleave their output: per-epoch lines only, no in-epoch progress bars.
    cfg = train_config(args).replace(progress_interval_s=0)
    validate(cfg)
    if cfg.scaling.elastic:
        raise ConfigError(
            "--num-workers MIN-MAX (elastic) is for jobs/train.py; a sweep's trials take a "
            "fixed --num-workers"
        )
    validate_sweep(sweep, cfg)
    return cfg, sweep


def print_sweep(summary: dict[str, Any], cfg: TrainConfig) -> None:
    """A finished sweep's results table, and its summary to ``--summary-json``."""
    from ray_ddp.driver.summary import write_summary
    from ray_ddp.driver.sweep_results import results_table

    print(results_table(summary), flush=True)
    if cfg.logging.summary_json:
        write_summary(summary, cfg.logging.summary_json)


def _tune(argv: Sequence[str] | None) -> None:
    cfg, sweep = tune_configs(tune_parser().parse_args(argv))

    from ray_ddp.driver.tune import run_sweep

    print_sweep(run_sweep(cfg, sweep), cfg)


def tune_main(argv: Sequence[str] | None = None) -> int:
    """``jobs/tune.py``: a Ray Tune sweep over lr and per-worker batch size."""
    # A sweep in which no trial reported a result raises RuntimeError: the training failed.
    return exit_code(lambda: _tune(argv), failed=(RuntimeError,))


# ----------------------------------------------------------------------------- evaluate
def evaluate_parser() -> argparse.ArgumentParser:
    parser = field_parser(
        prog="jobs/evaluate.py",
        description="Evaluate a checkpoint (local directory or storage URI) with N Ray "
        "workers: loss, accuracy and per-class accuracy, every sample counted once.",
        usage="%(prog)s CHECKPOINT [options]",
    )
    parser.add_argument("checkpoint", help="a checkpoint directory or URI (…/checkpoint_*)")
    parser.add_argument("--split", default="val", help="val (default) or train")
    parser.add_argument(
        "--predictions", default=None, metavar="PATH", help="write predictions to this Parquet"
    )
    parser.add_argument(
        "--summary-json", default=None, metavar="PATH", help="write the results as JSON"
    )
    add_fields(
        parser,
        TrainConfig,
        only=EVAL_OVERRIDES,
        overrides="changes to the checkpoint's training config",
        help_text=EVAL_HELP,
    )
    return parser


def _evaluate(argv: Sequence[str] | None, stopped: list[str]) -> None:
    args = evaluate_parser().parse_args(argv)
    overrides = {name: getattr(args, name) for name in EVAL_OVERRIDES}
    if isinstance(overrides["num_workers"], tuple):
        raise ConfigError("jobs/evaluate.py takes a number of workers, not a MIN-MAX range")
    given = {name: value for name, value in overrides.items() if value is not None}
    problem = first_problem(TrainConfig(**given), names=given)
    if problem:  # refused before the checkpoint is loaded
        raise ConfigError(problem)

    from ray_ddp.data.unreadable import BadSamplesError
    from ray_ddp.driver.evaluate import results_text, run_evaluation
    from ray_ddp.driver.summary import write_summary

    try:
        results = run_evaluation(args.checkpoint, args.split, overrides, args.predictions)
    except BadSamplesError as exc:  # over --max-bad-samples: no figures
        stopped.append(str(exc))
        return
    print(results_text(results), flush=True)
    if args.summary_json:
        write_summary(results, args.summary_json)


def evaluate_main(argv: Sequence[str] | None = None) -> int:
    """``jobs/evaluate.py``: exact distributed evaluation of a checkpoint. More unreadable
    samples than ``--max-bad-samples`` end it as a failed training does: exit 1, one line."""
    stopped: list[str] = []
    code = exit_code(lambda: _evaluate(argv, stopped))
    if stopped:
        print(f"evaluation failed: {stopped[0]}", file=sys.stderr)
        return EXIT_FAILED
    return code
