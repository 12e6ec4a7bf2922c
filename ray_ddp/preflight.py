"""Everything about a request that can be refused without Ray: the config, the model (its
name, and whether it runs on the data), the data, the checkpoint to resume from, the
batch against the data. Each refusal is a ConfigError with one line saying what to
change, raised before any cluster work."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ray_ddp.checkpoint import CheckpointError, check_compatible, load_state, model_meta
from ray_ddp.config import ConfigError, TrainConfig, validate
from ray_ddp.datasets import DatasetInfo, describe_dataset
from ray_ddp.models import build_model, check_model_name
from ray_ddp.rerun_guard import check_rerun

# Square image sizes to try a model on when the data's size fails, to say which one to
# pass: the common ones, up to torchvision's inception_v3 (299).
_PROBE_SIZES = (32, 64, 128, 224, 299)


def preflight(cfg: TrainConfig, batch_sizes: Sequence[int] = ()) -> DatasetInfo:
    """Check ``cfg`` (and the per-worker ``batch_sizes`` a sweep will try; default: the
    config's own) against the data. Returns what the data looks like."""
    validate(cfg)
    check_model_name(cfg.model)
    if cfg.amp == "fp16" and cfg.use_gpu is None and not cfg.address and not _local_gpus():
        raise ConfigError(
            "--amp fp16 needs GPUs and this machine has none; use --amp bf16 or --amp off"
        )
    info = describe_dataset(cfg)
    resizable = cfg.dataset != "synthetic"  # the built-in data has one size
    check_model_runs(cfg.model, info.input_shape, info.num_classes, resizable)
    check_rerun(cfg)
    if cfg.resume_from:
        try:
            state = load_state(cfg.resume_from)
            check_compatible(
                state,
                model_meta(cfg.model, info.num_classes, info.input_shape),
                f"--resume-from {cfg.resume_from}",
            )
        except CheckpointError as exc:
            raise ConfigError(str(exc)) from exc
    for batch_size in batch_sizes or [cfg.batch_size]:
        check_batch_fits(cfg, info, batch_size)
    return info


def check_batch_fits(cfg: TrainConfig, info: DatasetInfo, batch_size: int) -> None:
    """A per-worker batch larger than a worker's shard of the data is never filled: it is
    refused rather than run as something else. Needs num_workers; a no-op while it is
    "auto"."""
    if info.train_size is None or not cfg.num_workers:
        return
    shard = -(-info.train_size // cfg.num_workers)
    if batch_size > shard:
        raise ConfigError(
            f"--batch-size {batch_size} (per worker) is larger than a worker's "
            f"share of the {info.train_size} training samples ({shard}); lower it"
        )
    batches = -(-shard // batch_size)  # the last micro-batch may be short
    if cfg.accum_steps > batches:
        raise ConfigError(
            f"--accum-steps {cfg.accum_steps} is more than the {batches} micro-batches of "
            f"{batch_size} a worker gets per epoch, so no step would accumulate that many; "
            "lower --accum-steps or --batch-size"
        )


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# ----------------------------------------------------------------- does the model run
def check_model_runs(
    model_name: str, input_shape: tuple[int, ...], num_classes: int, resizable: bool = True
) -> None:
    """Refuse a model that would fail in the workers' first training step on this data
    (saying which ``--image-size`` it runs on, where the data is ``resizable``).

    Runs its training-mode forward on a batch of 2 samples of the data's shape on the
    ``meta`` device: shapes only, no memory, no weights, no arithmetic (ResNet-50: about
    0.1 s, most of it building the modules). It must give one tensor of class scores,
    (2, num_classes). Where the meta device cannot tell (an op without a meta kernel, a
    value the forward needs), the model is let through: the check never refuses a model
    that works."""
    with warnings.catch_warnings():  # torchvision's notes on weight init, irrelevant here
        warnings.simplefilter("ignore")
        try:
            with _weights_on_meta():
                model = build_model(model_name, input_shape, num_classes)
        except ConfigError:
            raise
        except Exception:  # a constructor that needs real weights: cannot tell here
            return
        model.train()
        try:
            output = _forward(model, input_shape)
        except Exception as exc:
            if not _meta_cannot_tell(exc):
                sizes = _PROBE_SIZES if resizable and len(input_shape) == 3 else ()
                raise ConfigError(
                    _input_problem(model_name, model, input_shape, num_classes, exc, sizes)
                ) from None
            return
        _check_output(model_name, output, num_classes)


@contextlib.contextmanager
def _weights_on_meta() -> Iterator[None]:
    """Parameters and buffers go to the meta device as modules register them, so even a
    large model allocates nothing and its weight initialisation does no arithmetic.
    (Registration hooks, not ``with torch.device("meta")``: a constructor may compute its
    layer widths with tensors, as RegNet's does, and those must hold real numbers.)"""
    from torch.nn.modules import module

    hooks = [
        module.register_module_parameter_registration_hook(
            lambda _, __, param: nn.Parameter(param.to("meta"), param.requires_grad)
        ),
        module.register_module_buffer_registration_hook(
            lambda _, __, buffer: None if buffer is None else buffer.to("meta")
        ),
    ]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _forward(model: nn.Module, input_shape: tuple[int, ...]) -> object:
    # Tensors the forward creates without naming a device go to meta as well.
    with torch.device("meta"), torch.no_grad():
        return model(torch.empty(2, *input_shape))


def _meta_cannot_tell(exc: Exception) -> bool:
    """An error of the meta device, not of the model on this input."""
    return isinstance(exc, NotImplementedError) or "meta" in str(exc).lower()


def _check_output(model_name: str, output: object, num_classes: int) -> None:
    if not isinstance(output, torch.Tensor):
        raise ConfigError(
            f"--model {model_name} returns {type(output).__name__} in training mode, not "
            "one tensor of class scores (googlenet and inception_v3 add their auxiliary "
            "classifiers' outputs); choose another model, e.g. resnet18"
        )
    if tuple(output.shape) != (2, num_classes):
        raise ConfigError(
            f"--model {model_name} gives outputs of shape {tuple(output.shape)} for 2 "
            f"samples, not (2, {num_classes}) class scores; choose another model"
        )


def _input_problem(
    model_name: str,
    model: nn.Module,
    input_shape: tuple[int, ...],
    num_classes: int,
    exc: Exception,
    sizes: Sequence[int],
) -> str:
    """What went wrong on the data's input, and the first of the larger image ``sizes``
    the model runs on, if any."""
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    image = len(input_shape) == 3
    given = f"{input_shape[1]}x{input_shape[2]}" if image else str(input_shape)
    problem = f"--model {model_name} fails on the data's {given} input ({reason})"
    for size in (s for s in sizes if s > max(input_shape[1:])):
        try:
            output = _forward(model, (input_shape[0], size, size))
        except Exception:
            continue
        _check_output(model_name, output, num_classes)  # runs, but gives no class scores
        return f"{problem}; it runs on {size}x{size} images: pass --image-size {size}"
    return f"{problem}; choose another model"
