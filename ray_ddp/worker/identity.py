"""Who this worker is, as Ray Train set it up, and the worker-side helpers every Ray loop
(training and evaluation alike) shares: logging from rank 0, the rank table, memory.
"""

from __future__ import annotations

import os
import resource
import socket
import sys
from dataclasses import dataclass
from typing import Any

import ray.train
import ray.train.torch
import torch

from ray_ddp.compat.train_logging import quiet_report_lines
from ray_ddp.worker.collectives import all_gather


@dataclass(frozen=True)
class Worker:
    rank: int
    """World rank: 0..world_size-1 across the whole run (never the local rank)."""
    local_rank: int
    """Index on this node (the GPU a torchrun script would ``set_device`` to)."""
    world_size: int
    device: torch.device
    """Ray pinned the worker to it: ``cuda:<local>`` with GPUs, else ``cpu``."""
    log_prefix: str = ""
    """Put before every line (a Tune trial's id, ``[rank N]`` with --log-all-ranks)."""
    log_all_ranks: bool = False

    @property
    def is_main(self) -> bool:
        """Rank 0 logs and writes checkpoints: one voice per run, not one per node."""
        return self.rank == 0

    def log(self, message: str) -> None:
        # Straight to stdout: Ray Train patches print() into its logger, which echoes
        # every line twice on the driver.
        if self.is_main or self.log_all_ranks:
            prefix = self.log_prefix
            sys.stdout.write(prefix + message.replace("\n", "\n" + prefix) + "\n")
            sys.stdout.flush()


def start_worker(
    cpus_per_worker: float, log_prefix: str = "", log_all_ranks: bool = False
) -> Worker:
    """This process as a worker: its ranks and device, its share of the CPU, quiet logs."""
    quiet_report_lines()
    context = ray.train.get_context()
    rank = context.get_world_rank()
    # Ray reserved cpus_per_worker CPUs for this process; more threads would oversubscribe.
    torch.set_num_threads(max(1, int(cpus_per_worker)))
    return Worker(
        rank=rank,
        local_rank=context.get_local_rank(),
        world_size=context.get_world_size(),
        device=ray.train.torch.get_device(),
        log_prefix=log_prefix + (f"[rank {rank}] " if log_all_ranks else ""),
        log_all_ranks=log_all_ranks,
    )


def rank_rows(worker: Worker) -> list[dict[str, Any]]:
    """Every rank's placement (a collective: every rank calls it), for the rank table."""
    return all_gather(
        {
            "rank": worker.rank,
            "local_rank": worker.local_rank,
            "node_rank": ray.train.get_context().get_node_rank(),
            "host": socket.gethostname(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "device": str(worker.device),
        }
    )


def peak_memory(device: torch.device) -> tuple[float, str]:
    """This process's peak memory in MB: CUDA peak allocated on GPU, resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "CUDA peak allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "peak RSS"
