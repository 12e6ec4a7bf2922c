"""Where ray_ddp's start-up and shutdown seconds go: a timeline of one short run.

    python benchmarks/startup.py                 # 3 runs of the benchmark job, each timed
    python benchmarks/startup.py --repeats 5 --steps 20
    python benchmarks/startup.py --baseline /tmp/base --repeats 6 --tag startup_ab
                                                 # interleaved pairs against another checkout

Runs ``jobs/train.py`` as ``benchmarks/run.py`` does (the same job, its own local Ray)
with ``RAY_DDP_TIMELINE`` set, so the driver and every rank stamp their stages
(``ray_ddp/io/timeline.py``), while a poller reads /proc every 20 ms for the processes Ray
starts: when each began (its kernel start time) and when a pooled worker became an actor
(its title changed). Each row is the median over the runs of the seconds since launch,
(min-max), and who spends them: ours or Ray's. Results: ``benchmarks/results/startup.md``
and ``startup.json``.

Must not share the machine with another Ray instance.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import median_range, write_report  # noqa: E402
from run import BY_NAME, ROOT, Settings, command, environment, machine  # noqa: E402

FIRST = "rank 0: first optimizer step"
FIRST_S = "first optimizer step, s since launch"

# Ray's processes by their title (Ray renames a pooled worker ``ray::<Actor>`` when it
# becomes one; its own daemons keep their program's name): the ones on the timeline.
RAY_PROCESSES = {
    "gcs_server": "Ray: GCS server",
    "raylet": "Ray: raylet",
    "dashboard.py": "Ray: dashboard",
    "default_worker.py": "Ray: a pooled worker process",
    "TrainController": "Ray: Train controller actor",
    "ray::RayTrainWorker": "Ray: Train worker actor",
}


def _boot_time() -> float:
    """The unix time of boot, to 10 ms (/proc/stat's btime is whole seconds)."""
    with open("/proc/uptime") as f:
        return time.time() - float(f.read().split()[0])


BOOT = _boot_time()
TICKS = os.sysconf("SC_CLK_TCK")


def _title(cmdline: str) -> str:
    """A short name for a process: the actor of a Ray worker, else its program (and
    script)."""
    words = cmdline.split()
    if not words:
        return "?"
    if words[0].startswith("ray::"):
        return words[0].split(".")[0]  # ray::TrainController.run -> ray::TrainController
    program = os.path.basename(words[0])
    script = next((os.path.basename(w) for w in words[1:] if w.endswith(".py")), "")
    return f"{program} {script}".strip()


class ProcessWatch(threading.Thread):
    """Every 20 ms: the processes started since ``since``, under which title, and their
    CPU time so far; keeps each (pid, title)'s first and last sight."""

    def __init__(self, since: float) -> None:
        super().__init__(daemon=True)
        self.since = since
        self.seen: dict[tuple[str, str], list[float]] = {}
        self.started: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.history: dict[str, list[tuple[float, float]]] = {}
        self.titles: dict[str, str] = {}
        self.machine: list[tuple[float, int, int]] = []
        """(unix time, busy ticks, all ticks) of the whole machine (/proc/stat)."""
        self.stop = threading.Event()

    def run(self) -> None:
        me = str(os.getpid())
        while not self.stop.wait(0.02):
            now = time.time()
            with open("/proc/stat") as f:
                # user to steal: guest time is counted in user already
                ticks = [int(v) for v in f.readline().split()[1:9]]
            idle = ticks[3] + ticks[4]  # idle, iowait
            self.machine.append((now, sum(ticks) - idle, sum(ticks)))
            for pid in os.listdir("/proc"):
                if pid.isdigit() and pid != me:
                    self._look(pid, now)

    def _look(self, pid: str, now: float) -> None:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return
        started = BOOT + int(fields[19]) / TICKS
        if started < self.since - 0.05:
            return  # not this run's
        self.started[pid] = started
        # A process that has exited reads as a zombie: no command line, its final CPU.
        self.cpu[pid] = max(self.cpu.get(pid, 0.0), (int(fields[11]) + int(fields[12])) / TICKS)
        self.history.setdefault(pid, []).append((now, self.cpu[pid]))
        if not cmdline.strip():
            return
        title = _title(cmdline)
        # A pooled worker keeps the name of the actor it became (a Train worker reads
        # ``ray::execute`` while it runs a function for the controller).
        if self.titles.get(pid, "ray::IDLE") in ("ray::IDLE", "python default_worker.py"):
            self.titles[pid] = title
        span = self.seen.setdefault((pid, title), [now, now])
        span[1] = now

    def events(self) -> list[tuple[float, str]]:
        """(unix time, what) for the first of each kind on the timeline to start or
        appear, and for the last Train worker to go."""
        events = []
        for kind, label in RAY_PROCESSES.items():
            spans = [(pid, s) for (pid, t), s in self.seen.items() if kind in t]
            if not spans:
                continue
            if "::" in kind or "Controller" in kind:  # a pooled worker turned actor: renamed
                events.append((min(s[0] for _, s in spans), f"{label} assigned"))
            else:
                events.append((min(self.started[pid] for pid, _ in spans), f"{label} started"))
            if kind == "ray::RayTrainWorker":
                events.append((max(s[1] for _, s in spans), "Ray: last Train worker gone"))
        return events

    def busy(self, start: float, end: float) -> float | None:
        """The share of the machine's CPU time that was busy from ``start`` to ``end``
        (every core; None for a span shorter than two samples)."""
        inside = [m for m in self.machine if start <= m[0] <= end]
        if len(inside) < 2 or inside[-1][2] == inside[0][2]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][2] - inside[0][2])

    def _cpu_at(self, pid: str, when: float) -> float:
        """The CPU seconds process ``pid`` had used at ``when`` (its last sample before)."""
        before = [cpu for t, cpu in self.history.get(pid, []) if t <= when]
        return before[-1] if before else 0.0

    def cpu_by_title(
        self, start: float | None = None, end: float | None = None
    ) -> dict[str, dict[str, float]]:
        """CPU seconds and process count per title (a process under its last title), over
        the whole run or from ``start`` to ``end``."""
        out: dict[str, dict[str, float]] = {}
        for pid, total in self.cpu.items():
            cpu = total
            if start is not None and end is not None:
                cpu = self._cpu_at(pid, end) - self._cpu_at(pid, start)
            entry = out.setdefault(self.titles.get(pid, "?"), {"processes": 0, "cpu_s": 0.0})
            entry["processes"] += 1
            entry["cpu_s"] += cpu
        return out


