"""What one fit costs on a Ray that is already up, as the test suite's fits run (one
shared local Ray, fits back to back), and how much of it is Ray Train's own.

    python benchmarks/fit_floor.py                # 5 rounds, about 3 minutes on 2 cores
    python benchmarks/fit_floor.py --rounds 8

Three cases, interleaved round by round on one ``ray.init(num_cpus=2)``:

- ``stock``: Ray's own ``TorchTrainer``, 2 workers, a train function that wraps a
  ``Linear`` with ``prepare_model`` (DDP over gloo) and takes one optimizer step: the least
  a DDP fit through Ray Train does.
- ``lean``: the same train function through ``compat.lean_trainer.LeanTorchTrainer``, the
  trainer ``ray_ddp.fit`` uses (the helper actors a local run does not use left out).
- ``ray_ddp``: ``ray_ddp.fit`` of the smallest real job (small_cnn, 1 epoch of 640
  samples, validation and a checkpoint), as a suite test's fit is.

Each figure is a fit's wall time from the call to its return (median, min-max), and the
suite's share: ``tests`` starts about 80 worker groups (``benchmarks/suite_timeline.py``).
Writes benchmarks/results/fit_floor.md (and .json). Must not share the machine with
another Ray instance.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from common import median_range, write_report  # noqa: E402 - benchmarks/ is on the path
from run import machine  # noqa: E402

SUITE_GROUPS = 80  # worker groups in one whole-suite run (suite_timeline.py, 2026-12-03)
SMALLEST_JOB = {
    "model": "small_cnn",
    "epochs": 1,
    "train_samples": 640,
    "val_samples": 64,
    "batch_size": 32,
    "seed": 3,
    "export": False,
    "tensorboard": False,
    "progress_interval_s": 0,
}


def one_ddp_step(config: dict) -> None:
    """The least a DDP fit does: wrap a layer, one step."""
    import torch
    from ray.train.torch import prepare_model

    model = prepare_model(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()


def fit_once(case: str, storage: str, name: str) -> float:
    """Seconds from the call to the return of one fit of ``case``."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_ddp.compat.lean_trainer import LeanTorchTrainer
    from ray_ddp.driver.run import fit

    start = time.perf_counter()
    if case == "ray_ddp":
        fit(
            "ray_ddp.image_classification:ImageClassification",
            num_workers=2,
            storage_path=storage,
            name=name,
            **SMALLEST_JOB,
        )
    else:
        trainer_cls = TorchTrainer if case == "stock" else LeanTorchTrainer
        trainer_cls(
            one_ddp_step,
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(storage_path=storage, name=name),
        ).fit()
    return time.perf_counter() - start


def report(seconds: dict[str, list[float]], rounds: int, took_s: float) -> str:
    rows = [
        f"| `{case}` | {median_range(values)} "
        f"| {statistics.median(values) * SUITE_GROUPS / 60:.1f} |"
        for case, values in seconds.items()
    ]
    return "\n".join(
        [
            "# What one fit costs on a Ray already up",
            "",
            f"Measured {time.strftime('%Y-%m-%d %H:%M')} with `python benchmarks/fit_floor.py "
            f"--rounds {rounds}` in {took_s / 60:.1f} min: the cases interleaved round by "
            "round on one `ray.init(num_cpus=2)`, 1 s between fits (see the script's docstring "
            "for the cases).",
            "",
            f"- machine: {json.dumps(machine())}",
            "",
            f"| case | s per fit, median (min–max) | minutes for {SUITE_GROUPS} such fits |",
            "|---|---:|---:|",
            *rows,
            "",
            *_ours(seconds),
        ]
    )


def _ours(seconds: dict[str, list[float]]) -> list[str]:
    """ray_ddp's own share of a fit: its real job minus the lean trainer's one DDP step,
    round by round."""
    if not {"lean", "ray_ddp"} <= seconds.keys():
        return []
    extra = [a - b for a, b in zip(seconds["ray_ddp"], seconds["lean"], strict=True)]
    return [
        "ray_ddp's job beyond the lean trainer's one DDP step (its data, 10 steps, "
        f"validation and checkpoint), round by round: {statistics.median(extra):.2f} s "
        f"({min(extra):.2f} to {max(extra):.2f}).",
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", default="stock,lean,ray_ddp")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args()

    import ray

    from ray_ddp.cluster.connect import shutdown

    cases = args.cases.split(",")
    seconds: dict[str, list[float]] = {case: [] for case in cases}
    began = time.perf_counter()
    ray.init(num_cpus=2, logging_level="WARNING")
    try:
        with tempfile.TemporaryDirectory(prefix="fit-floor-") as storage:
            for round_ in range(args.rounds):
                for case in cases:
                    time.sleep(1.0)  # as between two tests: the pool settles
                    seconds[case].append(fit_once(case, storage, f"{case}-{round_}"))
                    print(f"round {round_ + 1}/{args.rounds} {case}: {seconds[case][-1]:.2f} s")
    finally:
        shutdown()  # with any worker hung in its exit (cluster/connect.py)
    took = time.perf_counter() - began
    text = report(seconds, args.rounds, took)
    write_report(args.out, "fit_floor", {"seconds": seconds, "rounds": args.rounds}, text)


if __name__ == "__main__":
    main()
