"""Evaluate a checkpoint with N Ray workers (exact: every sample counted once).

python jobs/evaluate.py runs/<name>/checkpoint_<timestamp>
python jobs/evaluate.py s3://bucket/runs/<name>/checkpoint_... --predictions preds.parquet
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ray_ddp.driver.cli import evaluate_main, exit_process  # noqa: E402

if __name__ == "__main__":
    exit_process(evaluate_main())
