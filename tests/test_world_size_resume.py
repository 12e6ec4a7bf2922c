"""A stopped 2-worker run continued on 1 worker is the same optimisation: the same
samples in the same optimizer steps (a ledger gathered from every rank), every sample
once per epoch, and the same final weights as the uninterrupted 2-worker run.

Tolerance: see tests/ledgers.py.
"""

from __future__ import annotations

import pytest
from ledgers import EXACT_RUN, assert_every_sample_once, assert_same_weights, ledger

from ray_ddp.checkpoint import load_state
from ray_ddp.trainer import fit

pytestmark = pytest.mark.ray

TASK = "ray_ddp.image_classification:ImageClassification"


def test_a_stopped_run_continued_on_one_worker_is_the_same_run(straight_run, tmp_path, capsys):
    storage = str(tmp_path)
    # Stopped by a failure at step 163 (epoch 3, after the checkpoint at step 160).
    with pytest.raises(Exception, match="non-finite"):
        fit(TASK, num_workers=2, storage_path=storage, name="moved", inject_nan_step=163,
            **EXACT_RUN)  # fmt: skip
    capsys.readouterr()
    summary = fit(TASK, num_workers=1, storage_path=storage, name="moved", **EXACT_RUN)
    out = capsys.readouterr().out
    assert (
        "run moved continues on 1 worker: accumulation 1 -> 2 keeps its global batch of 64" in out
    )
    assert "samples into epoch 3" in out  # resumed inside the epoch, not at its start
    assert (
        "lost 1 worker since the checkpoint: continuing on 1 worker, accumulation 1 -> 2, " in out
    )
    assert summary["world_size"] == 1 and summary["global_batch_size"] == 64

    steps = ledger(summary["run_dir"])
    assert_every_sample_once(steps, EXACT_RUN["train_samples"])
    assert steps == ledger(straight_run["run_dir"]), "the same samples in the same steps"
    history = [(row["epoch"], row["world_size"], row["accum_steps"]) for row in summary["history"]]
    assert history == [(3, 1, 2)]
    assert_same_weights(
        load_state(summary["latest_checkpoint"])["model"],
        load_state(straight_run["latest_checkpoint"])["model"],
    )
