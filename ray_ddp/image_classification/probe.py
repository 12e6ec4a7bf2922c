"""Does a built-in or torchvision classifier run on the data's images? A shapes-only
forward on the meta device, before Ray starts (``ImageClassification.check``)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
from torch import nn

from ray_ddp.config import ConfigError
from ray_ddp.image_classification.models import build_model
from ray_ddp.task.checks import meta_cannot_tell, weights_on_meta

# Square image sizes to try a model on when the data's size fails, to say which one to
# pass: the common ones, up to torchvision's inception_v3 (299).
_PROBE_SIZES = (32, 64, 128, 224, 299)
# A model this small is tried for real, on CPU: a forward of 2 samples takes milliseconds,
# where the meta device's first use imports its shape machinery (sympy and the meta
# kernels: 2-3 s of the driver's start-up on 2 cores). Larger ones stay on meta.
_REAL_PARAMETERS = 5_000_000
_REAL_INPUT = 3 * 128 * 128


def check_model_runs(
    model_name: str, input_shape: tuple[int, ...], num_classes: int, resizable: bool = True
) -> None:
    """Refuse a model that would fail in the workers' first training step on this data
    (saying which ``--image-size`` it runs on, where the data is ``resizable``).

    Runs its training-mode forward on a batch of 2 samples of the data's shape on the
    ``meta`` device: shapes only, no memory, no weights, no arithmetic (ResNet-50: about
    0.1 s, most of it building the modules); a small model runs for real on CPU instead
    (``_runs_for_real``). It must give one tensor of class scores, (2, num_classes).
    Where the meta device cannot tell (an op without a meta kernel, a value the forward
    needs), the model is let through: the check never refuses a model that works."""
    with warnings.catch_warnings():  # torchvision's notes on weight init, irrelevant here
        warnings.simplefilter("ignore")
        try:
            with weights_on_meta():
                model = build_model(model_name, input_shape, num_classes)
        except ConfigError:
            raise
        except Exception:  # a constructor that needs real weights: cannot tell here
            return
        if _runs_for_real(model, model_name, input_shape, num_classes):
            return
        model.train()
        try:
            output = _forward(model, input_shape)
        except Exception as exc:
            if not meta_cannot_tell(exc):
                sizes = _PROBE_SIZES if resizable and len(input_shape) == 3 else ()
                raise ConfigError(
                    _input_problem(model_name, model, input_shape, num_classes, exc, sizes)
                ) from None
            return
        _check_output(model_name, output, num_classes)


def _runs_for_real(
    meta_model: nn.Module, model_name: str, input_shape: tuple[int, ...], num_classes: int
) -> bool:
    """For a small model: its real forward on CPU gives (2, num_classes) class scores. False
    when it is not small or fails (the meta device then says why, as for any model)."""
    size = sum(p.numel() for p in meta_model.parameters())
    if size > _REAL_PARAMETERS or math.prod(input_shape) > _REAL_INPUT:
        return False
    try:
        with torch.random.fork_rng(devices=[]):  # the driver's random state is untouched
            model = build_model(model_name, input_shape, num_classes)
        model.train()
        with torch.no_grad():
            output = model(torch.zeros(2, *input_shape))
    except Exception:
        return False
    _check_output(model_name, output, num_classes)
    return True


def _forward(model: nn.Module, input_shape: tuple[int, ...]) -> object:
    # Tensors the forward creates without naming a device go to meta as well.
    with torch.device("meta"), torch.no_grad():
        return model(torch.empty(2, *input_shape))


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
