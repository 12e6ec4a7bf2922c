"""jobs/evaluate.py and unreadable samples (issue 27): counted over every rank and named
(the printed summary, --summary-json, a row per sample in --predictions with a marker),
up to --max-bad-samples; one more stops the evaluation, exit 1, with one line.

The first tests need no Ray (the driver's report of a finished evaluation); the last one
trains a checkpoint on 2 real Ray workers and evaluates it on 2."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest
from test_bad_samples import _run_config, _tree

from ray_ddp.data.unreadable import BadSamplesError
from ray_ddp.driver.cli import evaluate_parser
from ray_ddp.driver.evaluate import check_unreadable, results_text, write_predictions


def _results(unreadable: list[dict], evaluated: int = 7) -> dict:
    return {
        "checkpoint": "runs/x/checkpoint_1",
        "split": "val",
        "world_size": 2,
        "samples": evaluated,
        "split_samples": evaluated + len(unreadable),
        "unreadable": len(unreadable),
        "unreadable_samples": unreadable,
        "metrics": {"loss": 0.5, "acc": 0.75},
        "sums": {"loss": [3.5, evaluated], "acc": [5.25, evaluated]},
    }


def _bad(index: int, rank: int = 0) -> dict:
    return {
        "index": index,
        "sample": f"/data/val/cat/{index}.png",
        "error": "OSError: image file is truncated",
        "rank": rank,
    }


# ------------------------------------------------------------------ without Ray
def test_the_summary_says_how_many_were_skipped_and_names_the_first():
    text = results_text(_results([_bad(i, rank=i % 2) for i in (0, 3, 4, 8, 9, 11, 12)]))
    lines = text.splitlines()
    assert "7 unreadable samples skipped (metrics over 7 of 14 samples)" in lines
    assert "  index 3: /data/val/cat/3.png (OSError: image file is truncated; rank 1)" in lines
    shown = [line for line in lines if line.startswith("  index ")]
    assert len(shown) == 5
    assert "  ... and 2 more; --summary-json and --predictions list them all" in lines
    clean = results_text(_results([]))
    assert "unreadable" not in clean


def test_over_the_cap_one_line_names_them_and_says_what_to_do():
    results = _results([_bad(2, rank=0), _bad(5, rank=1)])
    check_unreadable(results, cap=2)  # at the cap: allowed
    with pytest.raises(BadSamplesError) as stop:
        check_unreadable(results, cap=1)
    line = str(stop.value)
    assert "\n" not in line
    assert line.startswith(
        "2 unreadable samples in the val split, over --max-bad-samples 1: "
        "/data/val/cat/2.png (OSError: image file is truncated; rank 0), "
        "/data/val/cat/5.png (OSError: image file is truncated; rank 1)"
    )
    assert line.endswith("Fix or remove them, or raise --max-bad-samples")


def test_predictions_have_a_row_per_sample_with_an_unreadable_marker(tmp_path):
    path = str(tmp_path / "p.parquet")
    rows = [(0, 1, 0.5), (2, 0, 0.25)]
    write_predictions(rows, ["label", "predicted"], path, [_bad(1), _bad(3)])
    table = pq.read_table(path).to_pydict()
    assert table == {
        "index": [0, 1, 2, 3],
        "label": [1, None, 0, None],
        "predicted": [0.5, None, 0.25, None],
        "unreadable": [False, True, False, True],
        "unreadable_error": [None, "OSError: image file is truncated", None,
                             "OSError: image file is truncated"],
    }  # fmt: skip


def test_evaluate_takes_max_bad_samples_and_keeps_the_checkpoints_by_default():
    assert evaluate_parser().parse_args(["ckpt"]).max_bad_samples is None
    assert evaluate_parser().parse_args(["ckpt", "--max-bad-samples", "0"]).max_bad_samples == 0


# ------------------------------------------------------------------ real runs on Ray
@pytest.mark.ray
def test_evaluate_counts_and_names_unreadable_samples_of_every_rank(
    ray_session, storage, tmp_path, capsys
):
    """Two unreadable val files, one on each rank's shard (rank r takes r, r + 2, ...):
    rank 0 reports both; over --max-bad-samples the evaluation stops with exit 1."""
    from ray_ddp.driver.cli import evaluate_main
    from ray_ddp.driver.run import run_training

    root, _, garbage = _tree(tmp_path)  # val/owl/1.png: index 7 of 9, rank 1's
    truncated = os.path.join(root, "val", "cat", "0.png")  # index 0: rank 0's
    with open(truncated, "r+b") as f:
        f.truncate(os.path.getsize(truncated) // 2)
    cfg = _run_config(storage, "evalskips", dataset="imagefolder", data_dir=root, loader_workers=0)
    checkpoint = run_training(cfg)["latest_checkpoint"]
    capsys.readouterr()
    predictions, summary = str(tmp_path / "p.parquet"), str(tmp_path / "r.json")
    common = [checkpoint, "--num-workers", "2", "--storage-path", storage]
    code = evaluate_main([*common, "--predictions", predictions, "--summary-json", summary])
    out = capsys.readouterr().out
    assert code == 0
    assert "2 unreadable samples skipped (metrics over 7 of 9 samples)" in out
    assert f"  index 0: {truncated} (OSError: image file is truncated; rank 0)" in out
    assert f"  index 7: {garbage} (UnidentifiedImageError: cannot identify image file" in out
    with open(summary) as f:
        results = json.load(f)
    assert (results["samples"], results["split_samples"], results["unreadable"]) == (7, 9, 2)
    assert results["sums"]["loss"][1] == 7
    assert [(s["index"], s["sample"], s["rank"]) for s in results["unreadable_samples"]] == [
        (0, truncated, 0),
        (7, garbage, 1),
    ]
    table = pq.read_table(predictions).to_pydict()
    assert table["index"] == list(range(9))
    assert [i for i, bad in enumerate(table["unreadable"]) if bad] == [0, 7]
    assert table["predicted"][0] is None and table["predicted"][1] is not None
    assert table["unreadable_error"][0] == "OSError: image file is truncated"

    os.remove(summary)
    code = evaluate_main([*common, "--summary-json", summary, "--max-bad-samples", "1"])
    err = capsys.readouterr().err
    assert code == 1
    (line,) = [line for line in err.splitlines() if "failed" in line]
    assert line.startswith(
        f"evaluation failed: 2 unreadable samples in the val split, over --max-bad-samples 1: "
        f"{truncated} (OSError: image file is truncated; rank 0), {garbage} ("
    )
    assert not os.path.exists(summary)  # no figures from an evaluation that stopped
