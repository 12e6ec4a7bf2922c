"""Running a training loop of the user's own (``ray_ddp.launch``, ``ray_ddp.main``):
the same driver as ``jobs/train.py`` (checks, the cluster, the TorchTrainer with its
storage, names, failures and elastic range, the summary), with the loop's function in
every worker instead of the built-in loop (``worker.own_loop``); and its Ray Tune sweep
(``ray_ddp.sweep``), the same driver as ``jobs/tune.py`` (``driver.tune``)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from ray_ddp.config import ConfigError, TrainConfig, validate
from ray_ddp.config.sections import Data
from ray_ddp.task.own import OwnLoop
from ray_ddp.testing.harness import Harness


def launch(
    function: Callable[[Any], None],
    config: TrainConfig | None = None,
    *,
    best_metric: str = "loss",
    best_mode: str = "min",
    harness: Harness | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """Run ``function(run)`` in every worker with ``config`` (and any of its fields as
    keywords); returns the summary ``jobs/train.py`` prints (``latest_checkpoint``
    included). ``best_metric``/``best_mode``: the reported ``val_<best_metric>`` that ranks
    checkpoints. ``function`` must be importable by the workers (a module's, or the
    script's own). ``harness``: ray_ddp's own tests' faults."""
    from ray_ddp.driver.run import run_training

    loop = OwnLoop(function, best_metric, best_mode)
    cfg = (config or TrainConfig()).replace(**fields)
    cfg = cfg.replace(task=loop.spec, export=False)
    refuse_unsupported(cfg.data)
    return run_training(cfg, loop, harness)


def refuse_unsupported(data: Data) -> None:
    """What an own loop does not run yet, refused before Ray starts."""
    if data.data_engine != "torch":
        raise ConfigError("--data-engine ray is for the built-in loop; an own loop reads "
                          "its datasets in the global order (--data-engine torch)")  # fmt: skip


def main(
    function: Callable[[Any], None], argv: Sequence[str] | None = None, *,
    best_metric: str = "loss", best_mode: str = "min", **defaults: Any,
) -> int:  # fmt: skip
    """An own loop's command line: ``jobs/train.py``'s flags (``defaults``: the loop's own
    defaults for them), the summary printed and ``--summary-json`` written; returns the
    exit code (``driver.cli.exit_code``)."""
    from ray_ddp.driver.cli import exit_code, train_config, train_parser

    def job() -> None:
        parser = train_parser()
        parser.prog = sys.argv[0] if argv is None else parser.prog
        parser.set_defaults(**defaults)
        cfg = train_config(parser.parse_args(argv))
        validate(cfg)
        from ray_ddp.driver.summary import write_summary
        from ray_ddp.io import reporting

        summary = launch(function, cfg, best_metric=best_metric, best_mode=best_mode)
        print(reporting.summary_text(summary), flush=True)
        if cfg.logging.summary_json:
            write_summary(summary, cfg.logging.summary_json)

    return exit_code(job)


def sweep(
    function: Callable[[Any], None], argv: Sequence[str] | None = None, *,
    best_metric: str = "loss", best_mode: str = "min", **defaults: Any,
) -> int:  # fmt: skip
    """An own loop's Ray Tune sweep over lr and per-worker batch size: ``jobs/tune.py``'s
    command line (``defaults``: the loop's own defaults for its flags), every trial a run
    of ``function`` whose ``run.config.optim`` holds the trial's ``lr`` and
    ``batch_size``; the trials ranked by ``val_<best_metric>`` (``best_mode``). The
    results table printed and ``--summary-json`` written; returns the exit code
    (``driver.cli.exit_code``; 1 where no trial reported a result)."""
    from ray_ddp.driver.cli import exit_code, print_sweep, tune_configs, tune_parser

    def job() -> None:
        parser = tune_parser()
        parser.prog = sys.argv[0] if argv is None else parser.prog
        parser.set_defaults(**defaults)
        cfg, sweep_cfg = tune_configs(parser.parse_args(argv))
        loop = OwnLoop(function, best_metric, best_mode)
        cfg = cfg.replace(task=loop.spec, export=False)
        refuse_unsupported(cfg.data)
        from ray_ddp.driver.tune import run_sweep

        print_sweep(run_sweep(cfg, sweep_cfg, loop), cfg)

    # A sweep in which no trial reported a result raises RuntimeError: the training failed.
    return exit_code(job, failed=(RuntimeError,))
