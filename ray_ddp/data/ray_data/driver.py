"""``--data-engine ray`` on the driver: the TorchTrainer's datasets (a builder per split,
called by Ray Train's controller when a worker group starts: nothing is listed or read on
the driver) and their split over the workers."""

from __future__ import annotations

import math
from typing import Any

import ray
from ray.train import DataConfig

from ray_ddp.config import ConfigError
from ray_ddp.config.batch import global_batch, micro_batches
from ray_ddp.config.sections import Data, Optimisation, Scaling, Target
from ray_ddp.data.ray_data.decode import (
    FILES_PER_TASK,
    Decode,
    MakeDecoder,
    Reporter,
    split_items,
    unreadable_actor,
    warm_up,
)

MAX_BLOCKS = 1000
"""Items (row groups, files) are spread over at most this many blocks: the unit Ray Data
shuffles per epoch and hands to its tasks."""


class SplitBuilder:
    """What the trainer gets for a split: called by Ray Train's controller when a worker
    group starts (nothing is listed or read on the driver), it returns the split's
    Dataset. ``seed``: ``--seed`` (the training split's order of row groups or files);
    ``run_dir``: the run's, whose actor collects the unreadable rows."""

    def __init__(
        self, data: Data, target: Target, split: str, task_cpus: float,
        make_decoder: MakeDecoder, augmented: bool, *, seed: int, run_dir: str,
    ) -> None:  # fmt: skip
        self.data, self.target, self.split, self.task_cpus = data, target, split, task_cpus
        self.make_decoder, self.augmented = make_decoder, augmented
        self.seed, self.run_dir = seed, run_dir

    def __call__(self):
        from ray.data import RandomSeedConfig

        data, train = self.data, self.split == "train"
        items, source = split_items(data, self.split)
        report = Reporter(unreadable_actor(self.run_dir, create=True))
        decode = Decode(
            source, data, self.target, self.split, report, self.make_decoder, self.augmented
        )
        if train:  # a decode task's process imports torch and torchvision while Train starts
            module = self.make_decoder.__module__
            ray.remote(warm_up).options(num_cpus=self.task_cpus).remote(module)
        per_call = 1 if data.dataset == "parquet" else FILES_PER_TASK
        blocks = max(1, min(MAX_BLOCKS, math.ceil(len(items) / per_call)))
        ds = ray.data.from_items(items, override_num_blocks=blocks)
        if train:  # a new order of row groups / files every epoch, from --seed
            ds = ds.randomize_block_order(
                seed=RandomSeedConfig(self.seed, reseed_after_execution=True)
            )
        ds = ds.map_batches(decode, batch_size=per_call, num_cpus=self.task_cpus)
        ds.context.print_on_execution_start = False  # one line per epoch per split
        ds.context.enable_progress_bars = False
        return ds


class Splits(DataConfig):
    """Ray Train's split of each dataset over the workers: ``train`` in equal shares
    (every rank the same rows, so the same steps; the remainder is left out), ``val``
    exactly (every row on one rank; the shares may differ by a block)."""

    @staticmethod
    def default_ingest_options():
        """Ray Train's defaults, less ``exclude_resources`` (deprecated in Ray 2.60: its
        own default passes it, and every run would print the deprecation warning)."""
        from ray.data import ExecutionOptions
        from ray.data.context import DataContext

        options = DataContext.get_current().execution_options
        return ExecutionOptions(
            resource_limits=options.resource_limits,
            preserve_order=options.preserve_order,
            verbose_progress=options.verbose_progress,
        )

    def configure(
        self,
        datasets: dict[str, Any],
        world_size: int,
        worker_handles: Any,
        worker_node_ids: Any,
        **kwargs: Any,
    ) -> list[dict[str, Any]]:
        output: list[dict[str, Any]] = [{} for _ in range(world_size)]
        for name, ds in datasets.items():
            if name != "val":
                parts = super().configure(
                    {name: ds}, world_size, worker_handles, worker_node_ids, **kwargs
                )
            else:
                if ds.name is None:
                    ds.set_name(name)
                ds = ds.copy(ds)
                ds.context.execution_options = self.default_ingest_options()
                splits = ds.streaming_split(world_size, equal=False, locality_hints=worker_node_ids)
                parts = [{name: split} for split in splits]
            for mine, part in zip(output, parts, strict=True):
                mine.update(part)
        return output


def trainer_datasets(
    data: Data, target: Target, optim: Optimisation, scaling: Scaling, run_dir: str,
    task_cpus: float, make_decoder: MakeDecoder, augmented: bool,
) -> dict[str, Any]:  # fmt: skip
    """The TorchTrainer's ``datasets`` and ``dataset_config`` for ``--data-engine ray``
    (workers resolved in ``scaling``, Ray connected; ``run_dir``: the run's, whose actor
    collects the unreadable rows; ``task_cpus``: what each decode task asks for,
    ``ray_ddp.cluster.resources.data_task_cpus``; the task's decoder and whether it draws
    random numbers). Refuses what cannot run."""
    workers = scaling.num_workers or 1
    batch = global_batch(optim.batch_size, scaling.worker_range[1], optim.accum_steps)
    per_step = micro_batches(batch, optim.batch_size)
    if per_step % workers:
        raise ConfigError(
            f"--data-engine ray needs every worker to train the same micro-batches per step: "
            f"a global batch of {batch} makes {per_step} of "
            f"{optim.batch_size}, "
            f"which {workers} workers do not share equally"
        )
    return {
        "datasets": {
            split: SplitBuilder(
                data,
                target,
                split,
                task_cpus,
                make_decoder,
                augmented,
                seed=optim.seed,
                run_dir=run_dir,
            )
            for split in ("train", "val")
        },
        "dataset_config": Splits(),
    }
