"""What the hang watchdog costs in steady state: the same 2-worker run with the watchdog on
(auto ``--hang-timeout``) and off (``--hang-timeout 0``), interleaved, on one local Ray;
the figure is each run's steady samples/s per worker (``StepTimer``: warm-up, epoch ends
and checkpoints left out), compared pair by pair. Also what the calls the loop makes per
micro-batch cost on their own.

    python benchmarks/watchdog_cost.py --pairs 8   # about 6 minutes on 2 cores

Writes benchmarks/results/watchdog_cost.md (and .json).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import timeit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from common import paired_figures, write_report  # noqa: E402 - benchmarks/ is on the path

RUN = {
    "model": "small_cnn",
    "epochs": 2,
    "train_samples": 12000,
    "val_samples": 500,
    "batch_size": 32,
    "export": False,
    "tensorboard": False,
    "progress_interval_s": 0,
}


def calls_per_micro_batch_us() -> dict[str, float]:
    """Microseconds per micro-batch of the calls the loop makes: to a running watchdog, and
    to the stand-in a run without one has (its methods return at once)."""
    from ray_ddp.reliability.hangs import watchdog as watch

    def one_micro_batch(dog) -> None:
        dog.doing("training: waiting for data from the loader", slow=False)
        dog.doing("training: forward and backward", slow=False)
        dog.doing("training: backward with DDP's gradient all-reduce", collective=True)
        dog.doing("training: after backward", slow=False)
        dog.progress("optimizer step", 1)

    def per_call(dog) -> float:
        timings = timeit.repeat(lambda: one_micro_batch(dog), number=number, repeat=5)
        return min(timings) / number * 1e6

    number = 200_000
    off = per_call(watch.NullWatchdog())
    watchdog = watch.Watchdog(lambda stall: None, steady_s=None, grace_s=600).start()
    try:
        on = per_call(watchdog)
    finally:
        watchdog.stop()
    return {"on_us": on, "off_us": off}


def one_run(storage: str, name: str, hang_timeout: float | None) -> float:
    from ray_ddp.driver.run import fit

    summary = fit(
        "ray_ddp.image_classification:ImageClassification",
        num_workers=2,
        storage_path=storage,
        name=name,
        hang_timeout=hang_timeout,
        **RUN,
    )
    return summary["timing"]["steady_samples_per_s_per_worker"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args(argv)

    import ray

    micro = calls_per_micro_batch_us()
    print(f"calls per micro-batch: {micro['on_us']:.2f} us on, {micro['off_us']:.2f} us off")
    ray.init(num_cpus=2, logging_level="WARNING")
    pairs = []
    with tempfile.TemporaryDirectory() as storage:
        for pair in range(args.pairs):
            # Alternate which goes first, so drift over the session weighs on both alike.
            order = [("on", None), ("off", 0.0)][:: 1 if pair % 2 == 0 else -1]
            speeds = {arm: one_run(storage, f"{arm}-{pair}", t) for arm, t in order}
            pairs.append(speeds)
            print(
                f"pair {pair + 1}: on {speeds['on']:.0f}, off {speeds['off']:.0f} samples/s per "
                f"worker, on/off {speeds['on'] / speeds['off']:.3f}",
                flush=True,
            )
    ray.shutdown()
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "run": RUN,
        "pairs": pairs,
        **paired_figures(pairs),
        "calls_per_micro_batch_us": micro,
    }
    write_report(args.out, "watchdog_cost", result, markdown(result))
    return 0


def markdown(r: dict) -> str:
    micro = r["calls_per_micro_batch_us"]
    step_ms = 1000 * r["run"]["batch_size"] / r["on_median"]
    return (
        f"# Hang watchdog cost ({r['date']})\n\n"
        f"2 CPU workers (gloo), small_cnn, {r['run']['train_samples']} samples x "
        f"{r['run']['epochs']} epochs, batch {r['run']['batch_size']} per worker; "
        f"{len(r['pairs'])} interleaved pairs, steady samples/s per worker.\n\n"
        "| | median | range |\n|---|---|---|\n"
        f"| watchdog on (auto) | {r['on_median']:.0f} | "
        f"{min(p['on'] for p in r['pairs']):.0f}-{max(p['on'] for p in r['pairs']):.0f} |\n"
        f"| watchdog off | {r['off_median']:.0f} | "
        f"{min(p['off'] for p in r['pairs']):.0f}-{max(p['off'] for p in r['pairs']):.0f} |\n"
        f"| on / off, pair by pair | {r['ratio_median']:.3f} | "
        f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f} |\n\n"
        f"The loop's watchdog calls per micro-batch: {micro['on_us']:.2f} us with a watchdog "
        f"running, {micro['off_us']:.2f} us without one.\n\n"
        f"The pairs spread far more than any effect (2 workers and Ray's daemons share 2 "
        f"cores), so the end-to-end figure only says the cost is below that noise. The direct "
        f"cost bounds it: {micro['on_us'] - micro['off_us']:.2f} us more per micro-batch "
        f"against a step of {step_ms:.1f} ms at the median speed, "
        f"{(micro['on_us'] - micro['off_us']) / 1000 / step_ms:.4%} of it. The watchdog "
        "thread wakes every 5 s (auto timeout) to compare two clocks.\n"
    )


if __name__ == "__main__":
    raise SystemExit(main())
