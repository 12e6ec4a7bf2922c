"""What the driver sets for hangs besides the ranks' watchdogs
(``ray_ddp.reliability.hangs.watchdog``): the process group's timeout, and on NCCL the
torch watchdog and flight recorder.

- The process group's timeout (Ray's default 30 minutes) is the backstop for a rank whose
  watchdog cannot run (a process that holds Python's lock forever): 2 x ``--hang-grace`` +
  60 s, later than any watchdog allowance, so the watchdog, with its stacks, speaks first.
- NCCL (GPU workers): the flight recorder keeps the last ``TRACE_ENTRIES`` collectives of
  every rank (``TORCH_NCCL_TRACE_BUFFER_SIZE``; what each rank started and finished, the
  first thing to read in a collective hang), which the hung rank dumps into its hang folder
  (``dump.collect_nccl_trace``); torch's own NCCL watchdog dumps it too when a
  collective passes the timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``) to a node-local file the
  hung rank then collects; and a collective past the timeout fails the rank instead of
  blocking forever (``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, which Ray sets as well).
  A variable the user set in the driver's environment wins.
"""

from __future__ import annotations

import os

from ray_ddp.config.sections import Reliability

DEFAULT_PG_TIMEOUT_S = 1800  # Ray's and gloo's default, kept when the watchdog is off
TRACE_ENTRIES = 2000


def process_group_timeout_s(reliability: Reliability) -> int:
    if reliability.hang_timeout == 0:
        return DEFAULT_PG_TIMEOUT_S
    return int(2 * max(reliability.hang_grace, reliability.hang_timeout or 0) + 60)


def nccl_env(use_gpu: bool | None, name: str | None) -> dict[str, str]:
    """The ``TORCH_NCCL_*`` variables GPU workers (``use_gpu``) of run ``name`` start with
    (none for CPU workers)."""
    if not use_gpu:
        return {}
    wanted = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(TRACE_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"/tmp/ray_ddp_nccl_trace_{name}_rank_",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
    }
    return {key: os.environ.get(key, value) for key, value in wanted.items()}
