"""Property tests of the epoch order (``ray_ddp.data.order``), drawn by hypothesis over
random layouts: the streamed two-level shuffle (row groups of 1..50 rows, 1..40 of them,
any shuffle buffer) and the in-memory permutation (``pieces=None``), any micro-batch size,
1..8 micro-batches per step, every world size the step allows, any seed and epoch, and a
resume at step boundaries at another world size.

What an order promises (``global_order``'s and ``streaming``'s docstrings):

1. an epoch trains every row exactly once, over all ranks (fillers aside);
2. its micro-batches (the indices of each (step, micro-batch)) do not depend on the
   world size;
3. resumed at step ``k``'s start, at any world size, it trains exactly the rows that
   steps ``< k`` did not, each once, in the same micro-batches;
4. each slot's ``step_samples`` is the sum of its step's micro-batches' sizes (so the
   micro-batch weights of a step add up to one);
5. the streamed order reads locally: micro-batch ``j`` of every whole step comes from lane
   ``j`` (a contiguous run of the epoch's row-group order), within one shuffle window;
6. the in-memory order (``permutation.KeyedPermutation``) is a bijection of ``[0, N)``,
   at any N (to 2**62, through its inverse), and a rank's slots, computed when read, are
   those of a plan resumed there, at a billion samples too;
7. today's streamed order (``streaming.StreamedOrder``), computed at any position, is the
   order its definition makes whole, window after window; at a billion rows in up to
   1e5 row groups, a step's micro-batches are the same read from the epoch's plan at one
   world size and from a plan resumed at that step at another.

Each order is drawn in both its versions: the in-memory one in ``ORDER_VERSION`` and the
first, ``torch.randperm``; the streamed one in ``streaming.STREAMED_VERSION`` and the
whole-list order of versions 1 and 2 (a checkpoint of an older version finishes its epoch
in it).

The locality checks do not re-derive the implementation's random draws: they check what
any order with lanes and windows must satisfy (see ``_assert_lanes_are_local``).

No Ray, no torch.distributed: the fast tier. ``max_examples`` keeps the file to a few
seconds; ``database=None`` leaves no ``.hypothesis`` folder in the working tree.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_ddp.data.order.global_order import ORDER_VERSION, RANDPERM_VERSION, EpochPlan, Slot
from ray_ddp.data.order.permutation import KeyedPermutation
from ray_ddp.data.order.streaming import STREAMED_VERSION, StreamedOrder

PROPERTIES = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
MAX_WORLD = 8
ALL_BOUNDARIES = 48
"""Up to this many optimizer steps an epoch is resumed at every step boundary; longer
epochs (micro-batches of a few rows) at its first two, its last two and up to 16 drawn
ones."""

Steps = dict[tuple[int, int], list[int]]
"""(step, micro-batch) -> the indices trained in it."""


@st.composite
def plans(draw: st.DrawFn, streamed: bool) -> EpochPlan:
    if streamed:  # many row groups as often as few
        rows = st.integers(1, 50)
        layout = st.one_of(
            st.lists(rows, min_size=1, max_size=40), st.lists(rows, min_size=20, max_size=40)
        )
        pieces = tuple(draw(layout))
        size = sum(pieces)
    else:
        pieces, size = None, draw(st.integers(1, 2000))
    batch = draw(st.one_of(st.integers(1, 8), st.integers(1, 64)))
    per_step = draw(st.integers(1, 8))
    return EpochPlan(
        size,
        batch,
        batch * per_step,
        seed=draw(st.integers(0, 2**63 - 1)),  # --seed's range
        epoch=draw(st.integers(0, 1000)),
        pieces=pieces,
        buffer=draw(st.integers(1, 300)) if streamed else 0,
        version=draw(
            st.sampled_from(
                [STREAMED_VERSION, ORDER_VERSION] if streamed else [ORDER_VERSION, RANDPERM_VERSION]
            )
        ),
    )


def worlds(plan: EpochPlan) -> list[int]:
    """Every world size the plan's global batch allows (config.batch.accumulation)."""
    return list(range(1, min(MAX_WORLD, plan.micro_per_step) + 1))


