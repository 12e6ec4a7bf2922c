"""Streaming Parquet (``--parquet-read stream``) without Ray: the two-level order keeps
the global order's promises, each rank reads only its own row groups, each group once,
with a bounded number held, and every row decodes to what was written. (Training on
streamed shards from S3, killed and resumed, is in test_s3_storage.)"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
from formats import SimulatedLayout, write_parquet_shards

from ray_ddp.config import TrainConfig
from ray_ddp.data.order.shards import StreamedShard
from ray_ddp.data.order.streamed_batches import StreamedBatches
from ray_ddp.data.order.streaming import StreamedOrder, streaming_order
from ray_ddp.data.parquet_stream import READ_AHEAD, SplitLayout, StreamingParquet
from ray_ddp.image_classification.datasets import build_datasets, describe_dataset

SIZES = (16, 16, 9, 16, 16, 5, 16, 16, 16, 10)  # ten row groups, some short


@pytest.fixture
def shards(tmp_path):
    labels = write_parquet_shards(str(tmp_path), train=300, val=50, shards=3, group_rows=16)
    cfg = TrainConfig(dataset="parquet", data_dir=str(tmp_path), image_size=8, batch_size=8)
    return cfg, labels


def _batches(train: StreamingParquet, epoch: int, rank: int, world: int, start=0, **kw):
    order = StreamedBatches(
        train, buffer=kw.get("buffer", 40), batch_size=8, global_batch=kw.get("global_batch", 32),
        seed=kw.get("seed", 1), rank=rank, world_size=world, tag_epoch=False,
    )  # fmt: skip
    order.set_position(epoch, start)
    return order, [[row.index for row in batch] for batch in order]


def test_the_order_is_a_seeded_permutation_the_same_at_every_world_size():
    for made in (StreamedOrder, streaming_order):  # today's, and versions 1 and 2's
        one = list(made(SIZES, 20, seed=4, epoch=0, lanes=4, batch_size=5))
        assert sorted(one) == list(range(sum(SIZES)))
        assert one == list(made(SIZES, 20, seed=4, epoch=0, lanes=4, batch_size=5))
        assert one != list(made(SIZES, 20, seed=5, epoch=0, lanes=4, batch_size=5))
        assert one != list(made(SIZES, 20, seed=4, epoch=1, lanes=4, batch_size=5))
        # A window of the buffer never mixes rows further apart than buffer + a group or two.
        assert one != sorted(one)
    # The same cut, other draws: today's order is not the one older checkpoints count in.
    assert list(StreamedOrder(SIZES, 20, 4, 0, 4, 5)) != streaming_order(SIZES, 20, 4, 0, 4, 5)


def test_every_row_once_per_epoch_across_two_ranks_and_rows_decode_to_their_labels(shards):
    cfg, labels = shards
    train, _, info = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
    assert isinstance(train, StreamingParquet) and info.train_size == 300 == len(train)
    for epoch in (0, 1):
        seen = []
        for rank in (0, 1):
            order, batches = _batches(train, epoch, rank, 2)
            seen += [
                i for b, s in zip(batches, order.slots, strict=True) if not s.filler for i in b
            ]
            for rows, slot in zip(order, order.slots, strict=True):  # fetched = planned
                assert [r.index for r in rows] == slot.indices
                for r in rows:
                    assert r.values[1] == labels["train"][r.index]
                    assert r.source.endswith(f"row {r.index % 100}")  # 100 rows a shard
        assert sorted(seen) == list(range(300))
    # A row decodes into the image written for it: the class colour is the bright channel.
    image, label = train[7]
    assert int(label) == labels["train"][7]
    assert int(image.mean(dim=(1, 2)).argmax()) == int(label) % 3


def test_one_seed_one_order_and_two_seeds_two(shards):
    cfg, _ = shards
    train, _, _ = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
    assert _batches(train, 0, 0, 2)[1] == _batches(train, 0, 0, 2)[1]
    assert _batches(train, 0, 0, 2)[1] != _batches(train, 0, 0, 2, seed=2)[1]
    assert _batches(train, 0, 0, 2)[1] != _batches(train, 1, 0, 2)[1]


def test_the_same_steps_train_the_same_rows_at_one_and_two_workers(shards):
    cfg, _ = shards
    train, _, _ = build_datasets(cfg.data, cfg.target, cfg.optim.seed)

    def per_step(world: int) -> dict[int, list[int]]:
        steps: dict[int, list[int]] = {}
        for rank in range(world):
            order, batches = _batches(train, 0, rank, world)
            for slot, rows in zip(order.slots, batches, strict=True):
                if not slot.filler:  # a short last step's stand-in, weighing 0
                    steps.setdefault(slot.step, []).extend(rows)
        return {s: sorted(r) for s, r in steps.items()}

    assert per_step(1) == per_step(2) == per_step(4)


def test_a_resumed_epoch_continues_with_exactly_the_rows_left(shards):
    cfg, _ = shards
    train, _, _ = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
    order, whole = _batches(train, 1, 1, 2)
    start = order.plan.step_start(3)
    resumed = _batches(train, 1, 1, 2, start=start)[1]
    assert resumed == whole[len(whole) - len(resumed) :] and len(resumed) < len(whole)


def test_each_rank_reads_only_its_lanes_groups_each_once_and_holds_few(shards, monkeypatch):
    cfg, _ = shards
    train, _, _ = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
    reads: Counter = Counter()
    held = []
    real_read = SplitLayout.read

    def counting_read(self, piece):
        reads[(piece.file, piece.group)] += 1
        return real_read(self, piece)

    monkeypatch.setattr(SplitLayout, "read", counting_read)
    per_rank = {}
    for rank in (0, 1):
        reads.clear()
        held.clear()  # each rank's stream against its own high-water mark
        order = StreamedBatches(
            train, buffer=32, batch_size=8, global_batch=16, seed=1, rank=rank, world_size=2,
            tag_epoch=False,
        )  # fmt: skip
        stream = train.stream((s.indices for s in order.slots), order.horizon)
        for _ in stream:
            held.append(len(stream._cache))
        assert max(reads.values()) == 1  # each group read once in a pass
        assert max(held) <= stream.held <= order.held_bound()
        per_rank[rank] = set(reads)
    groups = {(p.file, p.group) for p in train.pieces}
    # Lanes split the epoch's groups between the ranks: the ranks share only the groups
    # cut by a lane boundary and those of the lanes' short tails at the epoch's end.
    shared = per_rank[0] & per_rank[1]
    assert per_rank[0] | per_rank[1] == groups
    assert len(shared) <= 4, shared
    # The bound: a 32-row window spans at most 3 groups of 16, and with one window being
    # left and the next begun, 4, plus the read-ahead.
    assert stream.held <= 4 + 1 + READ_AHEAD


def test_a_stream_plans_as_it_goes_and_drops_what_its_look_ahead_no_longer_needs():
    """A row stream reads the batches as they come (a generator here, never listed): a
    group is read when first needed, kept while a batch within ``horizon`` needs it, else
    dropped, and read again if needed later."""
    layout = SimulatedLayout([4, 4, 4, 4])
    split = StreamingParquet(layout, lambda x, y: (x, y))
    batches = [[0, 1], [4, 2], [8], [5, 12], [13], [0]]
    seen = [[r.index for r in rows] for rows in split.stream(iter(batches), horizon=1)]
    assert seen == batches
    assert layout.reads == {0: 2, 1: 2, 2: 1, 3: 1}  # 0 and 1 came back after a gap
    layout.reads.clear()
    stream = split.stream(iter(batches), horizon=5)
    assert [[r.values[1] for r in rows] for rows in stream] == batches
    assert layout.reads == {0: 1, 1: 1, 2: 1, 3: 1} and stream.held <= 4


def test_evaluation_shards_are_contiguous_and_cover_every_row_once(shards):
    cfg, labels = shards
    _, val, _ = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
    rows = []
    for rank in range(3):
        sampler = StreamedShard(val, rank, 3)
        mine = list(sampler)
        assert [r.index for r in mine] == [sampler.global_index(p) for p in range(len(mine))]
        rows += mine
    assert [r.index for r in rows] == list(range(50))
    assert [r.values[1] for r in rows] == labels["val"]


def test_a_subset_is_whole_row_groups_and_seeded(shards):
    cfg, _ = shards
    cfg = dataclasses.replace(cfg, train_samples=70)
    train, _, info = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
    again, _, _ = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
    assert len(train) == 70 == info.train_size
    assert [p.group for p in train.pieces] == [p.group for p in again.pieces]
    assert [p.rows for p in train.pieces][:-1] == [16] * (len(train.pieces) - 1)
    assert np.array_equal(train.starts, np.cumsum([0] + [p.rows for p in train.pieces])[:-1])


def test_memory_mode_reads_the_same_rows(shards):
    cfg, labels = shards
    memory, _, _ = build_datasets(
        dataclasses.replace(cfg.data, parquet_read="memory"), cfg.target, cfg.optim.seed
    )
    streamed, _, _ = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
    assert len(memory) == len(streamed) == 300
    for index in (0, 99, 100, 299):
        assert memory[index][0].equal(streamed[index][0])
    assert describe_dataset(cfg.data, cfg.target).num_classes == 3


def held_bound(workers: int, micro: int, buffer: int, group_rows: int, batch: int) -> int:
    """docs/data.md's bound on row groups a worker holds (its last term is the read-ahead)."""
    buffer = -(-buffer // batch) * batch
    return (-(-micro // workers) + 2) * (-(-buffer // group_rows) + 2) + READ_AHEAD


def test_the_row_groups_held_stay_within_the_documented_bound():
    """Streams of simulated row groups (no files) over random settings: the groups held at
    once stay within docs/data.md's bound and the log's (``held_bound``), and each group
    is read once a pass, but those a lane boundary cuts between two lanes of one rank
    (read at each lane's turn: at most twice, at most lanes - 1 of them)."""
    rng = np.random.default_rng(0)
    for _ in range(25):
        group, batch = int(rng.choice([7, 16, 50])), int(rng.choice([4, 8, 16]))
        micro = int(rng.choice([1, 2, 3, 8]))
        workers = int(rng.choice([w for w in (1, 2, 3, 8) if w <= micro]))
        buffer = int(rng.choice([max(1, group // 2), group, 3 * group, 300]))
        rows = int(rng.integers(micro * batch * 2, 1500))
        sizes = [group] * (rows // group) + ([rows % group] if rows % group else [])
        bound = held_bound(workers, micro, buffer, group, batch)
        layout = SimulatedLayout(sizes)
        split = StreamingParquet(layout, lambda x, y: (x, y))
        for epoch in range(2):
            for rank in range(workers):
                order = StreamedBatches(
                    split, buffer=buffer, batch_size=batch, global_batch=batch * micro,
                    seed=0, rank=rank, world_size=workers, tag_epoch=False,
                )  # fmt: skip
                order.set_position(epoch, 0)
                layout.reads.clear()
                stream = split.stream((s.indices for s in order.slots), order.horizon)
                for fetched, slot in zip(stream, order.slots, strict=True):
                    assert [r.index for r in fetched] == slot.indices
                case = (rows, group, buffer, batch, micro, workers, stream.held, bound)
                assert stream.held <= order.held_bound() <= bound, case
                twice = [g for g, n in layout.reads.items() if n > 1]
                assert max(layout.reads.values()) <= 2 and len(twice) <= micro - 1, case
