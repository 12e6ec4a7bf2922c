"""The epoch's global order: every sample once per epoch, the same optimizer steps at any
world size, exact positions to resume from, and weights that make each step the mean
over its samples (no Ray, no torch.distributed: the plan is arithmetic)."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from ray_ddp.config.batch import accumulation, busy_share
from ray_ddp.data.order.global_order import EpochPlan

# (training samples, per-worker batch, global batch, world sizes that keep it)
CASES = [
    (1000, 32, 128, (1, 2, 3, 4)),  # 3 workers: 2, 1 and 1 micro-batches per step
    (50, 4, 8, (1, 2)),
    (49, 8, 48, (1, 2, 3, 4, 5, 6)),  # 49 = 6 x 8 + 1: the 1-sample tail joins its neighbour
    (10, 4, 16, (1, 2, 3, 4)),  # one step, fewer micro-batches than ranks: fillers
    (7, 2, 12, (1, 2, 3, 6)),
    (1000, 64, 512, (4, 5, 6, 7, 8)),  # an elastic 4-8 range
]


def _steps(plan: EpochPlan, world: int) -> dict[int, dict[int, list[int]]]:
    """step -> micro-batch number -> indices, from every rank's slots (fillers left out)."""
    steps: dict[int, dict[int, list[int]]] = defaultdict(dict)
    for rank in range(world):
        for slot in plan.slots(rank, world):
            if not slot.filler:
                assert slot.micro not in steps[slot.step], "two ranks train one micro-batch"
                steps[slot.step][slot.micro] = slot.indices
    return dict(steps)


@pytest.mark.parametrize(("size", "batch", "global_batch", "worlds"), CASES)
def test_every_sample_once_per_epoch_at_every_world_size(size, batch, global_batch, worlds):
    plan = EpochPlan(size, batch, global_batch, seed=3, epoch=2)
    for world in worlds:
        trained = Counter(
            i for step in _steps(plan, world).values() for m in step.values() for i in m
        )
        assert trained == Counter(range(size)), world
        slots = [plan.slots(rank, world) for rank in range(world)]
        assert all(len(slot.indices) != 1 for s in slots for slot in s), "no 1-sample batch"
        # DDP: every rank runs exactly one all-reducing backward per step, its last.
        for rank_slots in slots:
            assert [s.step for s in rank_slots if s.boundary] == list(range(plan.steps))
            last_of_step = {s.step: i for i, s in enumerate(rank_slots)}
            assert all(rank_slots[i].boundary for i in last_of_step.values())
        # Where the world size does not divide a step's micro-batches, counts differ by one.
        per_rank = [
            [sum(1 for x in s if x.step == step) for s in slots] for step in range(plan.steps)
        ]
        assert all(max(c) - min(c) <= 1 for c in per_rank)


@pytest.mark.parametrize(("size", "batch", "global_batch", "worlds"), CASES)
def test_the_steps_are_the_same_at_every_world_size(size, batch, global_batch, worlds):
    """The same samples in the same micro-batches make the same optimizer steps, so the
    same gradients (up to the order floats are added in) at 1, 2, ... workers."""
    plan = EpochPlan(size, batch, global_batch, seed=3, epoch=0)
    reference = _steps(plan, 1)
    for world in worlds[1:]:
        assert _steps(plan, world) == reference, world


@pytest.mark.parametrize(("size", "batch", "global_batch", "worlds"), CASES)
def test_each_step_weighs_its_samples_equally(size, batch, global_batch, worlds):
    """DDP averages over ranks; each micro-batch's mean loss is scaled by size x world /
    step samples, so every sample of a step weighs 1 / step samples, fillers 0."""
    plan = EpochPlan(size, batch, global_batch, seed=3, epoch=0)
    for world in worlds:
        weight: dict[int, float] = defaultdict(float)
        for rank in range(world):
            for slot in plan.slots(rank, world):
                weight[slot.step] += slot.size * world / slot.step_samples / world
        assert all(w == pytest.approx(1.0) for w in weight.values()), (world, weight)


def test_a_position_resumes_with_exactly_the_remaining_steps_at_any_world_size():
    full = EpochPlan(1000, 32, 128, seed=7, epoch=1)
    for done in (0, 3, 7):
        rest = EpochPlan(1000, 32, 128, seed=7, epoch=1, start=full.step_start(done))
        assert rest.start == done * 128 and rest.first_step == done
        assert rest.steps == full.steps - done
        for world in (1, 2, 4):
            expected = {s - done: m for s, m in _steps(full, 4).items() if s >= done}
            assert _steps(rest, world) == expected
    assert full.step_start(full.steps) == 1000


def test_the_order_changes_every_epoch_and_not_between_runs():
    def order(epoch: int, seed: int = 0) -> list[int]:
        return EpochPlan(100, 10, 20, seed=seed, epoch=epoch).order()

    assert order(0) == order(0)
    assert order(0) != order(1)
    assert order(0, seed=1) != order(0)
    assert sorted(order(5)) == list(range(100))


def test_an_uneven_split_gives_the_first_ranks_one_more_and_a_short_last_step_fillers():
    plan = EpochPlan(1000, 64, 512, seed=0, epoch=0)  # 8 micro-batches per step
    counts = [sum(1 for s in plan.slots(r, 6) if s.step == 0) for r in range(6)]
    assert counts == [2, 2, 1, 1, 1, 1]
    # The last step holds 1000 - 512 = 488 samples, 8 micro-batches (the last 40): all
    # real on every rank; with 10 samples and 4 ranks the only step has 3 micro-batches.
    small = EpochPlan(10, 4, 16, seed=0, epoch=0)
    fillers = [[s.filler for s in small.slots(r, 4)] for r in range(4)]
    assert fillers == [[False], [False], [False], [True]]
    assert small.slots(3, 4)[0].size == 0 and small.slots(3, 4)[0].boundary


def test_a_rank_trains_micro_batches_round_robin_within_a_step():
    """Rank r of W takes micro-batches r, r + W, ... of each step; the last is its
    all-reducing one."""
    slots = EpochPlan(64, 4, 16, seed=0, epoch=0).slots(rank=1, world_size=2)
    assert [(s.step, s.micro, s.boundary) for s in slots[:4]] == [
        (0, 1, False),
        (0, 3, True),
        (1, 1, False),
        (1, 3, True),
    ]


def test_accumulation_is_the_most_micro_batches_a_rank_trains():
    assert accumulation(128, 32, 1) == 4
    assert accumulation(128, 32, 4) == 1
    assert accumulation(128, 32, 3) == 2  # 2, 1, 1
    assert busy_share(4, 3) == pytest.approx(4 / 6) and busy_share(8, 4) == 1.0
    with pytest.raises(ValueError, match="3 workers need at least 3 micro-batches per step"):
        accumulation(64, 32, 3)
    with pytest.raises(ValueError, match="not a whole number of micro-batches of 48"):
        accumulation(128, 48, 1)