def trained(plan: EpochPlan, world: int, lockstep: bool = False) -> Steps:
    """Every rank's slots at ``world``, checked for their shape, as (step, micro) -> indices
    of the real micro-batches (each trained by exactly one rank)."""
    ranks = [plan.slots(rank, world, lockstep) for rank in range(world)]
    steps: Steps = {}
    for slots in ranks:
        for slot in slots:
            if not slot.filler:
                assert (slot.step, slot.micro) not in steps, "two ranks train one micro-batch"
                steps[(slot.step, slot.micro)] = slot.indices
    counts: dict[int, int] = defaultdict(int)
    samples: dict[int, int] = defaultdict(int)
    for (step, _), indices in steps.items():
        counts[step] += 1
        samples[step] += len(indices)
    assert sorted(counts) == list(range(plan.steps))
    for rank, slots in enumerate(ranks):
        _assert_rank_slots(slots, rank, world, counts, samples, steps, lockstep)
    return steps


def _assert_rank_slots(
    slots: list[Slot],
    rank: int,
    world: int,
    counts: dict[int, int],
    samples: dict[int, int],
    steps: Steps,
    lockstep: bool,
) -> None:
    """Rank ``rank`` takes part in every step, in order: micro-batches rank, rank + world,
    ... of it, or one filler (the step's first micro-batch again, weight 0) where the step
    has none for it; in ``lockstep`` (FSDP2) fillers after its own up to the step's most,
    ``ceil(micro-batches / world)``, so every rank runs as many passes; its last slot of a
    step, and only that one, all-reduces; every slot carries its step's sample count, the
    sum of its micro-batches' sizes (property 4: the loop's weights, size x world /
    step_samples with DDP dividing by world, then make each step the mean over its
    samples)."""
    by_step: dict[int, list[Slot]] = defaultdict(list)
    for slot in slots:
        by_step[slot.step].append(slot)
    assert [s.step for s in slots] == sorted(s.step for s in slots), "steps out of order"
    assert sorted(by_step) == sorted(counts), f"rank {rank} misses a step"
    for step, mine in by_step.items():
        micros = counts[step]
        own = list(range(rank, micros, world))
        passes = -(-micros // world) if lockstep else max(1, len(own))
        assert [s.micro for s in mine] == own + list(range(micros, micros + passes - len(own)))
        assert [s.boundary for s in mine] == [False] * (len(mine) - 1) + [True]
        assert all(s.step_samples == samples[step] for s in mine), "step_samples is not its sum"
        assert [s.filler for s in mine] == [False] * len(own) + [True] * (passes - len(own))
        for filler in mine[len(own) :]:
            assert filler.size == 0 and filler.indices == steps[(step, 0)]


def _assert_one_epoch(plan: EpochPlan, steps: Steps) -> None:
    """Property 1, and how the order is cut: the micro-batches, in (step, micro) order, are
    the epoch's order cut into runs of ``batch_size`` (a 1-row tail joined to the run
    before it), ``micro_per_step`` runs a step; so every row exactly once."""
    order = plan.order()
    assert sorted(order) == list(range(plan.size)), "the order is not a permutation"
    keys = sorted(steps)
    assert [i for key in keys for i in steps[key]] == order[plan.start :]
    counts = Counter(step for step, _ in keys)
    per_step = [counts[step] for step in range(plan.steps)]
    assert all(n == plan.micro_per_step for n in per_step[:-1]), "a step before the last"
    assert 1 <= per_step[-1] <= plan.micro_per_step
    sizes = [len(steps[key]) for key in keys]
    assert all(n == plan.batch_size for n in sizes[:-1])
    if plan.size - plan.start == 1:
        assert sizes == [1]
    else:  # never a micro-batch of one row (BatchNorm cannot train on one)
        assert 2 <= sizes[-1] <= plan.batch_size + 1


def _assert_epoch(plan: EpochPlan) -> Steps:
    """Properties 1, 2 and 4 at every world size; returns the micro-batches."""
    reference = trained(plan, 1)
    _assert_one_epoch(plan, reference)
    for world in worlds(plan)[1:]:
        assert trained(plan, world) == reference, f"world size {world} trains other batches"
    return reference


def _boundaries(plan: EpochPlan, data: st.DataObject) -> list[int]:
    """The step boundaries inside the epoch (its end: ``test_the_epoch_s_end_...``)."""
    if plan.steps <= ALL_BOUNDARIES:
        return list(range(plan.steps))
    drawn = data.draw(st.sets(st.integers(0, plan.steps - 1), min_size=1, max_size=16))
    return sorted({0, 1, plan.steps - 2, plan.steps - 1} | drawn)


def _resumed(plan: EpochPlan, start: int) -> EpochPlan:
    return EpochPlan(
        plan.size, plan.batch_size, plan.global_batch, plan.seed, plan.epoch, start,
        plan.pieces, plan.buffer, plan.version,
    )  # fmt: skip


def _assert_resumes(plan: EpochPlan, steps: Steps, data: st.DataObject) -> None:
    """Property 3: from every step boundary ``k`` (its position ``step_start(k)``), at a
    drawn world size, the rest of the epoch is exactly the steps ``>= k`` (those trained at
    any world size: property 2), each of its positions the same."""
    sizes = worlds(plan)
    assert plan.step_start(plan.steps) == plan.size
    for k in _boundaries(plan, data):
        start = plan.step_start(k)
        assert start == k * plan.global_batch
        rest = _resumed(plan, start)
        assert rest.steps == plan.steps - k and rest.first_step == k
        # The same cut from there; a checkpoint inside a resumed pass records
        # rest.step_start(j) (worker/step.py): the same positions as the whole epoch's.
        assert rest.bounds() == [b for b in plan.bounds() if b[0] >= start]
        for j in {0, 1, rest.steps - 1, rest.steps} - {-1, rest.steps + 1}:
            assert rest.step_start(j) == plan.step_start(k + j)
        world = data.draw(st.sampled_from(sizes), label=f"world size resumed at step {k}")
        resumed = {(s + k, m): idx for (s, m), idx in trained(rest, world).items()}
        assert resumed == {(s, m): idx for (s, m), idx in steps.items() if s >= k}
        before = [i for (s, _), idx in steps.items() if s < k for i in idx]
        after = [i for idx in resumed.values() for i in idx]
        assert sorted(before + after) == list(range(plan.size)), "not every row exactly once"


def _assert_lanes_are_local(plan: EpochPlan, steps: Steps) -> None:
    """Property 5. The streamed order cuts the rows, in the epoch's row-group order, into
    ``micro_per_step`` lanes of ``size // lanes`` or one more rows, and micro-batch ``j`` of
    each of the ``(size // lanes) // batch_size`` whole steps comes from lane ``j``, from one
    window of ``buffer`` rows rounded up to whole micro-batches. Without re-drawing the
    group order, that means:

    - a lane boundary splits at most one row group: the (lane, group) pairs read are at
      most groups + lanes - 1;
    - the lanes reading one group are consecutive, and those strictly between the first
      and the last read that group only;
    - a window's rows come from consecutive groups: leaving out its two largest groups,
      the rest fit in the window.

    The 1-row tail of ``batch_size`` 1 (joined to the micro-batch before it) is the one
    micro-batch of a whole step that may span two lanes: micro-batches of another size than
    ``batch_size`` are left out."""
    pieces, lanes, batch = plan.pieces, plan.micro_per_step, plan.batch_size
    assert pieces is not None
    group = np.repeat(np.arange(len(pieces)), pieces)
    whole = (plan.size // lanes) // batch
    window = -(-plan.buffer // batch) * batch
    read: list[set[int]] = [set() for _ in range(lanes)]
    windows: dict[tuple[int, int], set[int]] = defaultdict(set)
    for (step, lane), indices in steps.items():
        if step < whole and len(indices) == batch:
            groups = {int(g) for g in group[indices]}
            read[lane] |= groups
            windows[(lane, step * batch // window)] |= groups
    assert sum(len(g) for g in read) <= len(pieces) + lanes - 1, "lanes share row groups"
    for g in set().union(*read):
        readers = [lane for lane in range(lanes) if g in read[lane]]
        assert readers == list(range(readers[0], readers[-1] + 1)), f"group {g}: {readers}"
        assert all(read[lane] == {g} for lane in readers[1:-1])
    for (lane, number), groups in windows.items():
        rows = sorted((pieces[g] for g in groups), reverse=True)
        assert sum(rows[2:]) <= window, f"lane {lane}'s window {number} spans far groups"


@PROPERTIES
@given(plan=plans(streamed=True), data=st.data())
def test_the_streamed_order_trains_every_row_once_alike_at_every_world_size(plan, data):
    steps = _assert_epoch(plan)
    _assert_resumes(plan, steps, data)


@PROPERTIES
@given(plan=plans(streamed=False), data=st.data())
def test_the_in_memory_order_trains_every_row_once_alike_at_every_world_size(plan, data):
    steps = _assert_epoch(plan)
    _assert_resumes(plan, steps, data)


@PROPERTIES
@given(plan=st.one_of(plans(streamed=False), plans(streamed=True)))
def test_in_lockstep_every_rank_runs_as_many_passes_per_step_on_the_same_micro_batches(plan):
    """FSDP2's order (``lockstep``): the same real micro-batches as DDP's at every world
    size (fillers aside), and every rank the same number of forward and backward passes in
    each step, a short step's (the epoch's last, or any where the world size does not
    divide the micro-batches) made up by weight-0 fillers."""
    reference = trained(plan, 1)
    for world in worlds(plan):
        assert trained(plan, world, lockstep=True) == reference
        counts = [Counter(s.step for s in plan.slots(r, world, True)) for r in range(world)]
        assert all(c == counts[0] for c in counts), f"ranks differ in passes at {world}"


@PROPERTIES
@given(plan=plans(streamed=True))
def test_the_streamed_order_reads_each_lane_from_its_own_row_groups(plan):
    _assert_lanes_are_local(plan, trained(plan, 1))


@PROPERTIES
@given(
    batch=st.integers(2, 64),
    per_step=st.integers(0, 8),
    rest=st.data(),
    streamed=st.booleans(),
)
def test_a_global_batch_that_is_not_whole_micro_batches_is_refused(batch, per_step, rest, streamed):
    """config.batch's rule: the global batch is a whole, positive number of micro-batches,
    and no more ranks than micro-batches; EpochPlan.slots refuses anything else."""
    extra = rest.draw(st.integers(1, batch - 1))
    pieces = (30, 7, 12) if streamed else None
    plan = EpochPlan(49, batch, batch * per_step + extra, seed=1, epoch=0, pieces=pieces, buffer=8)
    with pytest.raises(ValueError, match="not a whole number of micro-batches"):
        plan.slots(0, 1)
    if per_step:
        whole = EpochPlan(49, batch, batch * per_step, seed=1, epoch=0, pieces=pieces, buffer=8)
        world = rest.draw(st.integers(per_step + 1, per_step + 8))
        with pytest.raises(ValueError, match=f"{world} workers need at least {world}"):
            whole.slots(0, world)


@PROPERTIES
@given(plan=st.one_of(plans(streamed=False), plans(streamed=True)))
def test_the_epoch_s_end_is_a_position_with_no_steps_left(plan):
    """The position ``step_start(steps)`` (the epoch's size, past its last step) resumes to
    nothing: no steps, no slots on any rank. (Until global_order's ``micro_batch_count``,
    ``EpochPlan(1, 1, 1, seed=0, epoch=0, start=1).steps`` raised ValueError in bounds().)"""
    rest = _resumed(plan, plan.step_start(plan.steps))
    assert rest.steps == 0 and rest.bounds() == []
    assert all(rest.slots(rank, world) == [] for world in worlds(plan) for rank in range(world))


SEEDS = st.integers(0, 2**63 - 1)  # --seed's range
EPOCHS = st.integers(0, 10_000)


@PROPERTIES
@given(size=st.one_of(st.integers(1, 40), st.integers(1, 5000)), seed=SEEDS, epoch=EPOCHS)
def test_the_keyed_permutation_is_a_bijection_of_the_samples(size, seed, epoch):
    """Property 6: every position names one sample, every sample one position."""
    perm = KeyedPermutation(size, seed, epoch)
    values = perm.at(np.arange(size))
    assert sorted(values.tolist()) == list(range(size))
    assert perm.position_of(values).tolist() == list(range(size))
    assert list(perm) == values.tolist() == perm[:]


@PROPERTIES
@given(size=st.integers(2, 2**62), seed=SEEDS, epoch=EPOCHS, data=st.data())
def test_the_keyed_permutation_inverts_at_any_size(size, seed, epoch, data):
    """Property 6 where the samples cannot be listed: positions and samples drawn
    anywhere in ``[0, N)`` map into it and back (so no two positions share a sample)."""
    perm = KeyedPermutation(size, seed, epoch)
    drawn = st.lists(st.integers(0, size - 1), min_size=1, max_size=64)
    positions, samples = (np.asarray(data.draw(drawn), dtype=np.int64) for _ in range(2))
    values = perm.at(positions)
    assert ((values >= 0) & (values < size)).all()
    assert (perm.position_of(values) == positions).all()
    assert (perm.at(perm.position_of(samples)) == samples).all()


@PROPERTIES
@given(
    size=st.integers(10**6, 10**12),
    batch=st.integers(1, 64),
    per_step=st.integers(1, 8),
    lockstep=st.booleans(),
    data=st.data(),
)
def test_a_billion_samples_slots_are_those_of_a_plan_resumed_there(
    size, batch, per_step, lockstep, data
):
    """Property 3 at scale, sampled: a rank's slots of step ``k``, read from the epoch's
    plan (computed when read), are the slots of a plan resumed at step ``k`` at another
    world size's rank holding the same micro-batches; and reading them costs nothing up
    front (a billion samples would not fit as a list)."""
    plan = EpochPlan(size, batch, batch * per_step, seed=data.draw(SEEDS), epoch=3)
    world = data.draw(st.integers(1, per_step))
    rank = data.draw(st.integers(0, world - 1))
    k = data.draw(st.sampled_from([0, 1, plan.steps - 2, plan.steps - 1]).filter(lambda s: s >= 0))
    slots = plan.slots(rank, world, lockstep)
    rest = _resumed(plan, plan.step_start(k)).slots(rank, world, lockstep)
    turns = slots.turns(per_step)
    mine = [s for s in slots[k * turns : (k + 1) * turns] if s.step == k]
    theirs = [s for s in rest[:turns] if s.step == 0]
    assert [(s.indices, s.micro, s.boundary, s.filler) for s in mine] == [
        (s.indices, s.micro, s.boundary, s.filler) for s in theirs
    ]
    assert len(slots) == (plan.steps - 1) * turns + slots.last_turns
    assert all(0 <= i < size for s in mine for i in s.indices)


def _defined(pieces: tuple[int, ...], buffer: int, seed: int, epoch: int, lanes: int, batch: int):
    """``streaming``'s definition, step by step, made whole in lists: the row groups in
    their keyed order, their rows cut into lanes, each window of a lane put in its own
    keyed order, then every lane's next micro-batch a step, and the lanes' tails last."""
    window = -(-buffer // batch) * batch
    firsts = np.concatenate([[0], np.cumsum(pieces)[:-1]]).tolist()
    groups = KeyedPermutation(len(pieces), seed, epoch, 0)
    run = [firsts[g] + i for g in groups for i in range(pieces[g])]
    bounds = [lane * len(run) // lanes for lane in range(lanes + 1)]
    runs = []
    for j in range(lanes):
        lane = run[bounds[j] : bounds[j + 1]]
        for w, begin in enumerate(range(0, len(lane), window)):
            rows = lane[begin : begin + window]
            lane[begin : begin + window] = [
                rows[i] for i in KeyedPermutation(len(rows), seed, epoch, 1, j, w)
            ]
        runs.append(lane)
    full = min(len(lane) for lane in runs) // batch
    steps = [i for s in range(full) for lane in runs for i in lane[s * batch : (s + 1) * batch]]
    return steps + [i for lane in runs for i in lane[full * batch :]]


@PROPERTIES
@given(
    pieces=st.lists(st.integers(1, 300), min_size=1, max_size=60).map(tuple),
    buffer=st.integers(1, 700),
    lanes=st.integers(1, 16),
    batch=st.integers(1, 64),
    seed=SEEDS,
    epoch=EPOCHS,
    data=st.data(),
)
def test_today_s_streamed_order_at_any_position_is_its_definition_made_whole(
    pieces, buffer, lanes, batch, seed, epoch, data
):
    """Property 7: every position's row, computed from the position alone (in a drawn
    order, a few at a time), is the row the definition puts there; so every row once."""
    order = StreamedOrder(pieces, buffer, seed, epoch, lanes, batch)
    whole = _defined(pieces, buffer, seed, epoch, lanes, batch)
    assert sorted(whole) == list(range(sum(pieces))) and len(order) == len(whole)
    positions = data.draw(st.permutations(range(len(whole))))
    for begin in range(0, len(positions), 97):
        some = np.asarray(positions[begin : begin + 97], dtype=np.int64)
        assert order.at(some).tolist() == [whole[p] for p in some.tolist()]


@PROPERTIES
@given(
    size=st.integers(10**9, 10**12),
    groups=st.integers(1, 10**5),
    batch=st.integers(1, 64),
    per_step=st.integers(1, 8),
    buffer=st.integers(1, 4096),
    data=st.data(),
)
def test_a_billion_streamed_rows_resume_at_any_step_at_another_world_size(
    size, groups, batch, per_step, buffer, data
):
    """Property 7 at scale: ``size`` rows in about ``groups`` row groups of drawn sizes; a step
    ``k`` drawn anywhere in the epoch. Its micro-batches, read from the epoch's plan by
    every rank of one world size, are those a plan resumed at step ``k`` gives every rank
    of another: distinct rows of the split, each micro-batch from a window's few groups."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32)))
    cuts = np.unique(rng.integers(1, size, size=groups - 1))  # groups - 1 or a few fewer
    pieces = tuple(np.diff(np.concatenate([[0], cuts, [size]])).tolist())
    plan = EpochPlan(size, batch, batch * per_step, seed=data.draw(SEEDS), epoch=5,
                     pieces=pieces, buffer=buffer)  # fmt: skip
    k = data.draw(st.integers(0, plan.steps - 1), label="step")
    rest = _resumed(plan, plan.step_start(k))
    one, other = (data.draw(st.integers(1, per_step), label="world") for _ in range(2))

    def step(p: EpochPlan, world: int, number: int) -> dict[int, list[int]]:
        micro: dict[int, list[int]] = {}
        for rank in range(world):
            slots = p.slots(rank, world)
            turns = slots.turns(per_step)
            for s in slots[number * turns : (number + 1) * turns]:
                if s.step == number and not s.filler:
                    micro[s.micro] = s.indices
        return micro

    mine, theirs = step(plan, one, k), step(rest, other, 0)
    assert mine == theirs and len(mine) in (per_step, plan.micro_batches - k * per_step)
    rows = [i for indices in mine.values() for i in indices]
    assert len(set(rows)) == len(rows) and all(0 <= i < size for i in rows)
    starts = np.concatenate([[0], np.cumsum(pieces)[:-1]])
    window = -(-buffer // batch) * batch
    head = plan.order().head  # the lanes' whole batches; their tails end the epoch together
    for micro, indices in mine.items():  # locality: a window's rows, from neighbouring groups
        if plan.step_start(k) + (micro + 1) * batch > head:
            continue  # a micro-batch of the lanes' tails reads a few lanes' last groups
        read = np.unique(np.searchsorted(starts, indices, side="right") - 1)
        held = sorted((pieces[g] for g in read.tolist()), reverse=True)
        assert sum(held[2:]) <= window and len(indices) == batch
