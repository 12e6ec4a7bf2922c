"""``--strategy fsdp2``: the model sharded over the workers with PyTorch's FSDP2
(``torch.distributed.fsdp.fully_shard``), and its sharded checkpoints (no Ray here).

Each worker keeps 1/N of every parameter, gradient and optimizer state (per-parameter
DTensor shards on a 1-d device mesh of all workers); a block's parameters are all-gathered
just before its forward and backward and freed after, and its gradients reduce-scattered
(averaged over the workers, as DDP's all-reduce does). The units gathered together are
the task's blocks (``Task.fsdp_blocks``, default :func:`default_blocks`), each sharded on
its own, then the root with what is left.

Checkpoints go through ``torch.distributed.checkpoint`` (DCP): every rank writes its own
shard file into ``<checkpoint>/shards/`` (rank 0 also the index, ``.metadata``), and a
load reads whatever slices the loading ranks' shards need, so a checkpoint written by N
workers resumes on M.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from ray_ddp.checkpoint.format import SHARDS

if TYPE_CHECKING:
    from ray_ddp.task import Task


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The block-like submodules: every item holding parameters of the outermost
    ``ModuleList``/``Sequential`` containers (a transformer's layers, a CNN's stages); a
    model without such a container gives its direct children that hold parameters."""
    blocks: list[nn.Module] = []
    done: list[str] = []  # names of containers whose items are taken: their insides are too
    for name, module in model.named_modules():
        if any(name.startswith(f"{prefix}.") for prefix in done):
            continue
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            blocks += [child for child in module.children() if _holds_parameters(child)]
            done.append(name)
            if not name:  # the root is the container: everything is below it
                break
    if not blocks:
        blocks = [child for child in model.children() if _holds_parameters(child)]
    return blocks


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def task_blocks(task: Task, model: nn.Module) -> list[nn.Module]:
    """The units ``model`` is sharded in: the task's ``fsdp_blocks``, else
    :func:`default_blocks`."""
    blocks = task.fsdp_blocks(model)
    return default_blocks(model) if blocks is None else list(blocks)


def held_bytes(model: nn.Module) -> int:
    """The bytes of ``model``'s parameters and buffers held by this process: of a sharded
    parameter (a DTensor), its local shard only."""
    held = 0
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        held += local.numel() * local.element_size()
    return held


def bf16_policy(model: nn.Module, amp: str) -> bool:
    """Whether ``--amp bf16`` is FSDP2's mixed-precision policy (bf16 parameters) rather
    than autocast: not for a model with BatchNorm, whose running statistics stay fp32
    buffers that a bf16 weight cannot be normalised with (autocast keeps the weights
    fp32 and casts per operation instead)."""
    batch_norm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    return amp == "bf16" and not batch_norm


def shard_model(
    model: nn.Module, blocks: list[nn.Module], amp: str, device: torch.device, world_size: int
) -> nn.Module:
    """``fully_shard`` each of ``blocks`` and then ``model`` (in place; returned), over all
    ``world_size`` workers on ``device``'s type (``cuda`` with NCCL, ``cpu`` with gloo).

    ``amp bf16`` is FSDP2's mixed precision where :func:`bf16_policy` says so: parameters
    gathered and computed in bf16, gradients reduced and kept in fp32 against the fp32
    shards the optimizer updates, instead of autocast (which would all-gather fp32 weights
    and cast them on every use)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if device.type == "cuda":  # the mesh's device is the current one (as prepare_model sets)
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world_size,))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16_policy(model, amp)
        else MixedPrecisionPolicy()
    )
    model.to(device)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """FSDP2's ``no_sync``: the micro-batch's gradients accumulate unsharded on the rank,
    without a reduce-scatter; the step's last micro-batch reduces all of them at once."""
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def save_shards(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank (a collective): its shard of the model's and the optimizer's state into
    ``directory/shards`` (rank 0 also DCP's index of all of them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_state, "optimizer": optimizer_state},
        checkpoint_id=os.path.join(directory, SHARDS),
    )


def load_shards(
    directory: str, model: nn.Module, optimizer: torch.optim.Optimizer, with_optimizer: bool
) -> None:
    """Every rank (a collective): the slices of ``directory/shards`` this rank's shards
    hold, into the sharded ``model`` (and ``optimizer``'s state if ``with_optimizer``),
    whatever the world size that wrote them. Without it the optimizer is not touched: it
    starts fresh, as DDP's does (``load_model_shards``)."""
    if not with_optimizer:
        load_model_shards(directory, model)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.load(
        {"model": model_state, "optimizer": optimizer_state},
        checkpoint_id=os.path.join(directory, SHARDS),
    )  # loads in place: the dicts hold the checkpoint's values now
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)


def load_model_shards(directory: str, model: nn.Module) -> None:
    """Every rank (a collective): the model's slices of ``directory/shards`` into the
    sharded ``model``, and nothing else. Not through ``get_state_dict(model, optimizer)``:
    to have a state to read into, that steps an optimizer without one once on zero
    gradients (AdamW's then says step 1, with zero moments), so a resume with another
    ``--optimizer`` kind would not start it fresh."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    wanted = {"model": get_model_state_dict(model)}
    dcp.load(wanted, checkpoint_id=os.path.join(directory, SHARDS))
    set_model_state_dict(model, wanted["model"])
