"""Exact across world sizes where the data does not divide evenly, with BatchNorm: a real
2-worker DDP run (gloo, fp32) and a 1-worker run accumulating 2 micro-batches train the
same steps and end with the same weights, on a training set of 37 samples whose epoch has
a merged 1-sample tail (a micro-batch of 5), a short last step (5 samples, not 8) and, on
2 workers, a filler (rank 1's empty slot of that step, trained with weight 0).

BatchNorm's batch statistics in training depend only on a micro-batch's samples, which do
not depend on the world size, so the weights agree. Its running statistics are buffers
DDP copies from rank 0, and rank 0 sees only its own micro-batches: they legitimately
differ, and the test says by how much they must (``num_batches_tracked``: rank 0's
forward passes).

Tolerance: the splits are powers of two (halves) and each micro-batch's loss weight is
size x world / step samples (1 and 0.5 for the whole steps, 2 and 1 for the last), so the
gradients should be the same numbers added in another place; rtol 1e-5 allows rounding
and the test prints the largest relative difference (with pytest -s).
"""

from __future__ import annotations

import pytest
import torch
from ledgers import LEDGER, assert_every_sample_once, ledger

from ray_ddp.checkpoint.format import load_model, load_state
from ray_ddp.data.order.global_order import EpochPlan
from ray_ddp.driver.run import fit

TASK = "ray_ddp.image_classification:ImageClassification"
SIZE, BATCH, GLOBAL = 37, 4, 8  # 9 micro-batches (8 of 4 then 4 + 1 joined): 5 steps
RUN = {
    "model": "small_resnet",  # BatchNorm after every convolution
    "amp": "off",  # fp32
    "epochs": 2,
    "train_samples": SIZE,
    "val_samples": 16,
    "batch_size": BATCH,
    "seed": 11,
    "export": False,
    "tensorboard": False,
    "progress_interval_s": 0,
}


def test_the_epoch_has_a_merged_tail_a_short_last_step_and_a_filler():
    """What the training test below relies on, from the plan the workers train by."""
    for epoch in range(RUN["epochs"]):
        plan = EpochPlan(SIZE, BATCH, GLOBAL, seed=RUN["seed"], epoch=epoch)
        assert plan.steps == 5 and plan.bounds()[-1] == (32, 37)
        ranks = [plan.slots(rank, 2) for rank in range(2)]
        real = [s for slots in ranks for s in slots if not s.filler]
        assert sorted(len(s.indices) for s in real) == [4] * 8 + [5]  # the merged tail
        last = [s for slots in ranks for s in slots if s.step == plan.steps - 1]
        assert {s.step_samples for s in last} == {5}  # a short last step: 5 of 8
        assert [(s.filler, s.size) for s in last] == [(False, 5), (True, 0)]  # rank 1's
        alone = plan.slots(0, 1)
        assert not any(s.filler for s in alone) and len(alone) == 9


@pytest.mark.ray
def test_two_workers_and_one_train_the_same_weights_with_batchnorm_on_uneven_data(
    ray_session, tmp_path
):
    storage = str(tmp_path)
    two = fit(TASK, num_workers=2, accum_steps=1, storage_path=storage, name="two",
              harness=LEDGER, **RUN)  # fmt: skip
    one = fit(TASK, num_workers=1, accum_steps=2, storage_path=storage, name="one",
              harness=LEDGER, **RUN)  # fmt: skip
    assert two["global_batch_size"] == one["global_batch_size"] == GLOBAL
    assert (two["world_size"], one["world_size"]) == (2, 1)
    steps = ledger(two["run_dir"])
    assert_every_sample_once(steps, SIZE)
    assert steps == ledger(one["run_dir"]), "the same samples in the same steps"
    assert all(len(epoch) == 5 and len(epoch[max(epoch)]) == 5 for epoch in steps.values())

    weights = {}
    for name, run in (("two", two), ("one", one)):
        directory = run["latest_checkpoint"]
        buffers = {key for key, _ in load_model(directory).named_buffers()}
        state = load_state(directory)["model"]
        weights[name] = {k: v for k, v in state.items() if k not in buffers}
        weights[name + " buffers"] = {k: v for k, v in state.items() if k in buffers}
    assert weights["two"].keys() == weights["one"].keys() and len(weights["two"]) > 10
    pairs = [(weights["two"][k].double(), weights["one"][k].double()) for k in weights["two"]]
    largest = max(float((a - b).abs().max()) for a, b in pairs)
    relative = max(float(((a - b).abs() / b.abs().clamp_min(1e-30)).max()) for a, b in pairs)
    print(f"2 workers vs 1, largest weight difference: {largest:.3g} ({relative:.3g} relative)")
    for key, value in weights["two"].items():
        torch.testing.assert_close(value, weights["one"][key], rtol=1e-5, atol=1e-7, msg=key)

    # The running statistics follow rank 0's micro-batches: 5 forward passes an epoch
    # on 2 workers (4 whole steps' micro-batch 0, the last step's only one), 9 on 1.
    two_buffers, one_buffers = weights["two buffers"], weights["one buffers"]
    tracked = [k for k in two_buffers if k.endswith("num_batches_tracked")]
    assert tracked and all(int(two_buffers[k]) == 5 * 2 for k in tracked)
    assert all(int(one_buffers[k]) == 9 * 2 for k in tracked)
    means = [k for k in two_buffers if k.endswith("running_mean")]
    assert all(not torch.equal(two_buffers[k], one_buffers[k]) for k in means)
