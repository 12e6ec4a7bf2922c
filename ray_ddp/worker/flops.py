"""Training FLOPs per sample, counted once, and model FLOPs utilisation (MFU).

``torch.utils.flop_counter`` counts the floating-point operations of the matrix
multiplications and convolutions a forward and backward pass dispatch (2 per
multiply-add; element-wise work such as activations and normalisation is not counted,
as is usual for MFU). :func:`count_training_flops` runs one forward and backward of the
task's loss on a copy of the model (the model itself, its gradients and its BatchNorm
statistics are untouched), divides by the batch's samples and tells the convolutions'
share apart.

MFU is the achieved rate (FLOPs per sample x samples per second) over the device's
dense peak for the precision the step's products run in (:func:`run_peak`): the GPU's
name is looked up in a table of datasheet figures; an unknown GPU, or a CPU, gets TFLOP/s
without MFU. With ``--amp bf16``/``fp16`` that is the half-precision tensor-core peak.
With ``--amp off`` it is what torch is set to when the FLOPs are counted, read per kind of
product, because torch sets them apart and by default differently: fp32 matrix
multiplications (linear layers, attention) run in plain FP32 unless TF32 is allowed
(``torch.backends.cuda.matmul.fp32_precision``, or ``allow_tf32`` and
``torch.set_float32_matmul_precision`` before torch 2.9), and cuDNN's convolutions run on
TF32 tensor cores unless it is turned off (``torch.backends.cudnn``). A step with both is
measured against the rate it would reach with every product at its own peak (convolutions'
and matmuls' FLOPs each over their peak): an MLP or a language model against the FP32
peak (on an H200 67 TFLOP/s, not the TF32 494), a ResNet near the TF32 one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

# Dense (no sparsity) datasheet peaks in TFLOP/s: (bf16/fp16 tensor cores, TF32 tensor
# cores, plain FP32 without tensor cores). Matched by substring of the device name,
# case-insensitively; the first match wins, so specific names come first.
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
    ("L4", (121.0, 60.0, 30.3)),
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


def fp32_on_tf32(op: str) -> bool:
    """Whether torch runs fp32 ``"matmul"`` (cuBLAS: linear layers, attention's products)
    or ``"conv"`` (cuDNN convolutions) on TF32 tensor cores now. Read from
    ``fp32_precision`` (torch 2.9 on; ``"tf32"``, else IEEE fp32), which also reflects
    ``allow_tf32`` and ``torch.set_float32_matmul_precision`` (``"high"``/``"medium"``:
    TF32), and which stays readable where ``allow_tf32`` raises (a process that set both
    APIs); ``allow_tf32`` before torch 2.9. Torch's defaults: matmuls in plain fp32,
    convolutions on TF32."""
    matmul = op == "matmul"
    new_api = torch.backends.cuda.matmul if matmul else getattr(torch.backends.cudnn, "conv", None)
    precision = getattr(new_api, "fp32_precision", None)
    if precision is not None:
        return precision == "tf32"
    return bool((torch.backends.cuda.matmul if matmul else torch.backends.cudnn).allow_tf32)


def _row(device_name: str) -> tuple[float, float, float] | None:
    for key, row in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return row
    return None


def _fp32_peak(row: tuple[float, float, float], tf32: bool) -> tuple[float, str]:
    """The peak of fp32 products and what runs them: TF32 tensor cores where allowed and
    the GPU has them, else plain FP32."""
    _, tf32_peak, fp32 = row
    return (tf32_peak, "tf32") if tf32 and tf32_peak else (fp32, "fp32")


def peak_tflops(device_name: str, amp: str, tf32: bool | None = None) -> float | None:
    """The dense peak of ``device_name`` for ``--amp`` (``bf16``/``fp16``: tensor cores;
    ``off``: TF32 tensor cores where ``tf32``, else plain FP32; ``tf32`` None: as torch
    runs fp32 matmuls now, :func:`fp32_on_tf32`); None if unknown."""
    row = _row(device_name)
    if row is None:
        return None
    if amp in ("bf16", "fp16"):
        return row[0]
    return _fp32_peak(row, fp32_on_tf32("matmul") if tf32 is None else tf32)[0]


def run_peak(device_name: str, amp: str, conv_share: float = 0.0) -> tuple[float | None, str]:
    """The peak MFU is measured against, per device, and what it is (for
    :func:`flops_line`), for a step whose FLOPs are ``conv_share`` convolutions. ``--amp
    bf16``/``fp16``: the tensor-core peak. ``off``: matmuls and convolutions each at the
    peak of the precision torch runs them in now (:func:`fp32_on_tf32`), combined as the
    rate of a step with every product at its own peak: the FLOPs over the sum of each
    kind's FLOPs / its peak. (None, "") for an unknown device."""
    row = _row(device_name)
    if row is None:
        return None, ""
    if amp in ("bf16", "fp16"):
        return row[0], amp
    shares = {"matmul": 1.0 - conv_share, "conv": conv_share}
    peaks = {op: _fp32_peak(row, fp32_on_tf32(op)) for op, share in shares.items() if share > 0}
    peak = 1.0 / sum(shares[op] / p for op, (p, _) in peaks.items())
    kinds = {kind for _, kind in peaks.values()}
    if len(kinds) == 1:
        return peak, kinds.pop()
    (mm, mm_kind), (cv, cv_kind) = peaks["matmul"], peaks["conv"]
    return peak, (
        f"{mm_kind} matmuls at {mm:.0f} for {_share(1.0 - conv_share)} of the FLOPs, "
        f"{cv_kind} convolutions at {cv:.0f} for {_share(conv_share)}"
    )


def _share(x: float) -> str:
    return "<0.1%" if x < 0.001 else ">99.9%" if x > 0.999 else f"{x:.1%}"


@dataclass(frozen=True)
class FlopCount:
    """One training step's FLOPs per sample, and which share of them are convolutions
    (cuDNN's, whose fp32 precision torch sets apart from the matmuls')."""

    per_sample: float
    conv_share: float = 0.0


def count_training_flops(model: torch.nn.Module, task: Any, batch: Any) -> FlopCount | None:
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
    total = counter.get_total_flops()
    by_op = counter.get_flop_counts().get("Global", {})
    conv = sum(n for op, n in by_op.items() if "convolution" in str(op))
    return FlopCount(total / max(1, samples), conv / total if total else 0.0)


def training_flops_per_sample(model: torch.nn.Module, task: Any, batch: Any) -> float | None:
    """:func:`count_training_flops`' FLOPs per sample alone."""
    count = count_training_flops(model, task, batch)
    return count.per_sample if count else None


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


def flops_line(per_sample: float | None, peak: float | None, precision: str) -> str:
    """The start-up log line: the count, and the peak MFU is measured against with what it
    is the peak of (:func:`run_peak`'s ``bf16``, ``fp16``, ``tf32``, ``fp32`` or a mix)."""
    if not per_sample:
        return "flops: not counted (the flop counter could not trace this model)"
    line = f"flops: {per_sample / 1e9:.3g} GFLOP per training sample (forward and backward)"
    if peak:
        line += f"; MFU against {peak:.0f} TFLOP/s per GPU ({precision})"
    return line
