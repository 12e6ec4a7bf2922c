"""Sweep learning rate and per-worker batch size with Ray Tune (ASHA early stopping).

python jobs/tune.py --num-samples 8 --epochs 6
python jobs/tune.py --name my-sweep --resume     # continue an interrupted sweep
python jobs/tune.py --help
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ray_ddp.driver.cli import exit_process, tune_main  # noqa: E402

if __name__ == "__main__":
    exit_process(tune_main())
