"""Per-rank memory of the training state, and steady speed, DDP against FSDP2 (CPU, gloo,
no Ray: torch.multiprocessing, ray_ddp's own ``worker.sharding``).

The model: an MLP of residual blocks (Linear d->4d, GELU, Linear 4d->d, LayerNorm), ~50M
parameters at the defaults, trained with AdamW (two fp32 moments per parameter) in fp32.
For each strategy at 1 and at 2 workers it measures, on every rank after a few steps:

- the training state's bytes on the rank: parameters, gradients (just before the
  optimizer step) and optimizer state, counting a DTensor by its local shard; FSDP2's
  should be 1/N of DDP's (DDP's gradient buckets come on top of its figure);
- the rank's peak resident memory (``ru_maxrss``). FSDP2's model is built on the meta
  device and materialised shard by shard (as a model larger than one device must be), so
  no rank ever holds the whole model;
- steady samples/s of the whole group over ``--steps`` timed steps after 2 untimed ones.

Speed: ``--repeats`` runs per strategy at 2 workers, interleaved (DDP, FSDP2, FSDP2, DDP,
...) so a slower spell of a shared machine falls on both; the ratio FSDP2/DDP is given
as the median of the per-pair ratios with their min and max.

    python benchmarks/fsdp2_memory.py                       # ~3 min on 2 cores
    python benchmarks/fsdp2_memory.py --width 512 --repeats 2 --steps 2   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from common import paired_figures, write_report  # noqa: E402 - benchmarks/ is on the path
from ports import free_port  # noqa: E402 - tests/ is on the path
from torch import nn  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(nn.functional.gelu(self.up(x))))


class MLP(nn.Module):
    def __init__(self, width: int, depth: int, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def build(strategy: str, width: int, depth: int, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ray_ddp.worker.sharding import default_blocks

    torch.manual_seed(0)
    if strategy == "ddp":
        model = MLP(width, depth)
        return nn.parallel.DistributedDataParallel(model) if world > 1 else model
    with torch.device("meta"):
        model = MLP(width, depth)
    # As worker.sharding.shard_model does (fp32), on a model not yet materialised.
    mesh = init_device_mesh("cpu", (world,))
    for block in default_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    for module in model.modules():  # each rank initialises its own shards only
        if isinstance(module, (nn.Linear, nn.LayerNorm)):
            module.reset_parameters()
    return model


def worker(rank: int, world: int, port: str, case: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = build(case["strategy"], case["width"], case["depth"], world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(rank)
    batch = case["batch"]
    x = torch.randn(batch, case["width"], generator=generator)
    y = torch.randint(0, 10, (batch,), generator=generator)
    state_bytes: dict[str, int] = {}
    timed = 0.0
    for step in range(2 + case["steps"]):
        if step == 2:
            dist.barrier()
            started = time.perf_counter()
        nn.functional.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if step == 1:  # gradients present, optimizer state created by step 0
            parameters = list(model.parameters())
            state_bytes = {
                "params": sum(local_bytes(p) for p in parameters),
                "grads": sum(local_bytes(p.grad) for p in parameters),
                "optimizer": sum(
                    local_bytes(v)
                    for s in optimizer.state.values()
                    for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0
                ),
            }
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    timed = time.perf_counter() - started
    record = {
        "rank": rank,
        **state_bytes,
        "state": sum(state_bytes.values()),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "samples_per_s": batch * world * case["steps"] / timed,
        "parameters": sum(p.numel() for p in model.parameters()) if world == 1 else None,
    }
    with open(os.path.join(out, f"{rank}.json"), "w") as file:
        json.dump(record, file)
    dist.destroy_process_group()


def run_case(case: dict, world: int) -> list[dict]:
    out = tempfile.mkdtemp(prefix="fsdp2_bench_")
    mp.spawn(worker, args=(world, str(free_port()), case, out), nprocs=world)
    return [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(world)]


def mb(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32, help="per worker")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs per strategy, 2 workers")
    parser.add_argument("--out", default=os.path.join(RESULTS, "fsdp2_memory"))
    args = parser.parse_args()
    case = {"width": args.width, "depth": args.depth, "batch": args.batch, "steps": args.steps}

    memory: dict[tuple[str, int], list[dict]] = {}
    for world in (1, 2):
        for strategy in ("ddp", "fsdp2"):
            memory[strategy, world] = run_case({**case, "strategy": strategy}, world)
            print(strategy, world, [mb(r["state"]) for r in memory[strategy, world]], flush=True)
    speeds: dict[str, list[float]] = {"ddp": [], "fsdp2": []}
    for repeat in range(args.repeats):
        order = ("ddp", "fsdp2") if repeat % 2 == 0 else ("fsdp2", "ddp")
        for strategy in order:
            ranks = run_case({**case, "strategy": strategy}, 2)
            speeds[strategy].append(min(r["samples_per_s"] for r in ranks))
        print("samples/s", {k: round(v[-1], 1) for k, v in speeds.items()}, flush=True)

    parameters = memory["ddp", 1][0]["parameters"]
    pairs = [{"on": f, "off": d} for f, d in zip(speeds["fsdp2"], speeds["ddp"], strict=True)]
    figures = paired_figures(pairs)  # on: FSDP2, off: DDP
    rows = []
    for (strategy, world), ranks in memory.items():
        for r in ranks:
            rows.append({"strategy": strategy, "workers": world, **r})
    result = {
        "case": case,
        "parameters": parameters,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "memory": rows,
        "samples_per_s": speeds,
        "ratio_fsdp2_over_ddp": {
            "median": figures["ratio_median"],
            "min": figures["ratio_min"],
            "max": figures["ratio_max"],
            "pairs": [p["on"] / p["off"] for p in pairs],
        },
    }
    lines = [
        f"# FSDP2 against DDP: per-rank training state and speed ({parameters / 1e6:.1f}M "
        f"parameters, AdamW, fp32, CPU/gloo)",
        "",
        f"`python benchmarks/fsdp2_memory.py` (width {args.width}, depth {args.depth}, batch "
        f"{args.batch} per worker, {args.steps} timed steps, {args.repeats} repeats), torch "
        f"{torch.__version__}, {os.cpu_count()} CPUs.",
        "",
        "| strategy | workers | rank | params MB | grads MB | optimizer MB | state MB | "
        "state / DDP's | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ddp = memory["ddp", row["workers"]][row["rank"]]["state"]
        lines.append(
            f"| {row['strategy']} | {row['workers']} | {row['rank']} | {mb(row['params'])} | "
            f"{mb(row['grads'])} | {mb(row['optimizer'])} | {mb(row['state'])} | "
            f"{row['state'] / ddp:.3f} | {mb(row['peak_rss'])} |"
        )
    ratio = result["ratio_fsdp2_over_ddp"]
    lines += [
        "",
        f"Steady samples/s at 2 workers (slowest rank, {args.repeats} interleaved runs each): "
        f"DDP {', '.join(f'{s:.0f}' for s in speeds['ddp'])}; FSDP2 "
        f"{', '.join(f'{s:.0f}' for s in speeds['fsdp2'])}. FSDP2 / DDP: median "
        f"{ratio['median']:.2f} (pairs from {ratio['min']:.2f} to {ratio['max']:.2f}).",
        "",
    ]
    write_report(os.path.dirname(args.out), os.path.basename(args.out), result, "\n".join(lines))


if __name__ == "__main__":
    main()
