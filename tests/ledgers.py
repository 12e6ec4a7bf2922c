"""What the exactness tests compare (test_world_size_resume, test_nodes, test_hangs,
test_reliability): one run config, the sample ledger a run writes when a test's harness
asks for it (``LEDGER``), and final weights; the uninterrupted 2-worker run they compare
with is the session fixture ``straight_run`` (conftest.py).

Weight tolerance: two runs of one optimisation at different world sizes add the same
numbers in different places. At 2 workers each rank back-propagates its micro-batch's
mean loss and DDP's all-reduce averages the two gradients, (g0 + g1) / 2; at 1 worker the
two micro-batches' losses are weighted by 1/2 and their gradients accumulate, g0 / 2 +
g1 / 2. Halving is exact in binary floating point and a sum of two numbers does not
depend on their order, so on these CPU kernels the weights come out bit-identical; world
sizes that are not powers of two (thirds) would round differently. The assertion allows
1e-6 relative and prints the largest difference seen.
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict

import torch

from ray_ddp.io import storage
from ray_ddp.testing.harness import Harness, Stall

# 40 optimizer steps of 64 samples per epoch; a checkpoint every 10.
EXACT_RUN = {
    "model": "small_cnn",
    "epochs": 2,
    "train_samples": 2560,
    "val_samples": 200,
    "batch_size": 32,
    "seed": 3,
    "checkpoint_every": 10,
    "export": False,
    "tensorboard": False,
    "progress_interval_s": 0,
}
# EXACT_RUN as jobs/train.py's flags (progress lines aside, which change nothing trained).
EXACT_FLAGS = [
    "--model", "small_cnn", "--epochs", "2", "--train-samples", "2560", "--val-samples", "200",
    "--batch-size", "32", "--seed", "3", "--checkpoint-every", "10", "--no-export",
    "--no-tensorboard",
]  # fmt: skip
STEPS_PER_EPOCH = 40
LEDGER = Harness(sample_ledger=True)


def stalls(*events: tuple[int, int], ledger: bool = True, **more) -> Harness:
    """A harness that stops rank ``r`` at optimizer step ``s`` for each ``(s, r)`` (once per
    run, until the test ends it: it kills the process, or removes its node)."""
    planned = tuple(Stall(step, rank=rank) for step, rank in events)
    return Harness(stalls=planned, sample_ledger=ledger, **more)


def ledger(run_dir: str) -> dict[int, dict[int, list[int]]]:
    """epoch -> optimizer step -> the sample indices trained in it (``run_dir``: a local
    path or a storage URI)."""
    import pyarrow.fs

    fs, inner = storage.filesystem(storage.join(run_dir, "ledger"))
    names = sorted(info.base_name for info in fs.get_file_info(pyarrow.fs.FileSelector(inner)))
    epochs: dict[int, dict[int, list[int]]] = {}
    for name in names:
        steps: dict[int, list[int]] = defaultdict(list)
        text = storage.read_text(storage.join(run_dir, "ledger", name)) or ""
        for row in csv.DictReader(io.StringIO(text)):
            steps[int(row["step"])].append(int(row["index"]))
        epochs[int(name.removeprefix("epoch-").removesuffix(".csv"))] = dict(steps)
    return epochs


def assert_every_sample_once(epochs: dict[int, dict[int, list[int]]], size: int) -> None:
    for epoch, steps in epochs.items():
        trained = sorted(i for indices in steps.values() for i in indices)
        assert trained == list(range(size)), f"epoch {epoch}: not every sample exactly once"


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(
        float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point()
    )


def assert_same_weights(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float = 1e-6, atol: float = 1e-7
) -> None:
    print(f"largest weight difference: {max_difference(a, b):.3g}")  # with pytest -s
    for key in a:
        if a[key].is_floating_point():
            torch.testing.assert_close(a[key], b[key], rtol=rtol, atol=atol, msg=key)
