"""A sweep's rows from real Tune results (ray.tune's Result objects, no cluster needed)."""

from __future__ import annotations

import pandas as pd
from ray.air.result import Result

from ray_ddp.driver.sweep_results import results_table, trial_row

CONFIG = {
    "lr": 0.01,
    "batch_size": 32,
    "scale_lr": False,
    "train": {"batch_size": 32, "num_workers": 2, "accum_steps": 1},
}


BEST = {
    "trial": "t0", "lr": 0.01, "batch_size": 32, "global_batch_size": 64,
    "metric": "val_acc", "best_value": 0.5, "best_checkpoint": "/c",
}  # fmt: skip


def _result(rows: list[dict], error: Exception | None = None) -> Result:
    frame = pd.DataFrame(rows) if rows else None
    return Result(
        metrics={"config": CONFIG, "trial_id": "t1"} if rows or error is None else None,
        checkpoint=None,
        error=error,
        path="/runs/sweep/t1",
        metrics_dataframe=frame,
    )


def test_mid_epoch_reports_do_not_enter_the_curves_or_the_figures():
    rows = [
        {"epoch": 0, "val_acc": -1.0, "mid_epoch": True, "val_loss": None},
        {"epoch": 1, "val_acc": 0.40, "val_loss": 1.2},
        {"epoch": 1, "val_acc": -1.0, "mid_epoch": True, "val_loss": None},
        {"epoch": 2, "val_acc": 0.55, "val_loss": 1.0},
        {"epoch": 2, "val_acc": -1.0, "mid_epoch": True, "val_loss": None},
    ]
    row = trial_row(_result(rows), epochs=2)
    assert row["curve"] == [(1, 0.40), (2, 0.55)]
    assert row["final_value"] == 0.55 and row["best_value"] == 0.55
    assert row["status"] == "finished"


def test_a_trial_without_an_epoch_report_is_not_finished():
    failed = trial_row(_result([], error=RuntimeError("worker died")), epochs=3)
    assert failed["status"] == "error" and failed["best_value"] is None
    assert failed["lr"] is None  # Tune kept no config for it: the row says so, no crash
    table = results_table({"trials": [failed], "best": BEST, "sweep_dir": "/s", "wall_s": 1})
    assert "t1" in table and "error" in table
    only_mid = [{"epoch": 0, "val_acc": -1.0, "mid_epoch": True, "val_loss": None}]
    silent = trial_row(_result(only_mid), epochs=3)
    assert silent["status"] == "no result" and silent["curve"] == []


def test_a_metric_where_lower_is_better_picks_the_lowest_epoch():
    rows = [
        {"epoch": 1, "val_mae": 3.0, "val_loss": 9.0},
        {"epoch": 1, "val_mae": 1.7976931348623157e308, "mid_epoch": True},
        {"epoch": 2, "val_mae": 2.0, "val_loss": 5.0},
        {"epoch": 3, "val_mae": 2.5, "val_loss": 6.0},
    ]
    row = trial_row(_result(rows), epochs=3, metric="val_mae", mode="min")
    assert row["best_value"] == 2.0 and row["best_val_loss"] == 5.0
    assert row["final_value"] == 2.5 and row["metric"] == "val_mae"
    assert row["curve"] == [(1, 3.0), (2, 2.0), (3, 2.5)]


def test_a_trial_stopped_before_the_last_epoch_is_stopped_early():
    row = trial_row(_result([{"epoch": 1, "val_acc": 0.3, "val_loss": 2.0}]), epochs=3)
    assert row["status"] == "stopped early" and row["epochs_run"] == 1
