"""Training FLOPs per sample against hand counts, and MFU arithmetic."""

from __future__ import annotations

import torch
from torch import nn

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
    assert peak_tflops("NVIDIA H100 80GB HBM3", "off") == 494.0
    assert peak_tflops("NVIDIA H100 PCIe", "off", tf32=False) == 51.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp16") == 312.0
    assert peak_tflops("cpu", "off") is None
    assert utilisation(3e9, 1000.0, 10.0) == {"tflops": 3.0, "mfu": 0.3}
    assert utilisation(3e9, 1000.0, None) == {"tflops": 3.0}
    assert utilisation(None, 1000.0, 10.0) == {}


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
