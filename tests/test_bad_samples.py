"""Unreadable samples (a truncated PNG, garbage bytes in a Parquet row) are skipped,
counted per epoch and named in the run's bad_samples.csv, up to --max-bad-samples; one
more stops every rank with one line naming them, which is not retried. A bug in a task's
own code still fails loudly.

The first tests need no Ray (real PIL errors, real DataLoaders, the real epoch loop in one
process); the last ones train for real on 2 Ray workers (gloo)."""

from __future__ import annotations

import csv
import io
import os
import struct
import time
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from broken_tasks import Good
from formats import class_image, png_bytes, write_imagefolder
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, default_collate

from ray_ddp.config import TrainConfig
from ray_ddp.data.loaders import SeededSamples
from ray_ddp.data.order.global_order import GlobalOrderBatches
from ray_ddp.data.order.shards import ShardSampler
from ray_ddp.data.unreadable import (
    BATCH,
    SKIPPED,
    BadSample,
    BadSamplesError,
    SkipLog,
    SkipUnreadable,
    SkipUnreadableCollate,
    error_line,
    is_unreadable,
    message_of,
    read_rows,
    take_skipped,
)
from ray_ddp.driver.cli import train_main
from ray_ddp.driver.run import run_training
from ray_ddp.image_classification.datasets import build_datasets
from ray_ddp.reliability.attempts import last_attempt
from ray_ddp.reliability.loss_guard import LossGuard
from ray_ddp.worker.evaluate import evaluate
from ray_ddp.worker.hooks import Guard, Hooks, Ledger, Skips
from ray_ddp.worker.state import EpochSums, TrainState
from ray_ddp.worker.step import Limits, StepCore, train_segment
from ray_ddp.worker.unreadable import settle


def _png(size: int = 32, seed: int = 0) -> bytes:
    return png_bytes(class_image(1, size, np.random.default_rng(seed)))


def _jpeg(size: int = 32) -> bytes:
    out = io.BytesIO()
    Image.fromarray(class_image(2, size, np.random.default_rng(0))).save(out, format="JPEG")
    return out.getvalue()


def _bomb() -> bytes:
    """A valid little PNG whose header claims 40000 x 40000 pixels (CRC fixed)."""
    data = bytearray(_png(8))
    data[16:24] = struct.pack(">II", 40000, 40000)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _decode_error(data: bytes) -> Exception:
    with pytest.raises(Exception) as caught:  # noqa: PT011 - whatever PIL raises
        Image.open(io.BytesIO(data)).convert("RGB")
    return caught.value


