"""Train a model with distributed data parallelism on Ray.

python jobs/train.py                       # built-in dataset, 2 CPU workers or 1 per GPU
python jobs/train.py --help                # the flags, a line or two each
python jobs/train.py --help-all            # each explained in full (also docs/flags.md)
ray job submit --working-dir . -- python jobs/train.py --storage-path s3://bucket/runs
"""

import os
import sys

# Run from a checkout without installing: the library sits next to jobs/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ray_ddp.driver.cli import exit_process, train_main  # noqa: E402

if __name__ == "__main__":
    exit_process(train_main())
