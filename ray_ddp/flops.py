"""Training FLOPs per sample, counted once, and model FLOPs utilisation (MFU).

``torch.utils.flop_counter`` counts the floating-point operations of the matrix
multiplications and convolutions a forward and backward pass dispatch (2 per
multiply-add; element-wise work such as activations and normalisation is not counted,
as is usual for MFU). :func:`training_flops_per_sample` runs one forward and backward
of the task's loss on a copy of the model (the model itself, its gradients and its
BatchNorm statistics are untouched) and divides by the batch's samples.

MFU is the achieved rate (FLOPs per sample x samples per second) over the device's
dense peak for the precision in use (:func:`peak_tflops`): the GPU's name is looked up
in a table of datasheet figures; an unknown GPU, or a CPU, gets TFLOP/s without MFU.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

# Dense (no sparsity) datasheet peaks in TFLOP/s: (bf16/fp16 tensor cores, tf32, fp32).
# Matched by substring of torch.cuda.get_device_name(), first match wins (SXM figures;
# PCIe parts run lower clocks: their MFU reads a little low).
PEAK_TFLOPS: tuple[tuple[str, tuple[float, float, float]], ...] = (
    ("B200", (2250.0, 1100.0, 80.0)),
    ("H200", (989.4, 494.7, 66.9)),
    ("H100", (989.4, 494.7, 66.9)),
    ("A100", (312.0, 156.0, 19.5)),
    ("L40S", (362.1, 183.0, 91.6)),
    ("L4", (121.0, 60.0, 30.3)),
    ("A10", (125.0, 62.5, 31.2)),
    ("V100", (125.0, 15.7, 15.7)),  # no TF32: fp32 for it
    ("T4", (65.0, 8.1, 8.1)),
)


def peak_tflops(device_name: str, amp: str) -> float | None:
    """The dense peak of ``device_name`` for ``--amp`` (``bf16``/``fp16``: tensor cores;
    ``off``: TF32, which cuDNN's convolutions use by default); None if unknown."""
    for key, (half, tf32, _fp32) in PEAK_TFLOPS:
        if key in device_name:
            return half if amp in ("bf16", "fp16") else tf32
    return None


def training_flops_per_sample(model: torch.nn.Module, task: Any, batch: Any) -> float | None:
    """FLOPs of one training step's forward and backward per sample of ``batch`` (a
    collated batch on the model's device), counted on a copy of ``model``; None where
    counting fails (an operator the counter cannot trace)."""
    from torch.utils.flop_counter import FlopCounterMode

    twin = copy.deepcopy(model)
    twin.train()
    samples = task.batch_size(batch)
    try:
        with FlopCounterMode(display=False) as counter:
            task.loss(twin, batch).float().backward()
    except Exception:  # noqa: BLE001 - a figure for the log, never a reason to stop
        return None
    return counter.get_total_flops() / max(1, samples)


def utilisation(
    flops_per_sample: float | None, samples_per_s: float, peak: float | None
) -> dict[str, float]:
    """``tflops`` achieved (all workers together if ``samples_per_s`` is the run's) and
    ``mfu`` against ``peak`` (the same number of devices' peak), where known."""
    if not flops_per_sample:
        return {}
    achieved = flops_per_sample * samples_per_s / 1e12
    result = {"tflops": achieved}
    if peak:
        result["mfu"] = achieved / peak
    return result
