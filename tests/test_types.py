"""The type check of the package (no Ray started): mypy, with pyproject.toml's settings
([tool.mypy]: strict on the config and the public API), passes on ray_ddp. Its cache
(.mypy_cache, not committed) makes a re-run take seconds."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mypy_passes_on_the_package():
    # The checkout's own ray_ddp is checked, not an installed copy.
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert done.stdout.splitlines()[-1].startswith("Success: no issues found"), done.stdout
