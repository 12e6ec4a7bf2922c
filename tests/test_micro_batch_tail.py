"""One rule cuts an epoch into micro-batches in every engine: ``--batch-size`` samples each,
and a last one of a single sample joins the one before it. The in-memory order
(``EpochPlan``) and Ray Data's stream (``StreamOrder``) must cut the same rows alike, and
each must train the steps it counts (issue 27 #8: with ``--batch-size 1`` the Ray Data
engine expected one step more than it trained). No Ray: the stream is what Ray Data's
iterator delivers, full batches and a short last one."""

from __future__ import annotations

import pytest
import torch

from ray_ddp.data.order.global_order import EpochPlan
from ray_ddp.data.ray_data.worker import StreamOrder


class Stream:
    """A rank's ``rows`` rows as ``DataIterator.iter_torch_batches`` delivers them:
    batches of ``batch_size``, the last one short where it does not divide them."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def iter_torch_batches(self, batch_size, **options):
        for start in range(0, self.rows, batch_size):
            n = min(batch_size, self.rows - start)
            yield {"input": torch.zeros(n, 1), "label": torch.arange(start, start + n)}


def stream_epoch(rows: int, batch_size: int, per_rank: int, world_size: int):
    """What the last rank of ``world_size`` trains of an epoch whose split gives each
    rank ``rows`` rows: its slots (sizes and steps) and the order's counts."""
    order = StreamOrder(
        Stream(rows), size=rows * world_size + world_size - 1, batch_size=batch_size,
        global_batch=batch_size * per_rank * world_size, seed=0, rank=world_size - 1,
        world_size=world_size, shuffle_buffer=8, pin_memory=False, take_bad=None,
    )  # fmt: skip
    expected = len(order.slots)
    slots, labels = [], []
    for slot in order.slots:
        slots.append(slot)
        labels += order.ready.popleft()[1].tolist()
    assert labels == list(range(rows))  # every row once, in the stream's order
    return slots, order.steps, expected


# Rows of a rank and --batch-size where the last batch holds one row (all of them do at
# --batch-size 1), then some where it does not; per_rank: micro-batches a rank trains a step.
CASES = [
    (1, 1, 1), (2, 1, 1), (7, 1, 1), (7, 1, 2), (8, 1, 3), (6, 1, 3),
    (9, 4, 1), (17, 4, 2), (33, 16, 1), (3, 2, 1), (13, 3, 2),
    (1, 4, 1), (8, 4, 1), (10, 4, 2), (150, 16, 1),
]  # fmt: skip


@pytest.mark.parametrize(("rows", "batch_size", "per_rank"), CASES)
@pytest.mark.parametrize("world_size", [1, 2])
def test_both_engines_cut_rows_alike_and_train_the_steps_they_count(
    rows, batch_size, per_rank, world_size
):
    slots, steps, expected = stream_epoch(rows, batch_size, per_rank, world_size)
    trained_steps = len({slot.step for slot in slots})
    assert (steps, expected) == (trained_steps, len(slots))  # Ray Data counts what it trains
    plan = EpochPlan(rows, batch_size, batch_size * per_rank, seed=0, epoch=0)
    in_memory = plan.slots(0, 1)
    assert [s.size for s in in_memory] == [s.size for s in slots]  # one rule, both engines
    assert plan.steps == len({s.step for s in in_memory}) == trained_steps
    assert plan.step_start(plan.steps) == rows
