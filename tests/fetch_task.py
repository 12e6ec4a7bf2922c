"""A task that fetches its data with --download and logs who fetched and who read, for
the download-turn test (it and its base's module are pickled by value to the workers:
tests/ is not on their path)."""

from __future__ import annotations

import os
import time

import torch
from broken_tasks import Good
from torch.utils.data import TensorDataset


def _log(cfg, what: str) -> None:
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    with open(os.path.join(cfg.data.data_dir, "fetch.log"), "a") as f:
        f.write(f"{rank} {what} {time.monotonic():.6f}\n")


class FetchOnce(Good):
    """broken_tasks.Good's regression, with data that exists once it is fetched."""

    def datasets(self, cfg, facts):
        data = os.path.join(cfg.data.data_dir, "data.pt")
        if cfg.data.download:
            _log(cfg, "fetch-start")
            time.sleep(0.5)  # a slow download: a reader that does not wait would see none
            x = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
            torch.save((x, x.sum(dim=1, keepdim=True)), data)
            _log(cfg, "fetch-end")
            return None, None
        _log(cfg, "read")
        x, y = torch.load(data)
        return TensorDataset(x, y), TensorDataset(x[:8], y[:8])

    def check(self, cfg, facts):
        return 64, 8  # the data exists only once the workers have fetched it
