"""The cost of the orchestration: ray_ddp against plain torchrun DDP, Lightning and a bare
single-process loop, on the same model, data, batches and steps.

    python benchmarks/run.py            # every case, 3 repeats, interleaved (~10 min on 2 cores)
    python benchmarks/run.py --quick    # every case once, fewer steps (~3 min on 2 cores)
    python benchmarks/run.py --only torchrun,ray_ddp --repeats 5 --steps 300

Each case runs as its own subprocess, the way a user starts it; the processes write their
own figures (steady samples/s, median step time, all-reduces per optimizer step, the unix
time of the end of their first optimizer step) and this script adds what only the outside
sees (time to first step from launch, end-to-end wall). Results: ``benchmarks/results/``
(results.md, benchmark.png, raw.json). See benchmarks/README.md.

Cases that start Ray (ray_ddp*) must not share the machine with another Ray instance.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = sys.executable
ACCUM = 4


@dataclass(frozen=True)
class Case:
    name: str
    label: str
    kind: str  # torchrun | ray_ddp | lightning | single
    workers: int
    accum: int = 1
    accum_mode: str = "no_sync"  # torchrun only: no_sync | every
    baseline: str = "torchrun"
    group: str = "main"
    channels_last: bool = False  # ray_ddp only: NHWC; every other case is NCHW
    compile: bool = False  # ray_ddp only: --compile
    default: bool = True  # run without --only (compiling takes minutes on 2 cores)
    env: tuple[tuple[str, str], ...] = ()  # ray_ddp only: more environment (an A/B)


CASES = [
    Case("torchrun", "torchrun DDP script (the guide's way)", "torchrun", 2),
    Case("ray_ddp", "ray_ddp: jobs/train.py", "ray_ddp", 2),
    Case(
        "ray_ddp_nhwc",
        "ray_ddp: jobs/train.py --channels-last",
        "ray_ddp",
        2,
        channels_last=True,
    ),
    Case("lightning", "Lightning Trainer, strategy ddp", "lightning", 2),
    Case("single", "single process, no DDP", "single", 1, group="scaling"),
    Case("ray_ddp_1w", "ray_ddp: jobs/train.py --num-workers 1", "ray_ddp", 1, group="scaling"),
    Case(
        "torchrun_accum4_every",
        f"torchrun, accum {ACCUM}, all-reduce every micro-step (guide)",
        "torchrun",
        2,
        ACCUM,
        "every",
        "torchrun_accum4_every",
        "accum",
    ),
    Case(
        "torchrun_accum4_nosync",
        f"torchrun, accum {ACCUM}, no_sync off the boundary",
        "torchrun",
        2,
        ACCUM,
        "no_sync",
        "torchrun_accum4_every",
        "accum",
    ),
    Case(
        "ray_ddp_accum4",
        f"ray_ddp: --accum-steps {ACCUM} (no_sync)",
        "ray_ddp",
        2,
        ACCUM,
        "no_sync",
        "torchrun_accum4_every",
        "accum",
    ),
]
CASES.append(
    Case(
        "ray_ddp_compile",
        "ray_ddp: jobs/train.py --compile",
        "ray_ddp",
        2,
        baseline="ray_ddp",
        group="compile",
        compile=True,
        default=False,
    )
)
CASES.append(
    Case(
        "ray_ddp_nice15",
        "ray_ddp: jobs/train.py, Ray's default worker niceness (15)",
        "ray_ddp",
        2,
        default=False,
        env=(("RAY_worker_niceness", "15"),),
    )
)
BY_NAME = {c.name: c for c in CASES}


@dataclass
class Settings:
    model: str
    batch_size: int
    steps: int
    accum_case_steps: int
    warmup: int
    train_samples: int
    val_samples: int
    seed: int
    repeats: int
    timeout_s: float
    ray_env: dict[str, str] = field(default_factory=dict)

    def steps_for(self, case: Case) -> int:
        return self.accum_case_steps if case.accum > 1 else self.steps


def timing_warmup() -> int:
    """ray_ddp's own warm-up (its summary's timing block leaves these steps out); the
    baselines leave out as many. Read without importing Ray."""
    spec = importlib.util.spec_from_file_location(
        "_step_timing", os.path.join(ROOT, "ray_ddp", "step_timing.py")
    )
    try:
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        return int(module.WARMUP_STEPS)
    except (OSError, AttributeError):
        return 10


def lightning_available() -> bool:
    return importlib.util.find_spec("lightning") is not None


# ----------------------------------------------------------------------------- commands
def command(case: Case, s: Settings, result: str, storage: str, run_name: str) -> list[str]:
    steps = s.steps_for(case)
    common = [
        "--model", s.model,
        "--batch-size", str(s.batch_size),
        "--accum-steps", str(case.accum),
        "--max-steps", str(steps),
        "--train-samples", str(s.train_samples),
        "--val-samples", str(s.val_samples),
        "--seed", str(s.seed),
    ]  # fmt: skip
    bench = [*common, "--timing-warmup", str(s.warmup), "--result", result]
    if case.kind == "torchrun":
        return [
            PY, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(case.workers),
            os.path.join(HERE, "torchrun_ddp.py"), *bench, "--accum-mode", case.accum_mode,
        ]  # fmt: skip
    if case.kind == "single":
        return [PY, os.path.join(HERE, "single_process.py"), *bench]
    if case.kind == "lightning":
        return [PY, os.path.join(HERE, "lightning_ddp.py"), *bench, "--devices", str(case.workers)]
    return [
        PY, os.path.join(ROOT, "jobs", "train.py"), *common,
        "--dataset", "synthetic", "--epochs", "1",
        "--num-workers", str(case.workers), "--cpus-per-worker", "1", "--no-gpu",
        "--loader-workers", "0", "--comm-stats", "--no-export", "--no-tensorboard",
        # The same NCHW work as the other scripts, except in the case that shows NHWC.
        "--channels-last" if case.channels_last else "--no-channels-last",
        *(["--compile"] if case.compile else []),
        "--storage-path", storage, "--name", run_name, "--summary-json", result,
    ]  # fmt: skip


def environment(case: Case, s: Settings) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",  # a CPU comparison, even on a machine with GPUs
        PYTHONUNBUFFERED="1",
        PYTHONWARNINGS="ignore",
    )
    # A local comparison on this machine: ray_ddp starts its own local Ray, never joins a
    # cluster named in the environment.
    env.pop("RAY_ADDRESS", None)
    if case.kind == "ray_ddp":
        env.update(s.ray_env)
        env.update(dict(case.env))
    return env


# ----------------------------------------------------------------------------- one run
def collect(case: Case, result_path: str) -> dict[str, Any]:
    """The figures a run wrote, in one shape for every kind."""
    with open(result_path) as f:
        data = json.load(f)
    if case.kind != "ray_ddp":
        return data
    timing = data.get("timing") or {}
    history = data.get("history") or [{}]
    out: dict[str, Any] = {
        "world_size": data.get("world_size"),
        "steps": data.get("steps"),
        "allreduces_per_step": history[-1].get("allreduces_per_step", 0.0),
        "first_step_unix": timing.get("first_step_unix"),
        "step_time_median_s": timing.get("step_time_median_s"),
        "steady_samples_per_s_per_worker": timing.get("steady_samples_per_s_per_worker"),
        "steps_timed": timing.get("steps_timed"),
        "warmup_steps": timing.get("warmup_steps"),
    }
    if out["steady_samples_per_s_per_worker"] is None:
        # No timing block in summary.json: the whole training phase's speed (warm-up
        # included) is the best there is.
        out["steady_samples_per_s_per_worker"] = data.get("samples_per_s", 0.0) / max(
            1, data.get("world_size") or 1
        )
        out["note"] = "no timing block in summary.json: samples/s includes warm-up"
    return out


def run_once(case: Case, s: Settings, rep: int, work: str, log_dir: str) -> dict[str, Any]:
    tag = f"{case.name}-{rep}"
    result = os.path.join(work, f"{tag}.json")
    storage = os.path.join(work, "runs")
    log_path = os.path.join(log_dir, f"{tag}.log")
    cmd = command(case, s, result, storage, tag)
    launch = time.time()
    with open(log_path, "w") as log:
        # Its own process group: on a timeout, the launcher's children (ranks, Ray's
        # processes) are ended with it.
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=environment(case, s),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc: int | str = proc.wait(timeout=s.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = f"killed after the {s.timeout_s:.0f} s timeout"
    end = time.time()
    if rc != 0 or not os.path.exists(result):
        with open(log_path) as f:
            tail = "".join(f.readlines()[-25:])
        raise RuntimeError(f"{tag} failed (exit {rc}); log {log_path}:\n{tail}")
    figures = collect(case, result)
    sps_worker = figures.get("steady_samples_per_s_per_worker") or 0.0
    first = figures.get("first_step_unix")
    record = {
        "case": case.name,
        "repeat": rep,
        "launch_unix": launch,
        "wall_s": end - launch,
        "time_to_first_step_s": (first - launch) if first else None,
        "samples_per_s": sps_worker * case.workers,
        **figures,
    }
    shutil.rmtree(storage, ignore_errors=True)
    return record


# ----------------------------------------------------------------------------- summary
def spread(values: list[float]) -> dict[str, float] | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def aggregate(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["case"] for r in records):
        mine = [r for r in records if r["case"] == name]
        out[name] = {
            key: spread([r.get(key) for r in mine])
            for key in (
                "samples_per_s",
                "step_time_median_s",
                "allreduces_per_step",
                "time_to_first_step_s",
                "wall_s",
            )
        }
        out[name]["repeats"] = len(mine)
        out[name]["notes"] = sorted({r["note"] for r in mine if r.get("note")})
    return out


def fmt(stat: dict[str, float] | None, scale: float = 1.0, digits: int = 0) -> str:
    if not stat:
        return "–"
    med, lo, hi = (stat[k] * scale for k in ("median", "min", "max"))
    if stat["min"] == stat["max"]:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"


def ratio(agg: dict, name: str, base: str, key: str) -> str:
    a, b = agg.get(name, {}).get(key), agg.get(base, {}).get(key)
    if not a or not b or not b["median"]:
        return "–"
    return f"{a['median'] / b['median']:.2f}"


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    versions: dict[str, str] = {}
    for pkg in ("torch", "ray", "lightning"):
        try:
            from importlib.metadata import version

            versions[pkg] = version(pkg)
        except Exception:  # noqa: BLE001 - not installed
            versions[pkg] = "not installed"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        **versions,
    }


def markdown(
    agg: dict, s: Settings, mach: dict, skipped: list[str], elapsed_s: float, cmdline: str
) -> str:
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [
        "# ray_ddp vs torchrun DDP vs Lightning (CPU, gloo)",
        "",
        f"Measured {when} with `{cmdline}` in {elapsed_s / 60:.1f} min.",
        "",
        f"- machine: {mach['cpu']}, {mach['cores']} cores; {mach['os']}; Python "
        f"{mach['python']}; torch {mach['torch']}, ray {mach['ray']}, "
        f"lightning {mach['lightning']}",
        f"- work: `{s.model}` on the built-in synthetic data ({s.train_samples} train / "
        f"{s.val_samples} val samples, 3×16×16, in memory), {s.batch_size} samples per "
        f"worker per micro-batch, {s.steps} optimizer steps"
        + (
            f" ({s.accum_case_steps} with accumulation {ACCUM})"
            if any(BY_NAME[n].accum > 1 for n in agg)
            else ""
        )
        + ", one epoch; AdamW, grad clip 1.0, warm-up + cosine LR; one "
        "torch thread per worker (OMP_NUM_THREADS=1), no DataLoader workers",
        f"- {s.repeats} repeat(s), cases interleaved; figures are the median over repeats, "
        "(min–max) when repeats differ; the first "
        f"{s.warmup} optimizer steps of each run are left out of the in-process figures",
        "",
        "| case | workers | global batch | samples/s | × baseline | step ms | "
        "all-reduces / step | first step s | × baseline | wall s | × baseline |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for group, title in (
        ("main", None),
        ("scaling", "scaling 1 → 2 workers"),
        ("accum", f"accumulation {ACCUM}"),
        ("compile", "torch.compile (× the plain ray_ddp run)"),
    ):
        cases = [c for c in CASES if c.group == group and c.name in agg]
        if title and cases:
            lines.append(f"| **{title}** | | | | | | | | | | |")
        for c in cases:
            a = agg[c.name]
            base = c.baseline
            lines.append(
                f"| {c.label} | {c.workers} | {s.batch_size * c.workers * c.accum} | "
                f"{fmt(a['samples_per_s'])} | {ratio(agg, c.name, base, 'samples_per_s')} | "
                f"{fmt(a['step_time_median_s'], 1000, 1)} | "
                f"{fmt(a['allreduces_per_step'], 1, 2)} | "
                f"{fmt(a['time_to_first_step_s'], 1, 1)} | "
                f"{ratio(agg, c.name, base, 'time_to_first_step_s')} | "
                f"{fmt(a['wall_s'], 1, 1)} | {ratio(agg, c.name, base, 'wall_s')} |"
            )
    for name in skipped:
        lines.append(
            f"| {BY_NAME[name].label}: skipped, lightning not installed | | | | | | | | | | |"
        )

    def med(name: str, key: str) -> float | None:
        stat = agg.get(name, {}).get(key)
        return stat["median"] if stat else None

    derived = []
    for two, one, label in (
        ("ray_ddp", "ray_ddp_1w", "ray_ddp 2 workers vs ray_ddp 1 worker"),
        ("torchrun", "single", "torchrun 2 processes vs the single-process loop"),
    ):
        a, b = med(two, "samples_per_s"), med(one, "samples_per_s")
        if a and b:
            derived.append(f"- scaling efficiency 1 → 2 workers, {label}: {a / (2 * b):.0%}")
    a, b = (
        med("torchrun_accum4_nosync", "samples_per_s"),
        med("torchrun_accum4_every", "samples_per_s"),
    )
    if a and b:
        derived.append(
            f"- accumulation {ACCUM}: skipping the all-reduce off the boundary (no_sync) "
            f"runs at {a / b:.2f}× the guide's every-micro-step all-reduce"
        )
    a, b = med("ray_ddp", "time_to_first_step_s"), med("torchrun", "time_to_first_step_s")
    if a and b:
        derived.append(
            f"- ray_ddp's start-up (Ray, workers, process group, data) costs {a - b:.1f} s more "
            "than torchrun's before the first optimizer step"
        )
    a, b = med("ray_ddp", "wall_s"), med("torchrun", "wall_s")
    if a and b:
        derived.append(f"- end to end, ray_ddp takes {a - b:.1f} s more than torchrun")
    notes = sorted({n for a in agg.values() for n in a.get("notes", [])})
    lines += ["", *derived] if derived else []
    lines += [
        "",
        "Columns: **samples/s** all workers together, steady state (after the warm-up "
        "steps, from the end of one optimizer step to the end of the next, data loading "
        "included), measured inside rank 0; **step ms** the median optimizer step; "
        "**all-reduces / step** gradient all-reduces per optimizer step, counted with a DDP "
        "communication hook; **first step s** from launching the command to the end of "
        "its first optimizer step (unix time stamps written by rank 0); **wall s** launch "
        "to exit. **× baseline**: against the torchrun DDP script (accumulation rows: "
        "against the torchrun script that all-reduces every micro-step).",
        "",
        "Every DDP case does the same end-of-run work except Lightning: validation over "
        f"the {s.val_samples} validation samples across ranks and a rank-0 checkpoint "
        "(ray_ddp also reports it to Ray and writes metrics.csv and curves.png); the "
        "Lightning case has no validation, logger or checkpoint.",
    ]
    if notes:
        lines += ["", *[f"Note: {n}." for n in notes]]
    return "\n".join(lines) + "\n"


def chart(agg: dict, path: str, title: str) -> None:
    sys.path.insert(0, ROOT)
    from ray_ddp.io.plots import figure, png_bytes  # matplotlib only, no Ray

    names = [c.name for c in CASES if c.name in agg]
    labels = [BY_NAME[n].label for n in names]
    panels = (
        ("samples_per_s", "steady samples/s (all workers)"),
        ("time_to_first_step_s", "launch → end of first step (s)"),
        ("wall_s", "end-to-end wall (s)"),
    )
    fig, axes = figure(3, (16, 0.45 * len(names) + 1.8), sharey=True)
    colours = {"torchrun": "#4c72b0", "ray_ddp": "#dd8452", "lightning": "#8172b3"}
    colours["single"] = "#55a868"
    for ax, (key, heading) in zip(axes, panels, strict=True):
        meds, errs = [], [[], []]
        for n in names:
            st = agg[n][key] or {"median": 0, "min": 0, "max": 0}
            meds.append(st["median"])
            errs[0].append(st["median"] - st["min"])
            errs[1].append(st["max"] - st["median"])
        ax.barh(
            range(len(names)),
            meds,
            xerr=errs,
            color=[colours[BY_NAME[n].kind] for n in names],
            capsize=3,
        )
        for i, v in enumerate(meds):
            text = f" {v:.0f}" if key == "samples_per_s" else f" {v:.1f}"
            ax.text(v + errs[1][i], i, text, va="center", fontsize=8)
        ax.set_title(heading, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(names)), labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(title, fontsize=10)
    with open(path, "wb") as f:
        f.write(png_bytes(fig, dpi=110))


# ----------------------------------------------------------------------------- main
def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="every case once, 60 steps")
    p.add_argument("--repeats", type=int, default=None, help="default: 3 (--quick: 1)")
    p.add_argument(
        "--steps", type=int, default=None, help="optimizer steps per run (default 200; quick 60)"
    )
    p.add_argument("--batch-size", type=int, default=64, help="per worker (default 64)")
    p.add_argument("--model", default="small_cnn", help="any jobs/train.py --model")
    p.add_argument("--val-samples", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--only",
        default=None,
        help=f"comma-separated cases: {', '.join(c.name for c in CASES)} (all but "
        "ray_ddp_compile by default)",
    )
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="results folder")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument(
        "--ray-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for the ray_ddp runs (e.g. RAY_USAGE_STATS_ENABLED=0)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cmdline = "python benchmarks/run.py " + " ".join(sys.argv[1:] if argv is None else argv)
    repeats = args.repeats or (1 if args.quick else 3)
    steps = args.steps or (60 if args.quick else 200)
    warmup = timing_warmup()
    if steps < warmup + 5:
        print(f"error: --steps must be at least {warmup + 5} (warm-up {warmup})", file=sys.stderr)
        return 2
    names = (
        [n.strip() for n in args.only.split(",")]
        if args.only
        else [c.name for c in CASES if c.default]
    )
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        print(f"error: unknown case(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    skipped = []
    if "lightning" in names and not lightning_available():
        print("lightning is not installed: skipping it (pip install -e '.[bench]')", flush=True)
        names.remove("lightning")
        skipped.append("lightning")
    cases = [BY_NAME[n] for n in names]
    accum_steps = max(warmup + 20, steps // ACCUM)
    # One epoch holds every case's steps: no epoch boundary inside the timed steps.
    need = max(
        (accum_steps if c.accum > 1 else steps) * c.accum * args.batch_size * c.workers
        for c in cases
    )
    s = Settings(
        model=args.model,
        batch_size=args.batch_size,
        steps=steps,
        accum_case_steps=accum_steps,
        warmup=warmup,
        train_samples=need + 2 * args.batch_size,
        val_samples=args.val_samples,
        seed=args.seed,
        repeats=repeats,
        timeout_s=args.timeout,
        ray_env=dict(kv.split("=", 1) for kv in args.ray_env),
    )
    os.makedirs(args.out, exist_ok=True)
    log_dir = os.path.join(args.out, "logs")
    os.makedirs(log_dir, exist_ok=True)
    started = time.time()
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ray_ddp_bench_") as work:
        for rep in range(repeats):
            shift = rep % len(cases)  # interleaved, and a different case first each repeat
            for case in cases[shift:] + cases[:shift]:
                print(f"[{rep + 1}/{repeats}] {case.name:<24}", end=" ", flush=True)
                try:
                    r = run_once(case, s, rep, work, log_dir)
                except RuntimeError as exc:
                    print(f"\nerror: {exc}", file=sys.stderr)
                    return 1
                records.append(r)
                ttfs = r["time_to_first_step_s"]
                print(
                    f"{r['samples_per_s']:8.0f} samples/s  "
                    f"first step {ttfs if ttfs is None else round(ttfs, 1)} s  "
                    f"wall {r['wall_s']:.1f} s",
                    flush=True,
                )
    elapsed = time.time() - started
    agg = aggregate(records)
    mach = machine()
    md = markdown(agg, s, mach, skipped, elapsed, cmdline)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out, "raw.json"), "w") as f:
        json.dump(
            {"machine": mach, "settings": s.__dict__, "records": records, "summary": agg},
            f,
            indent=1,
        )
    chart(
        agg,
        os.path.join(args.out, "benchmark.png"),
        f"{mach['cpu']}, {mach['cores']} cores; torch {mach['torch']}, ray {mach['ray']}; "
        f"{s.model}, batch {s.batch_size}/worker, {s.steps} steps, {repeats} repeat(s)",
    )
    print()
    print(md)
    print(f"written: {args.out}/results.md, benchmark.png, raw.json ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