# ------------------------------------------------------------------ what is unreadable
@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_png()[: len(_png()) // 2], "OSError: image file is truncated"),
        (_png()[:20], "OSError: Truncated File Read"),
        (_jpeg()[: len(_jpeg()) // 2], "OSError"),
        (bytes(range(200)), "UnidentifiedImageError: cannot identify image file"),
        (b"", "UnidentifiedImageError"),
        (_bomb(), "DecompressionBombError: Image size (1600000000 pixels) exceeds limit"),
    ],
    ids=["png-half", "png-header", "jpeg-half", "garbage", "empty", "bomb-header"],
)
def test_pil_decode_errors_are_unreadable_samples(data, message):
    error = _decode_error(data)
    assert is_unreadable(error)
    line = error_line(error)
    assert line.startswith(message) and "\n" not in line
    assert "_io.BytesIO" not in line  # PIL's name for its buffer says nothing


def test_only_pil_raising_a_value_or_syntax_error_makes_a_sample_unreadable():
    """The same types raised by a task's own code are bugs, and must fail the run."""
    pil: dict = {"__name__": "PIL.PngImagePlugin"}
    exec("def chunk():\n    raise SyntaxError('broken PNG file')", pil)  # noqa: S102
    for raise_it, unreadable in ((pil["chunk"], True), (_user_syntax_error, False)):
        with pytest.raises(SyntaxError) as caught:
            raise_it()
        assert is_unreadable(caught.value) is unreadable
    for bug in (ValueError("bad shape"), KeyError("label"), TypeError("x"), RuntimeError("y")):
        try:
            raise bug
        except Exception as exc:  # noqa: BLE001
            assert not is_unreadable(exc)
    assert is_unreadable(FileNotFoundError(2, "No such file", "/data/x.png"))
    assert is_unreadable(OSError("a task marks its own sample unreadable this way"))


def _user_syntax_error():
    raise SyntaxError("in the task's code")


# ------------------------------------------------------------------ the loader's side
def _tree(tmp_path) -> tuple[str, str, str]:
    """An ImageFolder tree with one training file cut in half and one val file of garbage;
    returns (root, the truncated file, the garbage file)."""
    root = str(tmp_path / "data")
    write_imagefolder(root, train=6, val=3, size=32)
    cut = os.path.join(root, "train", "dog", "2.png")
    with open(cut, "r+b") as f:
        f.truncate(os.path.getsize(cut) // 2)
    garbage = os.path.join(root, "val", "owl", "1.png")
    with open(garbage, "wb") as f:
        f.write(os.urandom(300))
    return root, cut, garbage


def test_a_truncated_file_is_named_through_subset_and_seeded_wrappers(tmp_path):
    root, cut, garbage = _tree(tmp_path)
    cfg = TrainConfig(dataset="imagefolder", data_dir=root, train_samples=17)
    train, val, _ = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
    assert isinstance(train, Subset)
    position = train.indices.index(train.dataset.samples.index((cut, 1)))
    wrapped = SkipUnreadable(SeededSamples(train, seed=3))
    record = wrapped[(4, position)]
    assert record == BadSample(position, cut, "OSError: image file is truncated")
    good = wrapped[(4, (position + 1) % 17)]
    assert good[0].shape == (3, 32, 32)
    garbage_index = val.samples.index((garbage, 2))
    record = SkipUnreadable(val)[garbage_index]
    assert record.name == garbage and record.error.startswith("UnidentifiedImageError")


class Buggy(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        return {"x": 1}["label"]  # a bug of the task: KeyError


def test_a_bug_in_the_tasks_dataset_still_raises():
    with pytest.raises(KeyError):
        SkipUnreadable(Buggy())[0]


def test_a_loader_leaves_unreadable_samples_out_of_their_batch_and_names_them(tmp_path):
    """DataLoader worker processes fetch (the error is classified there); a batch
    without bad samples is the task's batch itself."""
    root, cut, _ = _tree(tmp_path)
    cfg = TrainConfig(dataset="imagefolder", data_dir=root, augment="none")
    train, _, _ = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
    loader = DataLoader(
        SkipUnreadable(train),
        batch_size=4,
        num_workers=2,
        collate_fn=SkipUnreadableCollate(default_collate),
    )
    seen, bad = 0, []
    for item in loader:
        batch, skipped = take_skipped(item)
        if not skipped:
            assert isinstance(item, list)  # default_collate's own batch, untouched
        seen += len(batch[0])
        bad += skipped
    assert seen == 17 and [b.name for b in bad] == [cut]
    collate = SkipUnreadableCollate(default_collate)
    empty = collate([BadSample(0, "a", "OSError: x"), BadSample(1, "b", "OSError: y")])
    assert empty[BATCH] is None and take_skipped(empty)[0] is None
    assert len(empty[SKIPPED]) == 2


def test_parquet_rows_are_named_by_file_and_row(tmp_path):
    from ray_ddp.image_classification.parquet import load

    root = str(tmp_path / "data")
    corrupt = _write_parquet(root, bad_train=(9,), bad_val=())
    cfg = TrainConfig(dataset="parquet", data_dir=root, parquet_read="memory")
    train, _ = load(cfg.data, cfg.target)
    record = SkipUnreadable(train)[9]
    assert (record.name, record.error) == (
        corrupt[0],
        "UnidentifiedImageError: cannot identify image file",
    )
    assert train.sample_name(3) == f"{root}/train/part-0.parquet row 3"
    assert SkipUnreadable(train)[3][0].shape == (3, 32, 32)


def _write_parquet(root: str, bad_train=(9,), bad_val=(1,), rows: int = 8) -> list[str]:
    """train/ and val/ folders of two files of ``rows`` PNG rows each; rows of the split
    numbered in ``bad_*`` hold garbage. Returns the bad rows' names (file, row)."""
    rng = np.random.default_rng(0)
    names = []
    for split, bad in (("train", bad_train), ("val", bad_val)):
        os.makedirs(os.path.join(root, split))
        for part in range(2):
            labels = [int(x) for x in rng.integers(0, 3, size=rows)]
            images = [png_bytes(class_image(y, 16, rng)) for y in labels]
            path = os.path.join(root, split, f"part-{part}.parquet")
            for row in range(rows):
                if part * rows + row in bad:
                    images[row] = bytes(rng.integers(0, 256, size=64, dtype=np.uint8))
                    names.append(f"{path} row {row}")
            table = pa.table({"image": pa.array(images, pa.binary()), "label": labels})
            pq.write_table(table, path, row_group_size=3)
    return names


# ------------------------------------------------------------------ the epoch's count
def _record(i: int) -> BadSample:
    return BadSample(i, f"/data/train/cat/{i}.png", "OSError: image file is truncated")


def test_settle_appends_every_epoch_and_stops_over_the_cap(tmp_path):
    run = str(tmp_path / "run")
    first = SkipLog(cap=3, rank=0, epoch=0)
    first.add([_record(1)])
    skips = settle(run, first, is_main=True, val=[(1, _record(7))])
    assert (skips.train, skips.val, skips.total) == (1, 1, 2)
    second = SkipLog(cap=3, rank=0, epoch=1)
    second.add([_record(1), _record(2)])
    settle(run, second, is_main=True)  # a mid-epoch checkpoint: these are written now
    second.add([_record(3)])
    with pytest.raises(BadSamplesError) as stop:
        settle(run, second, is_main=True, val=[(1, _record(7))])
    line = str(stop.value)
    assert "\n" not in line
    assert line.startswith("4 unreadable samples in epoch 2, over --max-bad-samples 3: ")
    assert "/data/train/cat/1.png (OSError: image file is truncated; rank 0)" in line
    assert "and 1 more" in line and f"{run}/bad_samples.csv" in line
    rows = read_rows(run)
    assert [(r["epoch"], r["split"], r["rank"], r["sample"]) for r in rows] == [
        ("1", "train", "0", "/data/train/cat/1.png"),
        ("1", "val", "1", "/data/train/cat/7.png"),
        ("2", "train", "0", "/data/train/cat/1.png"),
        ("2", "train", "0", "/data/train/cat/2.png"),
        ("2", "train", "0", "/data/train/cat/3.png"),  # written before the stop
        ("2", "val", "1", "/data/train/cat/7.png"),
    ]
    assert message_of(stop.value) == line
    relayed = RuntimeError(f"Traceback ...\nray_ddp.bad_samples.BadSamplesError: {line}\n")
    assert message_of(relayed) == line and message_of(RuntimeError("other")) is None


def test_rewinding_bad_samples_csv_keeps_its_first_rows_whole(tmp_path):
    from ray_ddp.data.unreadable import append_rows, rewind_rows

    run = str(tmp_path / "run")
    assert rewind_rows(run, 0) == (0, 0)  # no file yet
    odd = BadSample(3, "/data/a, b\nc.png", "OSError: truncated")  # a comma, a line break
    append_rows(run, 1, [("train", 0, odd), ("train", 1, _record(4)), ("val", 0, _record(5))])
    assert rewind_rows(run, None) == (3, 0) and rewind_rows(run, 5) == (3, 0)
    assert rewind_rows(run, 1) == (1, 2)
    assert [(r["sample"], r["error"]) for r in read_rows(run)] == [(odd.name, odd.error)]
    assert rewind_rows(run, 0) == (0, 1) and read_rows(run) == []


def test_the_epoch_line_says_how_many_were_skipped():
    from ray_ddp.io.reporting import epoch_line

    metrics = {"epoch": 2, "train_loss": 0.5, "val_acc": 0.9, "lr": 0.1, "samples_per_s": 9.0,
               "epoch_s": 1.0}  # fmt: skip
    assert "skipped" not in epoch_line({**metrics, "bad_samples": 0}, 3)
    assert epoch_line({**metrics, "bad_samples": 2}, 3).endswith(
        "  skipped 2 unreadable samples (bad_samples.csv)"
    )


def test_a_rank_alone_over_the_cap_stops_at_once():
    log = SkipLog(cap=0, rank=1, epoch=2)
    with pytest.raises(BadSamplesError, match=r"^rank 1 met 1 unreadable sample in epoch 3, "
                       r"over --max-bad-samples 0: /data/train/cat/5.png \(OSError"):  # fmt: skip
        log.add([_record(5)])
    SkipLog().add([_record(i) for i in range(500)])  # no cap: a loop outside a run


# ------------------------------------------------------------------ the epoch loop
class Points(Dataset):
    """x_i -> sum(x_i); the indices in ``unreadable`` raise what PIL raises."""

    def __init__(self, unreadable: set[int]) -> None:
        self.x = torch.randn(16, 3, generator=torch.Generator().manual_seed(1))
        self.unreadable = unreadable

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int):
        if index in self.unreadable:
            raise OSError("image file is truncated")
        return self.x[index], self.x[index].sum(dim=0, keepdim=True)


def _one_epoch(unreadable: set[int], micro: int, per_step: int = 8):
    """One epoch of ``Good``'s regression in this process (one rank, no DDP), SGD with a
    constant learning rate; returns the segment, the weights, the order and the data."""
    segments, model, slots, data, log = _epochs(unreadable, micro, per_step, epochs=1)
    return segments[0], model, slots[0], data, log


def _epochs(unreadable: set[int], micro: int, per_step: int = 8, epochs: int = 1,
            stand_in=None):  # fmt: skip
    """``epochs`` epochs on one ``StepCore`` (one attempt), each a call of
    ``train_segment`` as ``worker.loop.train_epoch`` makes it; ``stand_in``: the core's first
    stand-in (the attempt's example batch)."""
    cfg = TrainConfig(
        batch_size=micro, accum_steps=per_step // micro, num_workers=1, seed=4, grad_clip=0
    )
    data = Points(unreadable)
    order = GlobalOrderBatches(
        16,
        batch_size=micro,
        global_batch=cfg.global_batch_size,
        seed=4,
        rank=0,
        world_size=1,
        tag_epoch=False,
    )
    loader = DataLoader(
        SkipUnreadable(data), batch_sampler=order, collate_fn=SkipUnreadableCollate(default_collate)
    )
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    state = TrainState(model, optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False))
    optim = cfg.optim
    core = StepCore(state, Good(), optim.amp, torch.device("cpu"), optim.seed, optim.grad_clip,
                    stand_in=stand_in)  # fmt: skip
    skips = Skips(SkipLog())
    observer = Hooks(Guard(LossGuard(torch.device("cpu"), 0, 1)), skips, Ledger())
    segments, slots = [], []
    for epoch in range(epochs):
        order.set_position(epoch, 0)
        slots.append(list(order.slots))  # computed when read: kept as read
        segments.append(
            train_segment(core, order, loader, EpochSums(ledger=[]), observer, Limits())
        )
    return segments, model, slots, data, skips.log


def _expected_weights(slots, data: Points, stand_in: bool) -> torch.Tensor:
    """The rule by hand: each micro-batch weighs its share of the step's samples and
    its loss is the mean over its readable samples; one with none weighs 0."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for slot in slots:
        good = [i for i in slot.indices if i not in data.unreadable]
        if good:
            x, y = default_collate([data[i] for i in good])
            weight = slot.size / slot.step_samples
            (F.mse_loss(model(x), y) * weight).backward()
        else:
            assert stand_in
        if slot.boundary:
            optimizer.step()
            optimizer.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_a_shortened_micro_batch_keeps_its_weight_and_counts_its_readable_samples():
    probe = GlobalOrderBatches(
        16, batch_size=4, global_batch=8, seed=4, rank=0, world_size=1, tag_epoch=False
    )
    probe.set_position(0, 0)
    unreadable = {probe.slots[1].indices[0], probe.slots[2].indices[3]}
    segment, model, slots, data, skips = _one_epoch(unreadable, micro=4)
    assert segment.sums.samples == 14 and segment.samples == 14
    assert sorted(i for _, i in segment.sums.ledger) == sorted(set(range(16)) - unreadable)
    assert sorted(b.index for b in skips.rows) == sorted(unreadable)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.allclose(weights, _expected_weights(slots, data, stand_in=False), atol=1e-6)


def test_a_micro_batch_with_nothing_readable_trains_its_previous_one_with_weight_0():
    probe = GlobalOrderBatches(
        16, batch_size=2, global_batch=8, seed=4, rank=0, world_size=1, tag_epoch=False
    )
    probe.set_position(0, 0)
    unreadable = set(probe.slots[1].indices)  # the second micro-batch: both samples
    segment, model, slots, data, _ = _one_epoch(unreadable, micro=2)
    assert segment.sums.samples == 14
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.allclose(weights, _expected_weights(slots, data, stand_in=True), atol=1e-6)
    with pytest.raises(BadSamplesError, match="every sample of rank 0's first micro-batch"):
        _one_epoch(set(probe.slots[0].indices), micro=2)  # and no example to stand in


def test_a_later_epochs_first_micro_batch_with_nothing_readable_trains_a_stand_in():
    """The stand-in outlives a call of train_segment (a new epoch, a mid-epoch checkpoint):
    a rank whose epoch starts with a micro-batch of nothing readable trains its latest
    readable one with weight 0, under the cap, instead of stopping the run (issue 27).
    The attempt's very first micro-batch has the example batch to stand in."""
    second = GlobalOrderBatches(
        16, batch_size=2, global_batch=8, seed=4, rank=0, world_size=1, tag_epoch=False
    )
    second.set_position(1, 0)
    unreadable = set(second.slots[0].indices)  # epoch 2's first micro-batch, both samples
    segments, model, slots, data, log = _epochs(unreadable, micro=2, epochs=2)
    assert [s.sums.samples for s in segments] == [14, 14]
    assert sorted(b.index for b in log.rows) == sorted([*unreadable, *unreadable])
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    expected = _expected_weights(slots[0] + slots[1], data, stand_in=True)
    assert torch.allclose(weights, expected, atol=1e-6)

    first = set(slots[0][0].indices)  # the attempt's first micro-batch: the example stands in
    example = default_collate([data[i] for i in sorted(set(range(16)) - first)[:2]])
    segments, model, slots, data, _ = _epochs(first, micro=2, stand_in=example)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert segments[0].sums.samples == 14
    assert torch.allclose(weights, _expected_weights(slots[0], data, stand_in=True), atol=1e-6)


class Regression(Good):
    def predictions(self, model, batch):
        x, y = batch
        return {"target": y[:, 0]}


def test_evaluation_leaves_unreadable_samples_out_and_keeps_prediction_indices_right():
    data = Points({2, 5, 6})
    loader = DataLoader(
        SkipUnreadable(data),
        batch_size=3,
        sampler=ShardSampler(16, rank=0, world_size=1),
        collate_fn=SkipUnreadableCollate(default_collate),
    )
    result = evaluate(nn.Linear(3, 1), loader, torch.device("cpu"), Regression(), predictions=True)
    assert result.samples == 13 and result.sums["loss"][1] == 13
    assert sorted(b.index for _, b in result.skipped) == [2, 5, 6]
    assert [row[0] for row in result.predictions] == [i for i in range(16) if i not in {2, 5, 6}]
    for index, target in result.predictions:
        assert target == pytest.approx(float(data.x[index].sum()))


class FirstUnreadable(Good):
    """Good's regression whose first training samples cannot be read."""

    unreadable = {0}

    def datasets(self, cfg, facts):
        train, val = super().datasets(cfg, facts)
        return _Failing(train, self.unreadable), val


class _Failing(Dataset):
    def __init__(self, dataset, unreadable) -> None:
        self.dataset, self.unreadable = dataset, unreadable

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        if index in self.unreadable:
            raise OSError(f"cannot read sample {index}")
        return self.dataset[index]


def test_the_drivers_check_of_a_task_passes_over_unreadable_samples():
    from ray_ddp.config import ConfigError
    from ray_ddp.task.checks import dry_run

    cfg = TrainConfig(num_workers=1)
    assert dry_run(FirstUnreadable(), cfg, {}) == (16, 4)
    hopeless = FirstUnreadable()
    hopeless.unreadable = set(range(16))
    with pytest.raises(ConfigError, match=r"the first 16 train samples cannot be read, e\.g\. "
                       r"_Failing\[0\] \(OSError: cannot read sample 0\)"):  # fmt: skip
        dry_run(hopeless, cfg, {})


# ------------------------------------------------------------------ real runs on Ray
def _run_config(storage: str, name: str, **fields) -> TrainConfig:
    common = dict(
        num_workers=2, image_size=16, batch_size=4, epochs=1, lr=1e-2, storage_path=storage,
        name=name, export=False, tensorboard=False,
    )  # fmt: skip
    return TrainConfig(**{**common, **fields})


@pytest.mark.ray
def test_an_imagefolder_run_skips_its_unreadable_files_and_names_them(
    ray_session, storage, tmp_path
):
    root, cut, garbage = _tree(tmp_path)
    cfg = _run_config(
        storage, "skips", dataset="imagefolder", data_dir=root, epochs=2, loader_workers=1
    )
    summary = run_training(cfg)
    assert summary["epochs_completed"] == 2
    for metrics in summary["history"]:
        assert metrics["bad_samples"] == 2
        assert metrics["train_samples"] == 17 and metrics["evaluated_samples"] == 8
    rows = read_rows(summary["run_dir"])
    assert [(r["epoch"], r["split"], r["sample"]) for r in rows] == [
        ("1", "train", cut), ("1", "val", garbage), ("2", "train", cut), ("2", "val", garbage),
    ]  # fmt: skip
    assert rows[0]["error"] == "OSError: image file is truncated"
    assert rows[1]["error"].startswith("UnidentifiedImageError: cannot identify image file")
    with open(os.path.join(summary["run_dir"], "metrics.csv")) as f:
        assert [r["bad_samples"] for r in csv.DictReader(f)] == ["2", "2"]


@pytest.mark.ray
def test_over_the_cap_the_run_stops_with_one_line_and_no_retry(
    ray_session, storage, tmp_path, capsys
):
    root, cut, _ = _tree(tmp_path)
    argv = [
        "--dataset", "imagefolder", "--data-dir", root, "--image-size", "16",
        "--batch-size", "4", "--epochs", "1", "--num-workers", "2", "--loader-workers", "0",
        "--max-bad-samples", "0", "--max-failures", "2", "--storage-path", storage,
        "--name", "strict", "--no-export", "--no-tensorboard",
    ]  # fmt: skip
    started = time.monotonic()
    assert train_main(argv) == 1
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    failed = [line for line in err.splitlines() if "training failed" in line]
    assert len(failed) == 1, err
    assert failed[0].startswith("training failed: rank ")
    assert f"unreadable sample in epoch 1, over --max-bad-samples 0: {cut} (OSError: " in failed[0]
    assert last_attempt(os.path.join(storage, "strict"))["attempt"] == "1"  # not retried
    assert elapsed < 60, f"no retry of a sample that cannot be read ({elapsed:.0f} s)"


@pytest.mark.ray
def test_garbage_bytes_in_a_parquet_row_are_skipped_and_named(ray_session, storage, tmp_path):
    """Streamed (the default --parquet-read): rows reach the dataset as FetchedRow keys. The
    in-memory reader's rows take the same path as an ImageFolder's files (index keys), and
    its names are checked above without Ray."""
    root = str(tmp_path / "data")
    train_bad, val_bad = _write_parquet(root, bad_train=(9,), bad_val=(1,))
    cfg = _run_config(storage, "rows", dataset="parquet", data_dir=root, parquet_read="stream")
    summary = run_training(cfg)
    (metrics,) = summary["history"]
    assert metrics["bad_samples"] == 2 and metrics["train_samples"] == 15
    assert metrics["evaluated_samples"] == 15
    rows = read_rows(summary["run_dir"])
    assert [(r["split"], r["sample"]) for r in rows] == [("train", train_bad), ("val", val_bad)]
    assert train_bad.endswith("train/part-1.parquet row 1")
    assert all(r["error"] == "UnidentifiedImageError: cannot identify image file" for r in rows)


@pytest.mark.ray
def test_an_epoch_split_by_a_resume_keeps_its_count_its_cap_and_its_csv_rows(
    ray_session, storage, tmp_path, capsys
):
    """Stopped by --max-steps after 2 of the epoch's 4 unreadable samples and re-run: the
    resumed epoch goes on counting from 2 (the cap of 3 is passed at the 4th, where a count
    restarted at 0 would end the epoch at 2 under the cap), and bad_samples.csv is put back
    to the rows the checkpoint saw written: a row left by a checkpoint that never registered
    is not named twice (issue 27)."""
    from ray_ddp.data.order.global_order import EpochPlan

    order = EpochPlan(16, 4, 8, 0, 0).order()  # 16 rows, 2 workers x 4: 2 steps an epoch
    bad = (*order[1:3], *order[9:11])  # 2 in step 1, 2 in step 2
    root = str(tmp_path / "data")
    names = dict(zip(sorted(bad), _write_parquet(root, bad_train=bad, bad_val=()), strict=True))
    argv = [
        "--dataset", "parquet", "--parquet-read", "memory", "--data-dir", root,
        "--image-size", "16", "--batch-size", "4", "--epochs", "1", "--num-workers", "2",
        "--max-bad-samples", "3", "--storage-path", storage, "--name", "split",
        "--no-export", "--no-tensorboard",
    ]  # fmt: skip
    assert train_main([*argv, "--max-steps", "1"]) == 0
    run_dir = os.path.join(storage, "split")
    first = [r["sample"] for r in read_rows(run_dir)]
    assert sorted(first) == sorted(names[i] for i in bad[:2])
    with open(os.path.join(run_dir, "bad_samples.csv"), "a") as f:  # as a crash would leave it
        f.write(f"1,train,0,{names[bad[2]]},OSError: written for a lost checkpoint\n")
    capsys.readouterr()
    assert train_main(argv) == 1
    failed = [ln for ln in capsys.readouterr().err.splitlines() if "training failed" in ln]
    # Both of step 2's are rank 0's (micro-batch 0 of the step): it stops at once, over the
    # cap with the 2 gathered before the stop.
    stop = "rank 0 met 2 unreadable samples in epoch 1 after 2 gathered from all ranks, over "
    assert len(failed) == 1 and f"{stop}--max-bad-samples 3" in failed[0], failed
    assert [r["sample"] for r in read_rows(run_dir)] == first  # the lost checkpoint's row gone
