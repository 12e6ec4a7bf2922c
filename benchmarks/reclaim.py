"""Steps done again after a spot reclaim, with and without acting on the notice (issue 28).

    python benchmarks/reclaim.py --out benchmarks/results/reclaims

A simulated cluster (``ray.cluster_utils.Cluster``: a head and two 1-CPU worker nodes, each
with one ``slot``, so the two workers land on different nodes) with Ray Train's reclaim
watcher on. Each case trains ``--steps`` optimizer steps of about ``--step-s`` seconds
(the harness slows each step, as a bigger model's would be), with a periodic checkpoint
every ``--checkpoint-every`` steps. When rank 1 reaches step K, its node is drained the
way a cloud provider's notice reaches Ray (``ray drain-node --reason
DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N``) and killed at that deadline;
a new node replaces it and Ray restarts the run (its own preemption retry: the run has
``--max-failures 0``).

- ``notice``: the default ``--preemption-check-steps 10``: a checkpoint once the notice is
  seen, another just before the deadline, then a hold;
- ``no notice``: ``--preemption-check-steps 0``: the periodic checkpoints alone.

Steps done again = optimizer steps rank 0 applied over all attempts (the harness's
``step_log``) minus the run's steps. Cases interleave over the drain steps K.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

CASES = {"notice": 10, "no notice": 0}  # --preemption-check-steps


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drain-at", default="30,45,60", help="steps K where the node is drained")
    p.add_argument("--notice-s", type=int, default=15, help="the notice's deadline, seconds")
    p.add_argument("--step-s", type=float, default=0.2)
    p.add_argument("--checkpoint-every", type=int, default=25)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    return p.parse_args(argv)


class Nodes:
    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        os.environ.update(
            RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="1", RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S="1"
        )
        with socket.socket() as s:  # a free port for the State API's dashboard
            s.bind(("127.0.0.1", 0))
            head = {"num_cpus": 1, "dashboard_port": s.getsockname()[1]}
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        for _ in range(2):
            self.add()
        self.cluster.wait_for_nodes()

    def add(self):
        return self.cluster.add_node(num_cpus=1, resources={"slot": 1})

    def node_of(self, pid: int):
        from ray.util.state import list_actors

        (actor,) = list_actors(address=self.cluster.address, filters=[("pid", "=", pid)])
        return next(n for n in self.cluster.worker_nodes if n.node_id == actor.node_id)


def case(nodes: Nodes, args, check_steps: int, drain_at: int) -> dict:
    from ray_ddp.driver.run import fit
    from ray_ddp.testing.harness import Harness, Stall, stall_marker, step_log_path

    storage = tempfile.mkdtemp(prefix="reclaim-")
    run_dir = os.path.join(storage, "run")
    steps_per_epoch = 32
    harness = Harness(
        stalls=(Stall(drain_at, 1, seconds=0.0),), slow_step_s=args.step_s, step_log=True
    )
    done: dict = {}

    def train() -> None:
        try:
            done["summary"] = fit(
                "ray_ddp.image_classification:ImageClassification", harness=harness,
                num_workers=2, resources_per_worker={"slot": 1}, max_failures=0,
                epochs=args.epochs, train_samples=steps_per_epoch * 32, batch_size=16,
                val_samples=64, checkpoint_every=args.checkpoint_every,
                preemption_check_steps=check_steps, storage_path=storage, name="run",
                export=False, tensorboard=False, progress_interval_s=0,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - reported below
            done["error"] = exc

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    marker = stall_marker(run_dir, drain_at, 1)
    while not os.path.exists(marker):
        if not thread.is_alive():
            raise RuntimeError(f"the run ended before step {drain_at}: {done}")
        time.sleep(0.1)
    with open(marker) as file:
        pid = int(file.read().split()[1])
    victim = nodes.node_of(pid)
    deadline = time.time() + args.notice_s
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    subprocess.run(
        [ray_cli, "drain-node", "--address", nodes.cluster.address, "--node-id",
         victim.node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message",
         "spot reclaim (benchmark)", "--deadline-remaining-seconds", str(args.notice_s)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    time.sleep(max(0.0, deadline - time.time()) + 0.5)
    nodes.cluster.remove_node(victim, allow_graceful=False)
    nodes.add()
    nodes.cluster.wait_for_nodes()
    thread.join(timeout=900)
    if "error" in done or "summary" not in done:
        raise RuntimeError(f"the run failed: {done.get('error')}")
    with open(step_log_path(run_dir)) as file:
        rows = [tuple(map(int, line.split())) for line in file]  # step, rank 0's pid
    applied = [step for step, _ in rows]
    total = steps_per_epoch * args.epochs
    back = next(i for i in range(1, len(rows)) if rows[i][1] != rows[i - 1][1])  # a restart
    at_kill, resumed_at = applied[back - 1], applied[back] - 1
    return {
        "drain_at": drain_at,
        "step_at_kill": at_kill,
        "applied": len(applied),
        "run_steps": total,
        "redone": len(applied) - total,
        "resumed_at": resumed_at,
    }


def markdown(rows: list[dict], args) -> str:
    lines = [
        "# Steps done again after a spot reclaim",
        "",
        f"`python benchmarks/reclaim.py --drain-at {args.drain_at} --notice-s {args.notice_s} "
        f"--step-s {args.step_s} --checkpoint-every {args.checkpoint_every}`: simulated nodes, "
        f"{rows[0]['run_steps']} steps of ~{args.step_s} s, a periodic checkpoint every "
        f"{args.checkpoint_every}, the node drained at step K with a {args.notice_s} s notice "
        "and killed at its deadline.",
        "",
        "| case | drained at step | last step applied before the kill | resumed from step "
        "| steps done again |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['case']} | {row['drain_at']} | {row['step_at_kill']} | {row['resumed_at']} "
            f"| {row['redone']} |"
        )
    lines.append("")
    for name in CASES:
        redone = [r["redone"] for r in rows if r["case"] == name]
        lines.append(f"- {name}: steps done again {redone}, mean {sum(redone) / len(redone):.1f}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import ray

    nodes = Nodes()
    ray.init(address=nodes.cluster.address, logging_level="WARNING")
    rows = []
    try:
        for drain_at in map(int, args.drain_at.split(",")):
            for name, check_steps in CASES.items():
                row = {"case": name, **case(nodes, args, check_steps, drain_at)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        ray.shutdown()
        nodes.cluster.shutdown()
    text = markdown(rows, args)
    print(text)
    if args.out:
        with open(args.out + ".json", "w") as file:
            json.dump({"args": vars(args), "rows": rows}, file, indent=1)
        with open(args.out + ".md", "w") as file:
            file.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
