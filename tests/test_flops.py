"""Training FLOPs per sample against hand counts, and MFU arithmetic."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch import nn

from ray_ddp.worker import flops
from ray_ddp.worker.flops import peak_tflops, training_flops_per_sample, utilisation


class Regression:
    """The least a task needs here: a loss and a batch size."""

    def loss(self, model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    def batch_size(self, batch) -> int:
        return len(batch[0])


def test_an_mlp_counts_forward_and_backward_matmuls_by_hand():
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 3))
    batch = (torch.randn(4, 10), torch.randn(4, 3))
    # Forward: 2*10*20 + 2*20*3 per sample. Backward: the input gradient of the second
    # layer (2*20*3) and both weight gradients (2*10*20, 2*20*3); the first layer's input
    # gradient is not needed (its input needs no gradient).
    forward = 2 * 10 * 20 + 2 * 20 * 3
    backward = 2 * 20 * 3 + 2 * 10 * 20 + 2 * 20 * 3
    assert training_flops_per_sample(model, Regression(), batch) == forward + backward


def test_a_convolution_counts_by_hand_and_the_model_is_untouched():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                          nn.Flatten(), nn.Linear(8 * 5 * 5, 2))  # fmt: skip
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = (torch.randn(2, 3, 5, 5), torch.randn(2, 2))
    conv = 2 * 8 * 5 * 5 * 3 * 3 * 3  # per output element: 3x3x3 multiply-adds
    linear = 2 * 200 * 2
    # Backward: the conv's weight gradient (no input gradient: the input needs none),
    # the linear layer's input and weight gradients.
    expected = conv + linear + conv + 2 * linear
    assert training_flops_per_sample(model, Regression(), batch) == expected
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())  # BatchNorm stats and grads alike


def test_peaks_and_mfu():
    assert peak_tflops("NVIDIA H200", "bf16") == 989.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", "off", tf32=True) == 494.0
    assert peak_tflops("NVIDIA H100 PCIe", "off", tf32=False) == 51.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp16") == 312.0
    assert peak_tflops("cpu", "off") is None
    assert utilisation(3e9, 1000.0, 10.0) == {"tflops": 3.0, "mfu": 0.3}
    assert utilisation(3e9, 1000.0, None) == {"tflops": 3.0}
    assert utilisation(None, 1000.0, 10.0) == {}


@contextmanager
def tf32(matmul: bool | None = None, conv: bool | None = None):
    """TF32 allowed or not for fp32 matmuls and cuDNN convolutions, by torch's
    long-standing API, then put back."""
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        if matmul is not None:
            torch.set_float32_matmul_precision("high" if matmul else "highest")
        if conv is not None:
            torch.backends.cudnn.allow_tf32 = conv
        yield
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


def test_amp_off_is_measured_against_the_precision_the_matmuls_run_in():
    """Torch runs fp32 matmuls in plain FP32 unless TF32 is allowed (cuDNN's
    convolutions are another matter, below): an MLP or a language model at --amp off on an
    H200 reaches at most its 67 TFLOP/s, not the TF32 494 its MFU was measured against
    (issue 27 #7: up to 7.4x low). Allowing TF32, by either of torch's APIs, moves it."""
    with tf32(matmul=False):
        assert peak_tflops("NVIDIA H200", "off") == 67.0
        assert flops.run_peak("NVIDIA H200", "off") == (67.0, "fp32")
        assert flops.run_peak("NVIDIA H200", "bf16") == (989.0, "bf16")
    with tf32(matmul=True):
        assert peak_tflops("NVIDIA H200", "off") == 494.0
        assert flops.run_peak("NVIDIA H200", "off") == (494.0, "tf32")
        assert flops.run_peak("Tesla V100-SXM2-16GB", "off") == (15.7, "fp32")  # no TF32 cores
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch 2.9 on, where allow_tf32 can raise
        try:
            matmul.fp32_precision = "tf32"
            assert flops.run_peak("NVIDIA H200", "off") == (494.0, "tf32")
        finally:
            matmul.fp32_precision = "none"
    assert flops.run_peak("cpu", "off") == (None, "")


def test_a_convolutional_step_is_measured_at_the_peak_of_each_kind_of_product():
    """cuDNN runs fp32 convolutions on TF32 by default, the matmuls not: a step with both
    is measured against the rate it would reach with each at its own peak (a ResNet near
    the TF32 peak, its MFU never past 100%), and the count tells their shares apart."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.Flatten(),
                          nn.Linear(8 * 5 * 5, 2))  # fmt: skip
    batch = (torch.randn(2, 3, 5, 5), torch.randn(2, 2))
    conv, linear = 2 * 8 * 5 * 5 * 3 * 3 * 3, 2 * 200 * 2
    count = flops.count_training_flops(model, Regression(), batch)
    assert count.per_sample == 2 * conv + 3 * linear
    assert count.conv_share == pytest.approx(2 * conv / (2 * conv + 3 * linear))
    share = count.conv_share
    with tf32(matmul=False, conv=True):  # torch's defaults
        peak, precision = flops.run_peak("NVIDIA H200", "off", share)
        assert 67.0 < peak < 494.0
        assert share * 1e12 / 494.0 + (1 - share) * 1e12 / 67.0 == pytest.approx(1e12 / peak)
        matmuls, convs = f"{1 - share:.1%}", f"{share:.1%}"
        assert precision == (
            f"fp32 matmuls at 67 for {matmuls} of the FLOPs, tf32 convolutions at 494 for {convs}"
        )
        assert flops.run_peak("NVIDIA H200", "off", 1.0) == (494.0, "tf32")
    with tf32(matmul=False, conv=False):
        assert flops.run_peak("NVIDIA H200", "off", share) == (67.0, "fp32")
    with tf32(matmul=True, conv=True):
        assert flops.run_peak("NVIDIA H200", "off", share) == (494.0, "tf32")
    line = flops.flops_line(count.per_sample, 67.0, "fp32")
    assert line.endswith("; MFU against 67 TFLOP/s per GPU (fp32)")


def test_the_epoch_line_and_the_summary_show_the_rate_and_mfu():
    from ray_ddp.io import reporting

    metrics = {"epoch": 1, "train_loss": 1.0, "val_acc": 0.5, "lr": 1e-3,
               "samples_per_s": 3000.0, "epoch_s": 2.0}  # fmt: skip
    assert "MFU" not in reporting.epoch_line({**metrics, "tflops": 0.02}, 3)  # CPU: CSV only
    line = reporting.epoch_line({**metrics, "tflops": 73.5, "mfu": 0.4123}, 3)
    assert "73.5 TFLOP/s  MFU 41%" in line
    summary = {"name": "r", "run_dir": "runs/r", "world_size": 1, "device": "gpu",
               "global_batch_size": 256, "epochs_completed": 1, "epochs": 1, "final": {},
               "best": {}, "wall_s": 10.0, "samples_per_s": 3000.0,
               "utilisation": {"tflops": 0.045}}  # fmt: skip
    assert reporting.summary_text(summary).endswith("3000 samples/s while training, 45 GFLOP/s")
