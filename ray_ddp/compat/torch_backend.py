"""Ray Train's torch backend (``TorchConfig``) without torch in the Train controller.

The controller sets up every worker's process group, and for that it unpickles the run's
``TorchConfig`` and its backend: ``ray/train/torch/config.py`` imports torch at its top, so
a process that only sends a few remote calls spends about 2 CPU-seconds importing torch
before the workers are even asked for (``python benchmarks/startup.py``: the controller's
stage ran on one core while the other waited). ``LeanTorchConfig`` is the same settings in
a module that imports no torch; ``LeanTorchBackend.on_start`` makes the same calls as Ray
2.60's ``_TorchBackend.on_start`` for CPU and GPU workers (the address of rank 0, the
``MASTER_*`` and torchrun-style variables, ``init_process_group`` on every rank), and each
worker-side step runs Ray's own function, imported on the worker, which has torch anyway.
Other backends (TPUs' ``tpu_dist``), which ray_ddp does not run on, keep Ray's
``TorchConfig``.

``apis.REPEATED`` and ``apis.STOCK_SOURCE`` pin the source of the two methods repeated
here, so a Ray release that changes them is read again before it is verified.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import ray
from ray._common.network_utils import build_address
from ray._common.utils import env_integer
from ray.train._internal.utils import get_address_and_port
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import (
    DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
    TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
)
from ray.train.v2._internal.util import TrainingFramework

logger = logging.getLogger(__name__)


@dataclass
class LeanTorchConfig(BackendConfig):
    """``ray.train.torch.TorchConfig``'s settings (``backend=None``: NCCL where the workers
    have GPUs, gloo otherwise), unpickled without torch."""

    backend: str | None = None
    init_method: str = "env"
    timeout_s: int = 1800

    @classmethod
    def of(cls, config: BackendConfig) -> BackendConfig:
        """``config`` as a LeanTorchConfig where it is Ray's plain ``TorchConfig`` for CPU
        or GPU workers; anything else (a subclass, a TPU backend) as it is."""
        from ray.train.torch import TorchConfig

        if type(config) is not TorchConfig or config.backend not in (None, "gloo", "nccl"):
            return config
        return cls(config.backend, config.init_method, config.timeout_s)

    @property
    def backend_cls(self) -> type[Backend]:
        return LeanTorchBackend

    @property
    def train_func_context(self) -> Any:
        # Read where the train function is built (the driver, which has torch); the workers
        # enter it as they would TorchConfig's.
        from ray.train.torch.config import TorchConfigContextManager

        return TorchConfigContextManager

    @property
    def framework(self) -> TrainingFramework:
        return TrainingFramework.TORCH

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _torch_config() -> Any:
    """Ray's torch backend module, imported where its functions run: on a worker."""
    import ray.train.torch.config as torch_config

    return torch_config


def _set_master(addr: str, port: int) -> None:
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)


def _set_distributed_env_vars() -> None:
    _torch_config()._set_torch_distributed_env_vars()


def _setup_process_group(**kwargs: Any) -> None:
    torch_config = _torch_config()
    if not torch_config.dist.is_available():
        raise RuntimeError("Distributed torch is not available.")
    torch_config._setup_torch_process_group(**kwargs)


def _shutdown(destroy_process_group: bool) -> None:
    _torch_config()._shutdown_torch(destroy_process_group=destroy_process_group)


class LeanTorchBackend(Backend):
    """``_TorchBackend`` of Ray 2.60 for CPU and GPU workers, run from a controller
    without torch: the same remote calls, in the same order."""

    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group: Any, backend_config: BackendConfig) -> None:
        assert isinstance(backend_config, LeanTorchConfig), type(backend_config)
        backend = backend_config.backend
        if backend is None:
            gpus = worker_group.get_resources_per_worker().get("GPU", 0)
            backend = "nccl" if gpus > 0 else "gloo"
        master_addr, master_port = worker_group.execute_single(0, get_address_and_port)
        if backend_config.init_method == "env":
            worker_group.execute(_set_master, addr=master_addr, port=master_port)
            url = "env://"
        elif backend_config.init_method == "tcp":
            url = f"tcp://{build_address(master_addr, master_port)}"
        else:
            raise ValueError(
                f"The provided init_method ({backend_config.init_method}) is not supported. "
                "Must be either 'env' or 'tcp'."
            )
        worker_group.execute(_set_distributed_env_vars)
        ray.get(
            [
                worker_group.execute_single_async(
                    rank,
                    _setup_process_group,
                    backend=backend,
                    world_rank=rank,
                    world_size=len(worker_group),
                    init_method=url,
                    timeout_s=backend_config.timeout_s,
                )
                for rank in range(len(worker_group))
            ]
        )

    def on_shutdown(self, worker_group: Any, backend_config: BackendConfig) -> None:
        futures = worker_group.execute_async(_shutdown, destroy_process_group=len(worker_group) > 1)
        timeout_s = env_integer(
            TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
        )
        try:
            ray.get(futures, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            logger.warning(f"Torch process group shutdown timed out after {timeout_s} seconds")
