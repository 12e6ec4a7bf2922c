"""The worked example ``examples.tabular_regression`` (an MLP on Parquet feature columns)
trained by ray_ddp: real Ray, real DDP over gloo on 2 CPU workers, nothing mocked.

The data is Friedman #1 with noise sigma = 1 (examples/make_tabular_data.py): no model can
beat a validation MSE of 1.0 or an MAE of 0.80 on average, and predicting the training
mean scores an MSE of about 25.8 and an MAE of about 4.2 on this validation split.

1. A 3-epoch run on 2 workers gets close to that floor; its best checkpoint, loaded and
   exported, predicts from raw feature columns in the target's units.
2. The same run stopped by ``max_steps`` inside epoch 2 and re-run continues to
   bit-identical weights.
(A Tune sweep over the task, ranking its trials by validation MAE, the task's best_metric,
is test_s3_storage's sweep on S3.)
"""

from __future__ import annotations

import math
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import ray_ddp
from examples.make_tabular_data import write_friedman
from examples.tabular_regression import TabularMLP, TabularRegression
from ray_ddp.config import ConfigError, TrainConfig

TASK = "examples.tabular_regression:TabularRegression"
# 8000 rows / (2 workers x 64) = 63 steps an epoch (the last batch short); training takes
# about a second an epoch, the rest is Ray.
#
# The default warm-up and cosine schedule, which spans the run's --epochs whatever
# max_steps says: so the run stopped by max_steps and re-run without it (test 2) must follow
# the uninterrupted run's schedule exactly (issue 27: it used to be fitted into max_steps,
# which made test 2 end 2e-1 away). One uninterrupted run serves tests 1 and 2.
RUN = dict(
    task=TASK, num_workers=2, epochs=3, batch_size=64, lr=5e-3, seed=0, checkpoint_every=25,
    tensorboard=False, progress_interval_s=0,
)  # fmt: skip
STOP_AT = 90  # inside epoch 2 (steps 64-126), between checkpoints at 75 and 100


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("friedman"))
    write_friedman(path, train_rows=8000, val_rows=1000, noise=1.0, seed=0)
    return path


@pytest.fixture(scope="module")
def full_run(ray_session, tmp_path_factory, data_dir):
    """An uninterrupted run: the accuracy test's subject and the resume test's reference."""
    storage = str(tmp_path_factory.mktemp("runs"))
    cfg = TrainConfig(**RUN, data_dir=data_dir, storage_path=storage, name="full")
    return ray_ddp.fit(TASK, cfg)


def test_describe_refuses_a_missing_split_or_column_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no train split: neither .*train.parquet nor"):
        TabularRegression().describe(TrainConfig(task=TASK, data_dir=str(tmp_path)))
    write_friedman(str(tmp_path), train_rows=50, val_rows=10, shards=2)  # folders of shards
    cfg = TrainConfig(task=TASK, data_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"part-00000.parquet: no column 'price' \(it has: x0"):
        TabularRegression(target_column="price").describe(cfg)
    facts = TabularRegression(feature_columns=["x3", "x0"]).describe(cfg)
    assert facts["features"] == ["x3", "x0"] and facts["train_rows"] == 50


@pytest.mark.ray
def test_trains_to_near_the_noise_floor_on_two_workers(full_run, data_dir):
    final, best = full_run["final"], full_run["best"]
    print(f"3 epochs, 2 workers: final {final}; best {best}; fit {full_run['wall_s']:.1f} s")
    assert [h["epoch"] for h in full_run["history"]] == [1, 2, 3]
    # The floor: MSE 1.0, MAE 0.80; the mean predictor: MSE ~25.8, MAE ~4.2. Measured at
    # the best epoch: MAE 1.11, MSE 2.12 in the keyed order (issue 47); under 1.1 and 2.0
    # in the randperm order before it: the bounds sit above either order's figure.
    assert best["val_mae"] < 1.2 and best["val_mse"] < 2.4, best
    assert final["val_mae"] < 1.3, final
    assert best["val_mae"] == min(h["val_mae"] for h in full_run["history"])
    assert final["val_rmse"] == pytest.approx(math.sqrt(final["val_mse"]))
    facts = TabularRegression().describe(TrainConfig(task=TASK, data_dir=data_dir))
    # loss: the standardised target's MSE (the training loss's units)
    assert final["val_loss"] == pytest.approx(final["val_mse"] / facts["target_std"] ** 2)

    # The loaded model is self-contained: raw feature columns in, the target's units out.
    model = ray_ddp.load_model(best["checkpoint"])
    assert isinstance(model, TabularMLP) and not model.training
    table = pq.read_table(os.path.join(data_dir, "val.parquet"))
    features = torch.tensor(np.column_stack([table.column(f"x{j}").to_numpy() for j in range(10)]))
    with torch.no_grad():
        prediction = model(features)
    error = prediction.double() - torch.tensor(table.column("target").to_numpy())
    assert error.abs().mean().item() == pytest.approx(best["val_mae"], rel=1e-5)
    # ... and so is the exported program (any batch size).
    program = torch.export.load(full_run["export"]["program"]).module()
    torch.testing.assert_close(program(features[:5]), prediction[:5])


def _weights(checkpoint: str) -> dict[str, torch.Tensor]:
    return ray_ddp.load_model(checkpoint).state_dict()


@pytest.mark.ray
def test_a_run_stopped_mid_epoch_resumes_to_the_same_weights(full_run, storage, data_dir):
    """Stopped by max_steps inside epoch 2, re-run without it: bit-identical weights and
    the same validation figures as the run never stopped. A resume restores the weights,
    AdamW's moments, the schedule's position, the data position inside the epoch (step
    27 of 63, in samples of the epoch's order) and the epoch's partial sums."""
    cfg = TrainConfig(**RUN, data_dir=data_dir, storage_path=storage, name="cut", export=False)
    stopped = ray_ddp.fit(TASK, cfg, max_steps=STOP_AT)
    assert stopped["steps"] == STOP_AT and stopped["epochs_completed"] == 1, stopped
    resumed = ray_ddp.fit(TASK, cfg)  # the same name, no max_steps: continues

    assert resumed["steps"] == full_run["steps"] == 3 * 63 and resumed["epochs_completed"] == 3
    # Epoch 2's figures cover the whole epoch, the part before the stop included.
    assert resumed["history"][0]["epoch"] == 2 and resumed["history"][0]["train_samples"] == 8000
    reference = _weights(full_run["latest_checkpoint"])
    weights = _weights(resumed["latest_checkpoint"])
    assert reference.keys() == weights.keys()
    different = [k for k in reference if not torch.equal(reference[k], weights[k])]
    assert not different, f"tensors differ after the resume: {different}"
    for key in ("val_loss", "val_mse", "val_mae"):
        assert resumed["final"][key] == full_run["final"][key], key