def one_run(
    s: Settings, rep: int, work: str, extra_env: dict[str, str], checkout: str = ROOT
) -> dict[str, Any]:
    """Seconds since launch of every stage of one run of the ray_ddp case, and the CPU
    seconds of every process it started. ``checkout``: whose ``jobs/train.py`` runs (it
    puts its own ``ray_ddp`` first on the path, for the driver and the workers)."""
    case = BY_NAME["ray_ddp"]
    timeline = os.path.join(work, f"timeline-{rep}.jsonl")
    result = os.path.join(work, f"result-{rep}.json")
    cmd = command(case, s, result, os.path.join(work, "runs"), f"startup-{rep}")
    ours = os.path.join(ROOT, "jobs", "train.py")
    cmd = [os.path.join(checkout, "jobs", "train.py") if c == ours else c for c in cmd]
    env = {**environment(case, s), "RAY_DDP_TIMELINE": timeline, **extra_env}
    launch = time.time()
    watch = ProcessWatch(since=launch)
    watch.start()
    with open(os.path.join(work, f"run-{rep}.log"), "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    end = time.time()
    time.sleep(0.1)
    watch.stop.set()
    watch.join()
    if rc != 0:
        raise RuntimeError(f"run {rep} failed (exit {rc}); see {work}/run-{rep}.log")
    from ray_ddp.io.timeline import read

    events = [(launch, "launch")]
    seen = set()
    for m in read(timeline):
        if m["who"].startswith("rank") and m["who"] != "rank 0":
            continue  # rank 0 speaks for the ranks (they wait for each other)
        key = f"{m['who']}: {m['stage']}"
        if key not in seen:
            seen.add(key)
            events.append((m["t"], key))
    events += watch.events()
    events.append((end, "driver: exited"))
    with open(result) as f:
        steady = (json.load(f).get("timing") or {}).get("steady_samples_per_s_per_worker")
    when = {what: t for t, what in events}
    ordered = sorted(events)
    # How busy the machine was in each stage (from the stage above to it): a stage that
    # waits rather than computes shows idle cores.
    busy = {what: watch.busy(ordered[i - 1][0], t) for i, (t, what) in enumerate(ordered) if i}
    # And which processes used it.
    who = {
        what: {title: e["cpu_s"] for title, e in watch.cpu_by_title(ordered[i - 1][0], t).items()}
        for i, (t, what) in enumerate(ordered)
        if i
    }
    first, ended = when[FIRST], when["rank 0: training ended, logs closed"]
    return {
        "stages": {what: t - launch for t, what in ordered},
        "busy": busy,
        "who": who,
        "cpu": watch.cpu_by_title(),
        # From the end of the first optimizer step to the end of training: the steady
        # state (and the epoch's validation and checkpoint, a small part of it).
        "cpu_training": watch.cpu_by_title(first, ended),
        "training_s": ended - first,
        "samples_per_s": 2 * steady if steady else None,
    }


def timeline_table(runs: list[dict[str, Any]]) -> list[str]:
    stages = [r["stages"] for r in runs]
    order = sorted(stages[0], key=lambda k: statistics.median(r.get(k, 0.0) for r in stages))
    lines = [
        "| s since launch, median (min–max) | since the row above | CPU busy | stage "
        "| CPU s by process |",
        "|---:|---:|---:|---|---|",
    ]
    previous = 0.0
    for what in order:
        values = [r[what] for r in stages if what in r]
        med = statistics.median(values)
        shares = [r["busy"][what] for r in runs if r.get("busy", {}).get(what) is not None]
        busy = f"{100 * statistics.median(shares):.0f}%" if shares else ""
        row = f"| {median_range(values)} | {med - previous:+.2f} | {busy} | {what}"
        lines.append(f"{row} | {_who(runs, what)} |")
        previous = med
    return lines


def _who(runs: list[dict[str, Any]], stage: str) -> str:
    """The processes that used the CPU in a stage (median CPU seconds over the runs, the
    top three of at least 0.1 s)."""
    spent = [r.get("who", {}).get(stage, {}) for r in runs]
    titles = {t for s in spent for t in s}
    med = {t: statistics.median(s.get(t, 0.0) for s in spent) for t in titles}
    top = sorted((v, t) for t, v in med.items() if v >= 0.1)[::-1][:3]
    return ", ".join(f"{t.removeprefix('ray::')} {v:.1f}" for v, t in top)


def cpu_table(runs: list[dict[str, Any]], key: str = "cpu") -> list[str]:
    """CPU seconds per process title; for ``cpu_training``, also as % of one core."""
    titles = sorted({t for r in runs for t in r[key]})
    share = key == "cpu_training"
    rows = []
    for title in titles:
        cpu = [r[key].get(title, {}).get("cpu_s", 0.0) for r in runs]
        count = max(r[key].get(title, {}).get("processes", 0) for r in runs)
        pct = [100 * c / r["training_s"] for c, r in zip(cpu, runs, strict=True)]
        rows.append((statistics.median(cpu), title, count, cpu, pct))
    total = [sum(e["cpu_s"] for e in r[key].values()) for r in runs]
    head = "| CPU s, median (min–max) |" + (" % of a core |" if share else "")
    lines = [f"{head} processes | process |", "|---:|" + ("---:|" if share else "") + "---:|---|"]
    for _, title, count, cpu, pct in sorted(rows, reverse=True):
        if max(cpu) >= 0.05:
            extra = f" {median_range(pct, 1)} |" if share else ""
            lines.append(f"| {median_range(cpu)} |{extra} {count} | `{title}` |")
    lines.append(f"| {median_range(total)} |" + (" |" if share else "") + " | **all** |")
    return lines


def _figures(r: dict[str, Any]) -> dict[str, float]:
    cpu = r["cpu"]
    return {
        FIRST_S: r["stages"][FIRST],
        "exit, s since launch": r["stages"]["driver: exited"],
        "CPU s, every process": sum(e["cpu_s"] for e in cpu.values()),
        "CPU s, the Train controller": sum(
            e["cpu_s"] for title, e in cpu.items() if title.endswith("TrainController")
        ),
    }


def compare(args: argparse.Namespace, s: Settings, work: str, extra_env: dict[str, str]) -> None:
    """Interleaved pairs of runs: this checkout against ``--baseline``'s (which of the two
    goes first alternates), each figure's median (min-max) per checkout and pair by pair."""
    pairs: list[dict[str, dict[str, float]]] = []
    for i in range(args.repeats):
        arms = [("this", ROOT), ("baseline", args.baseline)][:: -1 if i % 2 else 1]
        pair = {}
        for name, checkout in arms:
            pair[name] = _figures(one_run(s, 2 * i + len(pair), work, extra_env, checkout))
        pairs.append(pair)
        print(f"pair {i + 1}/{args.repeats}: first step {pair['this'][FIRST_S]:.2f} s here, "
              f"{pair['baseline'][FIRST_S]:.2f} s at the baseline", flush=True)  # fmt: skip
    lines = [
        "# Start-up: this checkout against a baseline, interleaved pairs",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} with `python benchmarks/startup.py "
        f"--baseline {args.baseline} --repeats {args.repeats} --steps {args.steps}`: the "
        "`benchmarks/run.py` job (small_cnn, 2 CPU workers) run by each checkout's "
        "`jobs/train.py` in turn, which of the two first alternating.",
        "",
        f"- machine: {json.dumps(machine())}",
        "",
        "| figure | this checkout | baseline | this - baseline, pair by pair |",
        "|---|---:|---:|---:|",
    ]
    for key in pairs[0]["this"]:
        here = [p["this"][key] for p in pairs]
        there = [p["baseline"][key] for p in pairs]
        diff = [a - b for a, b in zip(here, there, strict=True)]
        lines.append(
            f"| {key} | {median_range(here)} | {median_range(there)} | "
            f"{statistics.median(diff):+.2f} ({min(diff):+.2f} to {max(diff):+.2f}) |"
        )
    write_report(
        args.out, args.tag, {"pairs": pairs, "machine": machine()}, "\n".join(lines) + "\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="set in the run's environment (an A/B of a Ray setting)")  # fmt: skip
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tag", default="startup", help="the results' file names")
    ap.add_argument("--baseline", metavar="CHECKOUT",
                    help="another checkout of ray_ddp (e.g. `git worktree add /tmp/base HEAD~1`): "
                    "interleaved pairs against it instead of the timeline")  # fmt: skip
    args = ap.parse_args()
    extra_env = dict(item.split("=", 1) for item in args.env)
    s = Settings(
        model="small_cnn", batch_size=64, steps=args.steps, accum_case_steps=args.steps,
        warmup=10, train_samples=25728, val_samples=512, seed=0, repeats=args.repeats,
        timeout_s=600,
    )  # fmt: skip
    work = tempfile.mkdtemp(prefix="ray_ddp_startup_")
    if args.baseline:
        compare(args, s, work, extra_env)
        return
    runs = []
    for rep in range(args.repeats):
        runs.append(one_run(s, rep, work, extra_env))
        stages = runs[-1]["stages"]
        print(f"run {rep + 1}/{args.repeats}: first step at "
              f"{stages.get(FIRST, float('nan')):.1f} s, "
              f"exit at {stages['driver: exited']:.1f} s", flush=True)  # fmt: skip
    env_text = "".join(f" --env {k}={v}" for k, v in extra_env.items())
    lines = [
        "# Where ray_ddp's start-up goes (a timeline)",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} with `python benchmarks/startup.py "
        f"--repeats {args.repeats} --steps {args.steps}{env_text}`: the `benchmarks/run.py` "
        f"job (small_cnn, 2 CPU workers, batch 64 per worker) for {args.steps} optimizer "
        "steps, its own local Ray.",
        "",
        f"- machine: {json.dumps(machine())}",
        "",
        *timeline_table(runs),
        "",
        "CPU time of every process the run started (Ray's daemons, actors and pooled "
        "workers, the driver, DataLoader and compile workers), from launch to exit:",
        "",
        *cpu_table(runs),
        "",
        "The same from the end of the first optimizer step to the end of training (the "
        f"steady state, {median_range([r['training_s'] for r in runs], 1)} s; its "
        "validation and checkpoint included):",
        "",
        *cpu_table(runs, "cpu_training"),
    ]
    result = {"runs": runs, "machine": machine(), "env": extra_env}
    write_report(args.out, args.tag, result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
