"""What an own loop costs against the built-in loop: the default job (``jobs/train.py``'s
defaults: 2 CPU workers on gloo, small_resnet on the built-in 12000 samples, batch 64 per
worker, AdamW with the default warm-up + cosine schedule and gradient clipping) run by the
built-in loop (``fit``) and written as an own loop (:func:`_train` below, over
``ray_ddp.Run``'s verbs: the same model, data, global order, optimizer, schedule, clipping
and validation), interleaved on one local Ray, which goes first alternating pair by pair.
The figure is each run's steady samples/s per worker (``StepTimer``: warm-up, epoch ends
and checkpoints left out), compared pair by pair (own / built-in), and what it means per
optimizer step: the own loop's milliseconds less the built-in loop's, pair by pair. With
``--model mlp`` a step is little more than the loop itself, so that difference is the
loop's own cost measured where it is largest against the step.

    python benchmarks/own_loop_overhead.py            # 5 pairs of 1 epoch: ~9 min on 2 cores
    python benchmarks/own_loop_overhead.py --model mlp --pairs 12 --stem own_loop_overhead_mlp

Writes benchmarks/results/own_loop_overhead.md (and .json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "benchmarks")):
    if path not in sys.path:
        sys.path.insert(0, path)

from common import (  # noqa: E402 - benchmarks/ is on the path
    arms_in_turn,
    interval_line,
    median_interval,
    paired_figures,
    paired_table,
    write_report,
)

TASK = "ray_ddp.image_classification:ImageClassification"
RUN = {"export": False, "progress_interval_s": 0, "tensorboard": False}  # else the defaults
BATCH = 64
"""Samples per worker in a micro-batch (the default ``--batch-size``): a step's samples."""


def loop_for(model_name: str):
    """The built-in job with ``--model model_name`` as an own loop (an own loop takes no
    ``--model``: it builds its own)."""

    def train(run) -> None:
        _train(run, model_name)

    return train


def _train(run, model_name: str) -> None:
    """The built-in job as an own loop."""
    import torch.nn.functional as F

    import ray_ddp
    from ray_ddp.data.order.global_order import EpochPlan
    from ray_ddp.image_classification.models import build_model
    from ray_ddp.image_classification.synthetic import NUM_CLASSES, make_synthetic
    from ray_ddp.worker.optim import build_optimizer, build_scheduler

    cfg = run.config
    train_set, val_set = make_synthetic(
        cfg.optim.seed, cfg.data.train_samples, cfg.data.val_samples
    )
    model = run.setup(build_model(model_name, tuple(train_set[0][0].shape), NUM_CLASSES))
    plan = EpochPlan(
        len(train_set), cfg.optim.batch_size, cfg.global_batch_size, cfg.optim.seed, epoch=0
    )
    optimizer = build_optimizer(cfg.optim, model.parameters())
    schedule = build_scheduler(cfg.optim, optimizer, plan.steps * cfg.optim.epochs)
    run.register(model=model, optimizer=optimizer, schedule=schedule)

    def sums(model, batch):
        images, labels = batch
        output, n = model(images).float(), len(labels)
        return {"loss": ray_ddp.Sum(F.cross_entropy(output, labels, reduction="sum"), n),
                "acc": ray_ddp.Sum((output.argmax(dim=1) == labels).sum(), n)}  # fmt: skip

    for _ in run.epochs():
        model.train()
        for step in run.steps(train_set):
            for micro in step:
                images, labels = micro.data
                with run.autocast():
                    loss = F.cross_entropy(model(images).float(), labels)
                run.backward(loss, micro)
            run.step(optimizer, schedules=[schedule])
        scores = run.evaluate(model, val_set, sums)
        run.report({"val_loss": scores["loss"], "val_acc": scores["acc"]})


def one_run(storage: str, name: str, own: bool, epochs: int, model: str) -> tuple[float, float]:
    """Steady samples/s per worker of one run, and its median optimizer step (ms)."""
    import ray_ddp
    from ray_ddp.driver.run import fit

    common = {"num_workers": 2, "storage_path": storage, "name": name, "epochs": epochs,
              "batch_size": BATCH, **RUN}  # fmt: skip
    if own:
        summary = ray_ddp.launch(loop_for(model), best_metric="acc", best_mode="max", **common)
    else:
        summary = fit(TASK, model=model, **common)
    timing = summary["timing"]
    return timing["steady_samples_per_s_per_worker"], 1000 * timing["step_time_median_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--model", default="small_resnet", help="the job's --model")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--stem", default="own_loop_overhead", help="the result files' name")
    args = parser.parse_args(argv)

    import ray

    pairs, steps = [], []  # steady samples/s, median step ms: {"on": own, "off": built-in}
    with tempfile.TemporaryDirectory() as storage:
        ray.init(num_cpus=2, logging_level="WARNING")
        try:
            for pair in range(args.pairs):
                runs = {arm: one_run(storage, f"{arm}-{pair}", arm == "on", args.epochs,
                                     args.model)
                        for arm in arms_in_turn(pair)}  # fmt: skip
                speeds = {arm: speed for arm, (speed, _) in runs.items()}
                pairs.append(speeds)
                steps.append({arm: ms for arm, (_, ms) in runs.items()})
                ms = steps[-1]
                print(f"pair {pair + 1}: own loop {speeds['on']:.1f}, built-in "
                      f"{speeds['off']:.1f} samples/s per worker, own/built-in "
                      f"{speeds['on'] / speeds['off']:.3f}; median step {ms['on']:.2f} "
                      f"against {ms['off']:.2f} ms", flush=True)  # fmt: skip
        finally:
            ray.shutdown()
    # The median step's milliseconds, own less built-in, pair by pair.
    extra_ms = [p["on"] - p["off"] for p in steps]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "run": {**RUN, "epochs": args.epochs, "model": args.model},
        "pairs": pairs,
        **paired_figures(pairs),
        "step_ms": steps,
        "step_ms_median": {arm: statistics.median(p[arm] for p in steps) for arm in ("on", "off")},
        "step_ratio": paired_figures(steps),
        "extra_ms_median": statistics.median(extra_ms),
        "extra_ms_median_95": median_interval(extra_ms),
        "load_average": os.getloadavg(),
    }
    write_report(args.out, args.stem, result, markdown(result))
    return 0


def markdown(r: dict) -> str:
    return (
        f"# An own loop against the built-in loop ({r['date']})\n\n"
        "The default job (`jobs/train.py`'s defaults: 2 CPU workers on gloo, the built-in "
        f"12000 samples, batch {BATCH} per worker) with `--model {r['run']['model']}`, "
        f"{r['run']['epochs']} epoch(s) per run, run by the built-in loop and written as an "
        "own loop (`benchmarks/own_loop_overhead.py`'s `_train`); "
        f"{len(r['pairs'])} interleaved pairs (which goes first alternates), steady "
        "samples/s per worker.\n\n"
        + paired_table(r, "own loop", "built-in loop", "own / built-in")
        + "Each run's median optimizer step (ms), less sensitive than samples/s to the "
        "machine's hiccups:\n\n"
        + paired_table(
            {**r["step_ratio"], "pairs": r["step_ms"]},
            "own loop",
            "built-in loop",
            "own / built-in",
        )  # fmt: skip
        + f"The own loop's median step less the built-in loop's, pair by pair: median "
        f"{r['extra_ms_median']:+.3f} ms.\n\n"
        + interval_line(r["extra_ms_median_95"], "median difference (ms per step)", "+.3f")
        + f"The 1-minute load average at the end: {r['load_average'][0]:.1f} on 2 cores.\n"
    )


if __name__ == "__main__":
    sys.exit(main())
