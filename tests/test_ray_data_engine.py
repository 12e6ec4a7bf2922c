"""``--data-engine ray``: Ray Data reads, decodes and streams (ray_ddp.data.ray_data).

Fast tests check the pieces without Ray (refusals, decoding and skipping, the slots made
from a stream); one Ray Data pass without a trainer checks the split guarantees row by
row; two real 2-worker runs on Parquet check training, exact evaluation, unreadable rows
and a resume inside an epoch.
"""

from __future__ import annotations

import csv
import hashlib
import os
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from formats import class_image, png_bytes
from PIL import Image

from ray_ddp.cluster.resources import ClusterView, data_task_cpus
from ray_ddp.config import ConfigError, TrainConfig, validate
from ray_ddp.data.ray_data.decode import Decode, split_items, unreadable_actor
from ray_ddp.data.ray_data.driver import SplitBuilder, Splits
from ray_ddp.data.ray_data.worker import StreamOrder, expected_steps
from ray_ddp.data.unreadable import BATCH, SKIPPED
from ray_ddp.image_classification.transforms import has_random_transform, image_decoder

TASK = "ray_ddp.image_classification:ImageClassification"
SIZE = 16


def write_parquet_split(root: str, rows: int, bad: dict[int, bytes], seed: int) -> None:
    """``root/train/part-{0,1}.parquet`` (Hugging Face ``{bytes, path}`` image structs, row
    groups of 40) and ``root/val.parquet``: 3 classes told apart by colour. ``bad``: train
    rows (numbered over both files) whose bytes are replaced."""
    rng = np.random.default_rng(seed)
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])

    def table(labels, images):
        cells = [{"bytes": b, "path": None} for b in images]
        return pa.table({"label": pa.array(labels, pa.int64()), "image": pa.array(cells, struct)})

    labels = rng.integers(0, 3, size=rows)
    images = [bad.get(i) or png_bytes(class_image(int(y), SIZE, rng)) for i, y in enumerate(labels)]
    os.makedirs(os.path.join(root, "train"))
    half = rows // 2
    for number, part in enumerate((slice(0, half), slice(half, rows))):
        path = os.path.join(root, "train", f"part-{number}.parquet")
        pq.write_table(table(labels[part], images[part]), path, row_group_size=40)
    val_labels = rng.integers(0, 3, size=61)
    val_images = [png_bytes(class_image(int(y), SIZE, rng)) for y in val_labels]
    val_images[7] = b"not an image"
    pq.write_table(table(val_labels, val_images), os.path.join(root, "val.parquet"))


def write_folder(root: str, per_class: dict[str, int], seed: int) -> None:
    """``root/<split>/<class>/<i>.png``, the class's colour (sorted names: a, b, c)."""
    rng = np.random.default_rng(seed)
    for split, n in per_class.items():
        for label, name in enumerate(("a", "b", "c")):
            folder = os.path.join(root, split, name)
            os.makedirs(folder)
            for i in range(n):
                Image.fromarray(class_image(label, SIZE, rng)).save(f"{folder}/{i}.png")


def ray_cfg(data_dir: str, **fields) -> TrainConfig:
    base = dict(
        dataset="parquet", data_dir=data_dir, data_engine="ray", num_workers=2,
        cpus_per_worker=0.5, batch_size=16, image_size=SIZE,
    )  # fmt: skip
    return TrainConfig(**{**base, **fields})


# ---------------------------------------------------------------- without Ray
@pytest.mark.parametrize(
    "fields, words",
    [
        ({"checkpoint_every": 5}, "--checkpoint-every"),
        ({"min_workers": 1}, "fixed number of workers"),
        ({"train_samples": 100}, "--train-samples/--val-samples"),
        ({"dataset": "cifar10"}, "Parquet or ImageFolder"),
    ],
)
def test_what_the_ray_engine_cannot_do_is_refused_before_any_cluster_work(tmp_path, fields, words):
    with pytest.raises(ConfigError, match=words):
        validate(ray_cfg(str(tmp_path), **fields))
    validate(ray_cfg(str(tmp_path)))  # the same run without it is fine


