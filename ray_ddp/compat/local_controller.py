"""The Train controller of a local run (``lean_trainer``), in a module that imports no torch.

The controller is an actor: its process imports this module to unpickle its class, and the
modules of everything it is handed (the run's context, its callbacks). None of them
imports torch (``torch_backend``, ``ray_ddp.reliability.retry_policy``), so the controller
uses about 1.8 CPU-seconds in a run instead of 3.6 and asks for the workers sooner
(``benchmarks/results/startup_controller.md``);
``tests/test_training.py::test_a_local_run_starts_only_the_actors_it_uses`` checks that
the controller's process has not loaded torch.
"""

from __future__ import annotations

import os
from typing import Any

import ray

# The controller's settings.
from ray.train.v2._internal.constants import (
    ENABLE_PREEMPTION_WATCHER_ENV_VAR,
    HEALTH_CHECK_INTERVAL_S_ENV_VAR,
)

# The controller, started here as DataParallelTrainer starts it, and the fixed-size policy
# whose autoscaler requests a local Ray does not need.
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy

LOCAL_POLL_S = 0.5
"""How often the controller of a local run polls its workers (Ray's default: 2 s). It
notices a started or finished group (and collects each report) up to that much later:
measured on 2 cores, a 1-epoch run took 9.5 s instead of 14 s at 0.5 s."""


class LocalFixedScalingPolicy(FixedScalingPolicy):
    """Ray Train's fixed-size policy without its requests to the AutoscalingCoordinator:
    a Ray started by the driver has no autoscaler to read them."""

    def after_controller_start(self, train_run_context: Any) -> None:
        pass

    def _maybe_send_resource_request(self) -> None:
        pass

    def _send_resource_request(self) -> None:
        pass

    def _cancel_resource_request(self) -> None:
        pass


# Ray Train reads these in its controller as the controller is made; set by ray_ddp for
# a local run (below) and so kept out of the environment its workers would inherit.
CONTROLLER_SETTINGS = (HEALTH_CHECK_INTERVAL_S_ENV_VAR, ENABLE_PREEMPTION_WATCHER_ENV_VAR)


def local_controller_settings() -> dict[str, str]:
    """The controller of a local run polls every ``LOCAL_POLL_S`` (a
    ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` of the user's wins) and has no spot-preemption
    watcher (an actor of its own; one machine has no spot instances)."""
    return {
        HEALTH_CHECK_INTERVAL_S_ENV_VAR: os.environ.get(
            HEALTH_CHECK_INTERVAL_S_ENV_VAR, str(LOCAL_POLL_S)
        ),
        ENABLE_PREEMPTION_WATCHER_ENV_VAR: "0",
    }


class LocalTrainController(TrainController):
    """Ray Train's controller, given ``settings`` (:func:`local_controller_settings`) as
    it is made instead of through its runtime environment: from there, and from this
    process's environment, Ray Train would pass them on to the workers' runtime
    environment (see the module's docstring)."""

    def __init__(self, *args: Any, settings: dict[str, str], **kwargs: Any) -> None:
        # What RAY_WARN_BLOCKING_GET_INSIDE_ASYNC=0, which Ray Train sets for its
        # controller, does: no warning for its blocking ray.get calls.
        ray._private.worker.blocking_get_inside_async_warned = True
        os.environ.update(settings)
        super().__init__(*args, **kwargs)
        for key in CONTROLLER_SETTINGS:  # read; set or inherited, they go no further
            os.environ.pop(key, None)
