"""Ray Train's TorchTrainer, trimmed for a Ray that this process started for itself.

Every actor is a process of its own that imports Ray Train before it does anything; on a
2-core machine each is seconds of CPU taken from the start of training (``python
benchmarks/startup.py`` shows every process's CPU). Ray Train 2.60 starts four helper
actors that a local run has no use for, and starts its workers the slow way:

- ``DatasetManager`` (``DatasetsCallback``) serves Ray Data shards. Ray starts it even
  when the trainer has no datasets, which is every run but ``--data-engine ray``: left
  out whenever there are none, on any cluster.
- ``PlacementGroupCleaner`` (``PlacementGroupCleanerCallback``), a detached actor that
  removes the workers' placement group if the Train controller dies without doing so,
  polling Ray's State API (the dashboard) every second. A Ray started here ends with this
  process, placement groups and all: nothing for it to clean.
- ``_AutoscalingCoordinatorActor``: a fixed-size run's scaling policy asks it for the
  workers' resources as the controller starts (waiting up to 5 s for the answer) and
  every 20 s, for a cluster autoscaler to act on. A Ray started here has no autoscaler.
  Elastic runs keep it (their resize decisions read its view of the nodes).
- ``PreemptionWatcher``, an actor polling for spot-instance reclaims: one machine has
  none.
- The workers and the controller: Ray reuses the idle worker processes it keeps (Python
  and Ray already imported; it pre-starts one per CPU) only for actors without a runtime
  environment of their own. Ray Train gives its controller one with every ``RAY_TRAIN_*``
  variable of the driver's that it propagates, and its workers one with every such
  variable in the controller's environment. Here the controller gets the two it is
  configured by (its poll interval, the preemption watcher) as arguments, and removes
  them from its environment once read: the workers get a runtime environment only for
  other variables the user set (usually none).

A cluster outlives the job, and a Tune trial runs in an actor of its own rather than in
the process that started Ray: both get Ray Train as it is. Used only on the Ray releases it
was verified on (``versions``); ``apis.LEAN`` lists every private name below with its
signature there, and ``tests/test_training.py::test_a_local_run_starts_only_the_actors_it_uses``
counts the actors a local fit starts.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import ray
from ray.train.torch import TorchTrainer

# The helper actors a local run leaves out are started by these callbacks (no public API
# chooses Ray Train's default callbacks).
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import (
    PlacementGroupCleanerCallback,
)

# The controller's settings and the variables Ray Train hands on to its controller and workers.
from ray.train.v2._internal.constants import (
    ENABLE_PREEMPTION_WATCHER_ENV_VAR,
    HEALTH_CHECK_INTERVAL_S_ENV_VAR,
    get_env_vars_to_propagate,
)

# The controller, started here as DataParallelTrainer starts it, and the fixed-size policy
# whose autoscaler requests a local Ray does not need.
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy

LOCAL_POLL_S = 0.5
"""How often the controller of a local run polls its workers (Ray's default: 2 s). It
notices a started or finished group (and collects each report) up to that much later:
measured on 2 cores, a 1-epoch run took 9.5 s instead of 14 s at 0.5 s."""


def ray_started_here() -> bool:
    """This process started the Ray it is connected to (``ray.init`` without an address):
    that Ray, its placement groups included, ends when this process does."""
    # Whether ray.init started the Ray this process is connected to: no public API says.
    node = getattr(ray._private.worker, "_global_node", None)
    return bool(getattr(node, "ray_init_cluster", False))


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


class LeanTorchTrainer(TorchTrainer):
    """A TorchTrainer without the DatasetManager when it has no datasets, and for a Ray
    started here, without the PlacementGroupCleaner or autoscaling requests, and with a
    faster-polling controller whose workers reuse Ray's idle processes (see the module's
    docstring)."""

    def _create_default_callbacks(self) -> list[Any]:
        unused: tuple[type, ...] = ()
        if not self.datasets:
            unused += (DatasetsCallback,)
        if ray_started_here():
            unused += (PlacementGroupCleanerCallback,)
        return [cb for cb in super()._create_default_callbacks() if not isinstance(cb, unused)]

    def _initialize_and_run_controller(self, **controller_init_kwargs: Any) -> Any:
        if not ray_started_here():
            return super()._initialize_and_run_controller(**controller_init_kwargs)
        policy = controller_init_kwargs["scaling_policy"]
        if type(policy) is FixedScalingPolicy:
            controller_init_kwargs["scaling_policy"] = LocalFixedScalingPolicy(
                policy.scaling_config
            )
        # As Ray Train 2.60 starts its controller (DataParallelTrainer's method of this
        # name), with LocalTrainController given its settings, and only the other
        # variables Ray Train propagates in its runtime environment.
        env_vars = {
            key: value
            for key, value in get_env_vars_to_propagate().items()
            if key not in CONTROLLER_SETTINGS
        }
        controller_actor_cls = ray.remote(
            num_cpus=0,
            # On the driver's node, as Ray Train puts it: the node-id label key is private.
            label_selector={ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()},
            runtime_env={"env_vars": env_vars},
        )(LocalTrainController)
        controller = controller_actor_cls.remote(
            settings=local_controller_settings(), **controller_init_kwargs
        )
        if threading.current_thread() is threading.main_thread():
            self._register_sigint_handler(controller)
        ray.get(controller.run.remote())
        return ray.get(controller.get_result.remote())