def test_a_tests_sample_ledger_is_refused_before_any_cluster_work(tmp_path):
    from ray_ddp.driver.run import run_training
    from ray_ddp.testing.harness import Harness

    with pytest.raises(ConfigError, match="sample ledger needs sample indices"):
        run_training(ray_cfg(str(tmp_path)), harness=Harness(sample_ledger=True))


def test_workers_must_leave_cpus_for_ray_data():
    cfg = ray_cfg("/data", cpus_per_worker=1.0)
    with pytest.raises(ConfigError, match="use --cpus-per-worker 0.5 to leave one"):
        data_task_cpus(cfg.scaling, ClusterView(up=[{"CPU": 2.0}]))
    assert data_task_cpus(cfg.scaling, ClusterView(up=[{"CPU": 4.0}])) == 1.0
    assert data_task_cpus(ray_cfg("/data").scaling, ClusterView(up=[{"CPU": 2.0}])) == 1.0
    thin = ray_cfg("/data", cpus_per_worker=0.75).scaling
    assert data_task_cpus(thin, ClusterView([{"CPU": 2}])) == 0.5
    # An autoscaler that can add nodes: asked for them rather than refused.
    from ray_ddp.cluster.placement import Nodes

    view = ClusterView(up=[{"CPU": 2.0}], node_types=[Nodes({"CPU": 8.0})])
    assert data_task_cpus(cfg.scaling, view) == 1.0


def test_decoding_skips_and_names_unreadable_rows(tmp_path):
    """Parquet rows become the torch engine's tensors; undecodable ones are left out and
    named ``<file> row <n>`` with their row number in the split."""
    write_parquet_split(str(tmp_path), 90, {3: b"garbage", 50: b"\x89PNG\r\n\x1a\n..."}, seed=1)
    cfg = ray_cfg(str(tmp_path))
    items, layout = split_items(cfg.data, "train")
    reported = []
    decode = Decode(
        layout, cfg.data, cfg.target, "train", lambda *a: reported.append(a), image_decoder,
        has_random_transform(cfg.data),
    )  # fmt: skip
    pieces = np.array([item["piece"] for item in items])
    out = list(decode({"piece": pieces}))
    assert sum(len(o["label"]) for o in out) == 88
    assert out[0]["input"].shape[1:] == (3, SIZE, SIZE) and out[0]["input"].dtype == np.float32
    ((split, records),) = reported
    files = sorted(os.listdir(tmp_path / "train"))
    assert split == "train" and [(r.index, r.name) for r in records] == [
        (3, f"{tmp_path}/train/{files[0]} row 3"),
        (50, f"{tmp_path}/train/{files[1]} row 5"),  # the second file starts at row 45
    ]
    assert all(r.error.startswith("UnidentifiedImageError") for r in records)


class FakeShard:
    """A shard delivering ``rows`` rows in batches, as Ray Data's iterator does."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def iter_torch_batches(self, batch_size, **options):
        for start in range(0, self.rows, batch_size):
            n = min(batch_size, self.rows - start)
            yield {"input": torch.zeros(n, 3), "label": torch.arange(start, start + n)}


@pytest.mark.parametrize("rows, accum", [(150, 1), (145, 2), (97, 2)])
def test_slots_carry_the_sizes_the_stream_delivers(rows, accum):
    """Each step's micro-batches weigh by their share of the step's samples (all ranks
    hold the same sizes: an equal split), a last batch of one row joins the one before,
    and the batches come in the slots' order."""
    order = StreamOrder(
        FakeShard(rows), size=rows * 2, batch_size=16, global_batch=32 * accum, seed=0,
        rank=1, world_size=2, shuffle_buffer=64, pin_memory=False, take_bad=None,
    )  # fmt: skip
    order.set_position(3, 0)
    slots, batches = [], []
    for slot in order.slots:
        slots.append(slot)
        batches.append(order.ready.popleft())
    assert [len(b[1]) for b in batches] == [s.size for s in slots]
    assert torch.cat([b[1] for b in batches]).tolist() == list(range(rows))  # each row once
    assert min(s.size for s in slots) > 1
    steps = {}
    for slot in slots:
        steps.setdefault(slot.step, []).append(slot)
    assert len(steps) == order.steps == expected_steps(rows * 2, 2, 16, accum)
    for group in steps.values():
        weights = [s.size * 2 / s.step_samples for s in group]
        assert sum(weights) == pytest.approx(1.0)  # the mean over the step's samples
        assert [s.boundary for s in group] == [False] * (len(group) - 1) + [True]
        assert [s.micro for s in group] == [1 + 2 * t for t in range(len(group))]
    assert order.plan.epoch == 3 and order.plan.step_start(order.steps) == rows * 2
    with pytest.raises(ValueError, match="first sample"):
        order.set_position(3, 32)


