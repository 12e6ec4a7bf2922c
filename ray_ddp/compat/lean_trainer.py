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
- torch in the controller: Ray's ``TorchConfig`` and the loop's config (it holds the task)
  would make the controller import torch to unpickle them (about 2 CPU-seconds before it
  asks for the workers). The controller gets ``torch_backend.LeanTorchConfig`` instead,
  and the run's context without the loop's config (the workers get that with the train
  function). This part holds on any cluster and in Tune trials too (``local_controller``).

A cluster outlives the job, and a Tune trial runs in an actor of its own rather than in
the process that started Ray: both get Ray Train as it is, but for the first and the last
point. Used only on the Ray releases it was verified on (``versions``); ``apis.LEAN``
lists every private name below with its signature there, and
``tests/test_training.py::test_a_local_run_starts_only_the_actors_it_uses`` counts the
actors a local fit starts and checks that its controller never loads torch.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any

import ray
from ray._common.utils import env_bool
from ray.train.constants import RAY_TRAIN_ENABLE_STATE_TRACKING

if TYPE_CHECKING:  # the class Ray Train v2 runs as ray.train.torch.TorchTrainer (typed as v1)
    from ray.train.v2.torch.torch_trainer import TorchTrainer
else:
    from ray.train.torch import TorchTrainer

# The helper actors a local run leaves out are started by these callbacks (no public API
# chooses Ray Train's default callbacks).
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import (
    PlacementGroupCleanerCallback,
)

# The variables Ray Train hands on to its controller and workers.
from ray.train.v2._internal.constants import get_env_vars_to_propagate

from ray_ddp.compat.local_controller import (
    CONTROLLER_SETTINGS,
    FixedScalingPolicy,
    LocalFixedScalingPolicy,
    LocalTrainController,
    local_controller_settings,
)
from ray_ddp.compat.torch_backend import LeanTorchConfig


def ray_started_here() -> bool:
    """This process started the Ray it is connected to (``ray.init`` without an address):
    that Ray, its placement groups included, ends when this process does."""
    # Whether ray.init started the Ray this process is connected to: no public API says.
    node = getattr(ray._private.worker, "_global_node", None)
    return bool(getattr(node, "ray_init_cluster", False))


def _state_tracking() -> bool:
    """Ray Train's run-state export is on (off unless asked for)."""
    return env_bool(RAY_TRAIN_ENABLE_STATE_TRACKING, False)


class LeanTorchTrainer(TorchTrainer):
    """A TorchTrainer without the DatasetManager when it has no datasets, and for a Ray
    started here, without the PlacementGroupCleaner or autoscaling requests, and with a
    faster-polling controller whose workers reuse Ray's idle processes (see the module's
    docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # What the controller unpickles, free of torch and of the task: the backend's
        # settings (torch_backend), and the run's context without the loop's config (the
        # workers get it with the train function; in the controller only Ray Train's
        # state tracking reads it, so it stays where that is switched on).
        self.backend_config = LeanTorchConfig.of(self.backend_config)
        context = self.train_run_context
        loop_config = context.train_loop_config if _state_tracking() else None
        self.train_run_context = dataclasses.replace(
            context, backend_config=self.backend_config, train_loop_config=loop_config
        )
        object.__setattr__(self.train_run_context, "run_id", context.run_id)

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
            label_selector={
                ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()  # type: ignore[attr-defined]
            },
            runtime_env={"env_vars": env_vars},
        )(LocalTrainController)
        # An actor handle: its methods' .remote() are made at run time, which Ray's types
        # do not follow.
        controller: Any = controller_actor_cls.remote(
            settings=local_controller_settings(), **controller_init_kwargs
        )
        if threading.current_thread() is threading.main_thread():
            self._register_sigint_handler(controller)
        ray.get(controller.run.remote())
        return ray.get(controller.get_result.remote())
