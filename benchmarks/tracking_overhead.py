"""What MLflow tracking costs the default job: the same 2-worker run of ``jobs/train.py``'s
defaults (small_resnet on the built-in data, batch 64 per worker, ``--log-every-steps
50``) with ``--tracking mlflow`` against a local ``mlflow server`` (SQLite store, no job
runner: ``tests/mlflow_server.py``) and without, interleaved on one local Ray; the figure
is each run's steady samples/s per worker (``StepTimer``: warm-up, epoch ends and
checkpoints left out), compared pair by pair. ``--epochs`` each (94 optimizer steps an
epoch; default 3: the tracker's start, its run made and params sent, falls in the first
steps, and one epoch's steady window is short enough for it to show). Also
what a step's call to the tracker costs the training thread on its own
(``Tracker.metrics``: onto the queue), against the server.

    RAY_DDP_MLFLOW_SERVER=.mlflow-venv/bin/mlflow python benchmarks/tracking_overhead.py

(the server comes from the ``mlflow`` package: in this environment, or an ``mlflow``
executable of another one named by ``RAY_DDP_MLFLOW_SERVER``). About 4.5 minutes on 2
cores with the default 3 pairs (7 with 5). Writes benchmarks/results/tracking_overhead.md
(and .json).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

from common import arms_in_turn, paired_figures, paired_table, write_report  # noqa: E402 - benchmarks/ is on the path

RUN = {"export": False, "progress_interval_s": 0}  # else jobs/train.py's defaults


def one_run(storage: str, name: str, uri: str | None, epochs: int) -> dict:
    from ray_ddp.driver.run import fit

    tracking = {"tracking": "mlflow", "tracking_uri": uri, "experiment": "overhead"} if uri else {}
    summary = fit("ray_ddp.image_classification:ImageClassification", num_workers=2,
                  storage_path=storage, name=name, epochs=epochs, **RUN, **tracking)  # fmt: skip
    return {
        "steady": summary["timing"]["steady_samples_per_s_per_worker"],
        "tracking": summary.get("tracking", {}),
    }


def put_us(uri: str) -> float:
    """Microseconds the training thread spends per ``Tracker.metrics`` call of a logging
    step (loss, lr, speed onto the queue), a real tracker sending to the server."""
    import timeit

    from ray_ddp.tracking.params import Settings
    from ray_ddp.tracking.tracker import Tracker

    with tempfile.TemporaryDirectory() as run_dir:
        tracker = Tracker(Settings("mlflow", uri, "overhead", "put", run_dir), None, print)
        step = iter(range(1, 10**9))
        values = {"train_loss": 2.3, "lr": 0.003, "samples_per_s": 1000.0}
        number = 20_000
        best = min(timeit.repeat(lambda: tracker.metrics(next(step), values), number=number,
                                 repeat=3))  # fmt: skip
        tracker.close(30)
    return best / number * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args(argv)

    import ray
    from mlflow_server import MlflowServer

    with tempfile.TemporaryDirectory() as storage:
        server = MlflowServer(os.path.join(storage, "mlflow")).start()
        put = put_us(server.uri)
        print(f"Tracker.metrics: {put:.1f} us per call", flush=True)
        ray.init(num_cpus=2, logging_level="WARNING")
        pairs = []
        try:
            for pair in range(args.pairs):
                uris = {"on": server.uri, "off": None}
                runs = {arm: one_run(storage, f"{arm}-{pair}", uris[arm], args.epochs)
                        for arm in arms_in_turn(pair)}  # fmt: skip
                speeds = {arm: run["steady"] for arm, run in runs.items()}
                speeds["sent"] = runs["on"]["tracking"].get("sent", 0)
                pairs.append(speeds)
                print(f"pair {pair + 1}: on {speeds['on']:.1f}, off {speeds['off']:.1f} "
                      f"samples/s per worker, on/off {speeds['on'] / speeds['off']:.3f}",
                      flush=True)  # fmt: skip
        finally:
            ray.shutdown()
            server.stop()
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "run": {**RUN, "epochs": args.epochs},
        "pairs": pairs,
        **paired_figures(pairs),
        "put_us": put,
        "load_average": os.getloadavg(),
    }
    write_report(args.out, "tracking_overhead", result, markdown(result))
    return 0


def markdown(r: dict) -> str:
    return (
        f"# MLflow tracking overhead ({r['date']})\n\n"
        "The default job (`jobs/train.py`'s defaults: 2 CPU workers on gloo, small_resnet, "
        "the built-in 12000 samples, batch 64 per worker, --log-every-steps 50), "
        f"{r['run']['epochs']} epoch(s) per run, with `--tracking mlflow` against a local "
        "`mlflow server` (SQLite store) and "
        f"without; {len(r['pairs'])} interleaved pairs, steady samples/s per worker.\n\n"
        + paired_table(r, "tracking on", "tracking off", "on / off")
        + f"Items rank 0 handed its sender per run: {r['pairs'][0]['sent']} (params, the step "
        "metrics every 50 steps, the epoch's metrics), sent from a background thread once a "
        "second; the training thread only puts them on a queue. The MLflow server ran on the "
        "same 2 cores as the workers (the 1-minute load average at the end: "
        f"{r['load_average'][0]:.1f} on 2 cores).\n\n"
        f"The direct cost: {r['put_us']:.1f} us on the training thread per logging step "
        "(`Tracker.metrics`: loss, lr and speed onto the queue; plus one `loss.item()`, "
        "which TensorBoard's logging step does as well), once every 50 steps by default: "
        f"against the median step of {1000 * 64 / r['off_median']:.0f} ms, "
        f"{r['put_us'] / 1000 / 50 / (1000 * 64 / r['off_median']):.6%} of the training "
        "time.\n"
    )


if __name__ == "__main__":
    raise SystemExit(main())