# ---------------------------------------------------------------- Ray Data, no trainer
def _consume(order: StreamOrder, epochs: int, seen: list, errors: list) -> None:
    try:
        for epoch in range(epochs):
            order.set_position(epoch, 0)
            mine = []
            for slot in order.slots:
                inputs, labels = order.ready.popleft()
                assert len(labels) == slot.size
                mine += list(zip(inputs, labels.tolist(), strict=True))
            seen.append(mine)
    except Exception as exc:  # noqa: BLE001 - re-raised by the test
        errors.append(exc)


def _digest(image: torch.Tensor) -> str:
    return hashlib.sha1(image.numpy().tobytes()).hexdigest()


@pytest.mark.ray
def test_an_imagefolder_stream_gives_each_rank_an_equal_share_once(ray_session, tmp_path):
    """Two ranks read the ImageFolder split through the engine's own datasets and split
    (threads standing in for the workers): equal shares, every image at most once per
    epoch, labels from the sorted class folders, a broken file named and left out; the
    validation split exactly once over the ranks."""
    write_folder(str(tmp_path), {"train": 17, "val": 5}, seed=2)
    broken = tmp_path / "train" / "b" / "3.png"
    broken.write_bytes(broken.read_bytes()[:60])  # truncated
    cfg = ray_cfg(
        str(tmp_path), dataset="imagefolder", augment="none", name="folder",
        storage_path=str(tmp_path / "runs"),
    )  # fmt: skip
    augmented = has_random_transform(cfg.data)
    datasets = {
        split: SplitBuilder(
            cfg.data,
            cfg.target,
            split,
            1.0,
            image_decoder,
            augmented,
            seed=cfg.optim.seed,
            run_dir=cfg.checkpointing.run_dir,
        )()
        for split in ("train", "val")
    }
    actor = unreadable_actor(cfg.checkpointing.run_dir)
    take = lambda split: ray_session.get(actor.take.remote(split))  # noqa: E731
    train = Splits().configure({"train": datasets["train"]}, 2, None, None)
    orders = [
        StreamOrder(
            train[rank]["train"],
            size=51,
            batch_size=8,
            global_batch=16,
            seed=0,
            rank=rank,
            world_size=2,
            shuffle_buffer=32,
            pin_memory=False,
            take_bad=take if rank == 0 else None,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    seen: list[list] = [[], []]
    errors: list = []
    threads = [
        threading.Thread(target=_consume, args=(orders[r], 2, seen[r], errors)) for r in (0, 1)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for epoch in (0, 1):
        shares = [seen[rank][epoch] for rank in (0, 1)]
        assert [len(s) for s in shares] == [25, 25]  # (51 - 1 unreadable) // 2 each
        digests = [_digest(image) for share in shares for image, _ in share]
        assert len(set(digests)) == 50  # no image twice in the epoch
        for image, label in shares[0] + shares[1]:
            # class_image colours channel label % 3; normalised, it is the brightest one.
            assert int(image.mean(dim=(1, 2)).argmax()) == label
    records = orders[0].take_unreadable()
    assert [r.name for r in records] == [str(broken)] * 2  # once per pass, on rank 0
    assert orders[1].take_unreadable() == []

    val = Splits().configure({"val": datasets["val"]}, 2, None, None)
    shares = [[], []]

    def read(rank):
        for item in val[rank]["val"].iter_torch_batches(batch_size=4):
            shares[rank] += [_digest(image) for image in item["input"]]

    threads = [threading.Thread(target=read, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(shares[0]) + len(shares[1]) == 15  # exact: every file on one rank
    assert len(set(shares[0]) | set(shares[1])) == 15


# ---------------------------------------------------------------- real runs
@pytest.mark.ray
def test_parquet_trains_evaluates_exactly_and_resumes_by_restarting_the_epoch(
    ray_session, tmp_path, capsys
):
    """Two workers, Parquet through Ray Data: the run stopped by --max-steps inside epoch
    2 and re-run restarts that epoch (the whole epoch trained once, its steps counted
    once); every epoch trains (N - unreadable) // 2 rows per rank and evaluates every
    readable validation row once; unreadable rows are named per epoch; it learns."""
    from ray_ddp.data.unreadable import read_rows
    from ray_ddp.driver.run import fit

    data = str(tmp_path / "data")
    write_parquet_split(data, 301, {5: b"not an image", 200: b"\x89PNG\r\n\x1a\n.."}, seed=3)
    fields = dict(
        dataset="parquet", data_dir=data, data_engine="ray", num_workers=2, cpus_per_worker=0.5,
        batch_size=16, image_size=SIZE, epochs=2, storage_path=str(tmp_path / "runs"),
        name="rd", export=False, tensorboard=False, progress_interval_s=0,
    )  # fmt: skip
    steps = expected_steps(301, 2, 16, 1)  # 150 rows per rank: 10 batches of 16 (last 6)
    first = fit(TASK, max_steps=steps + 3, **fields)
    assert [m["step"] for m in first["history"]] == [steps, steps + 3]
    capsys.readouterr()
    second = fit(TASK, **fields)
    out = capsys.readouterr().out
    assert "epoch 2 restarts from its first sample" in out
    assert "data engine: Ray Data, 150 rows per worker per epoch" in out

    history = first["history"][:1] + second["history"]
    assert [m["epoch"] for m in history] == [1, 2]
    assert [m["step"] for m in history] == [steps, 2 * steps]  # epoch 2's steps once
    assert [m["train_samples"] for m in history] == [298, 298]  # (301 - 2) // 2 * 2
    assert [m["evaluated_samples"] for m in history] == [60, 60]  # 61 less the unreadable one
    assert [m["bad_samples"] for m in history] == [3, 3]
    assert second["final"]["val_acc"] >= 0.9  # 3 colours: chance is 1/3
    rows = read_rows(second["run_dir"])
    epoch_two = sorted((r["split"], r["sample"]) for r in rows if r["epoch"] == "2")
    files = sorted(os.listdir(os.path.join(data, "train")))
    train_rows = {f"{data}/train/{files[0]} row 5", f"{data}/train/{files[1]} row 50"}
    assert {s for split, s in epoch_two if split == "train"} == train_rows
    assert [s for split, s in epoch_two if split == "val"][-1] == f"{data}/val.parquet row 7"
    with open(os.path.join(second["run_dir"], "bad_samples.csv")) as f:
        assert next(csv.reader(f)) == ["epoch", "split", "rank", "sample", "error"]


def test_the_evaluation_loader_hands_over_unreadable_rows_as_records():
    """The evaluation loader hands rank 0's unreadable rows over in the records form
    ``bad_samples.take_skipped`` reads (a batch of none)."""
    from ray_ddp.data.ray_data.worker import EvalBatches
    from ray_ddp.data.unreadable import BadSample, take_skipped

    record = BadSample(7, "val.parquet row 7", "UnidentifiedImageError: x")
    loader = EvalBatches(FakeShard(5), 4, False, lambda split: [record])
    items = list(loader)
    assert [len(labels) for _, labels in items[:2]] == [4, 1]
    assert take_skipped(items[2]) == (None, [record])
    assert items[2] == {SKIPPED: [record], BATCH: None}
