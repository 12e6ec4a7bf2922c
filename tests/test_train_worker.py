"""Pieces of the worker loop that need no cluster: out-of-memory errors explained."""

from __future__ import annotations

import pytest
import torch

from ray_ddp.config import TrainConfig
from ray_ddp.worker.epoch import explain_oom
from ray_ddp.worker.identity import Worker

WORKER = Worker(rank=1, local_rank=1, world_size=4, device=torch.device("cpu"))


class RunsOutOfMemory(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize(
    ("phase", "size"),
    [("training", "--batch-size 64"), ("evaluation", "batches of 2 x --batch-size = 128")],
)
def test_out_of_memory_names_the_batch_in_training_and_in_evaluation(phase, size):
    cfg = TrainConfig(batch_size=64, accum_steps=2, num_workers=4)  # resolved, as in a worker
    oom = explain_oom(cfg.optim.batch_size, cfg.global_batch_size, WORKER, phase)
    with pytest.raises(RuntimeError) as raised, oom:
        RunsOutOfMemory()(torch.zeros(1))
    message = str(raised.value)
    assert message.startswith(f"out of memory on rank 1 (cpu) during {phase} with {size}")
    assert "keep the global batch of 512" in message  # 64 x 4 workers x 2
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)


def test_other_errors_pass_through_unchanged():
    with (
        pytest.raises(ValueError, match="not memory"),
        explain_oom(32, 64, WORKER, "training"),
    ):
        raise ValueError("not memory")
