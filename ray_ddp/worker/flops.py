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
from dataclasses import dataclass
from typing import Any

import torch

# Dense (no sparsity) datasheet peaks in TFLOP/s: (bf16/fp16 tensor cores, TF32 tensor
# cores, plain fp32). Matched by substring of the device name, case-insensitively; the
# first match wins, so specific names come first.
PEAK_TFLOPS: tuple[tuple[str, tuple[float, float, float]], ...] = (
    ("H100 PCIe", (756.0, 378.0, 51.0)),
    ("H100 NVL", (835.0, 418.0, 60.0)),
    ("GH200", (989.0, 494.0, 67.0)),
    ("H200", (989.0, 494.0, 67.0)),
    ("H100", (989.0, 494.0, 67.0)),
    ("B200", (2250.0, 1100.0, 80.0)),
    ("A100", (312.0, 156.0, 19.5)),
    ("A800", (312.0, 156.0, 19.5)),
    ("L40S", (362.0, 183.0, 91.6)),
    ("L40", (181.0, 90.5, 90.5)),
    ("L4", (121.0, 60.0, 30.0)),
    ("A10G", (70.0, 35.0, 31.2)),
    ("A10", (125.0, 62.5, 31.2)),
    ("V100", (125.0, 0.0, 15.7)),  # fp16 only, no bf16, no TF32
)


@dataclass(frozen=True)
class FlopRate:
    """A run's FLOPs per training sample and its workers' peak together, once counted."""

    per_sample: float | None = None
    peak: float | None = None
    """TFLOP/s of all workers' devices (None: unknown, or CPUs)."""

    def of(self, samples_per_s: float) -> dict[str, float]:
        """``tflops`` (and ``mfu``) at the run's ``samples_per_s``."""
        return utilisation(self.per_sample, samples_per_s, self.peak)


def peak_tflops(device_name: str, amp: str, tf32: bool = True) -> float | None:
    """The dense peak of ``device_name`` for ``--amp`` (``bf16``/``fp16``: tensor cores;
    ``off``: TF32, which cuDNN's convolutions use by default, or plain fp32 without it);
    None if unknown."""
    for key, (half, tf32_peak, fp32) in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            if amp in ("bf16", "fp16"):
                return half
            return (tf32_peak or fp32) if tf32 else fp32
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


def flops_line(per_sample: float | None, peak: float | None, amp: str) -> str:
    """The start-up log line: the count, and the peak MFU is measured against."""
    if not per_sample:
        return "flops: not counted (the flop counter could not trace this model)"
    line = f"flops: {per_sample / 1e9:.3g} GFLOP per training sample (forward and backward)"
    if peak:
        line += f"; MFU against {peak:.0f} TFLOP/s per GPU ({amp if amp != 'off' else 'tf32'})"
    return line
