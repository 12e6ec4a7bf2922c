"""Every private Ray name that ``ray_ddp.compat`` uses, why, and the parameters it has on the
Ray releases it was verified on (``versions.VERIFIED_RAY``). ``tests/test_architecture.py``
resolves each against the installed Ray, so an upgrade that moves or reshapes one fails in
seconds, naming it, instead of silently turning an override into dead code."""

from __future__ import annotations

import hashlib
import importlib
import inspect
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Private:
    module: str
    name: str
    """An attribute path in ``module`` (``Class.method``)."""
    params: tuple[str, ...] | None
    """The parameter names of a callable, in order (None: a value, a class or a module
    attribute that only has to exist)."""
    why: str

    def resolve(self) -> Any:
        """The object, from the installed Ray (an actor class's methods from its class)."""
        obj: Any = importlib.import_module(self.module)
        for part in self.name.split("."):
            obj = getattr(obj, part)
            obj = getattr(obj, "__ray_actor_class__", obj)
        return obj

    def parameters(self) -> tuple[str, ...]:
        return tuple(inspect.signature(self.resolve()).parameters)


_TRAIN = "ray.train.v2._internal"
_FIXED = f"{_TRAIN}.execution.scaling_policy.fixed"
_COORDINATOR = "ray.data._internal.cluster_autoscaler"

LEAN: tuple[Private, ...] = (
    Private(
        f"{_TRAIN}.callbacks.datasets",
        "DatasetsCallback",
        None,
        "left out of a run without datasets (it starts the DatasetManager actor)",
    ),
    Private(
        f"{_TRAIN}.callbacks.placement_group_callback",
        "PlacementGroupCleanerCallback",
        None,
        "left out where this process started Ray (its actor polls the State API)",
    ),
    Private(
        f"{_TRAIN}.constants",
        "HEALTH_CHECK_INTERVAL_S_ENV_VAR",
        None,
        "the controller's poll interval, given to the controller, not its workers",
    ),
    Private(
        f"{_TRAIN}.constants",
        "ENABLE_PREEMPTION_WATCHER_ENV_VAR",
        None,
        "no preemption watcher actor on one machine",
    ),
    Private(
        f"{_TRAIN}.constants",
        "get_env_vars_to_propagate",
        (),
        "the variables Ray Train hands its controller, less the two above",
    ),
    Private(
        f"{_TRAIN}.execution.controller",
        "TrainController.__init__",
        (
            "self",
            "train_fn_ref",
            "train_run_context",
            "scaling_policy",
            "failure_policy",
            "callbacks",
            "validation_config",
        ),
        "subclassed to take its settings as arguments",
    ),
    Private(
        f"{_TRAIN}.execution.controller",
        "TrainController.run",
        ("self",),
        "run as DataParallelTrainer runs it",
    ),
    Private(
        f"{_TRAIN}.execution.controller",
        "TrainController.get_result",
        ("self",),
        "run as DataParallelTrainer runs it",
    ),
    Private(
        _FIXED,
        "FixedScalingPolicy.__init__",
        ("self", "scaling_config"),
        "rebuilt as the local policy from the same scaling config",
    ),
    Private(
        _FIXED,
        "FixedScalingPolicy.after_controller_start",
        ("self", "train_run_context"),
        "overridden: no autoscaler request where Ray was started here",
    ),
    Private(
        _FIXED,
        "FixedScalingPolicy._maybe_send_resource_request",
        ("self",),
        "overridden: no autoscaler request where Ray was started here",
    ),
    Private(
        _FIXED,
        "FixedScalingPolicy._send_resource_request",
        ("self",),
        "overridden: no autoscaler request where Ray was started here",
    ),
    Private(
        _FIXED,
        "FixedScalingPolicy._cancel_resource_request",
        ("self",),
        "overridden: no autoscaler request where Ray was started here",
    ),
    Private(
        "ray.train.torch",
        "TorchTrainer._create_default_callbacks",
        ("self",),
        "overridden to leave the unused helper actors out",
    ),
    Private(
        "ray.train.torch",
        "TorchTrainer._initialize_and_run_controller",
        ("self", "controller_init_kwargs"),
        "overridden (a copy of it, for a Ray started here): see REPEATED",
    ),
    Private(
        "ray.train.torch",
        "TorchTrainer._register_sigint_handler",
        ("self", "controller"),
        "called as the stock method calls it: Ctrl-C aborts the controller",
    ),
    Private(
        "ray._private.worker",
        "_global_node",
        None,
        "whether ray.init in this process started the Ray it is connected to",
    ),
    Private(
        "ray._private.worker",
        "blocking_get_inside_async_warned",
        None,
        "what Ray Train's RAY_WARN_BLOCKING_GET_INSIDE_ASYNC=0 does for its controller",
    ),
    Private(
        "ray._raylet",
        "RAY_NODE_ID_KEY",
        None,
        "the controller on the driver's node, as Ray Train places it",
    ),
    Private("ray.train._internal.utils", "get_address_and_port", (),
            "rank 0's address and a free port for the process group"),
    Private("ray.train.torch.config", "_set_torch_distributed_env_vars", (),
            "run on each worker, as _TorchBackend.on_start runs it"),
    Private("ray.train.torch.config", "_setup_torch_process_group",
            ("backend", "world_rank", "world_size", "init_method", "timeout_s"),
            "run on each worker, as _TorchBackend.on_start runs it"),
    Private("ray.train.torch.config", "_shutdown_torch", ("destroy_process_group",),
            "run on each worker, as _TorchBackend.on_shutdown runs it"),
    Private("ray.train.torch.config", "TorchConfigContextManager", None,
            "what each worker enters around the train function, as under TorchConfig"),
    Private("ray.train.v2._internal.util", "TrainingFramework.TORCH", None,
            "the framework LeanTorchConfig names, as TorchConfig does"),
    Private("ray._common.network_utils", "build_address", ("host", "port"),
            "the tcp:// address of rank 0, as Ray writes it"),
    Private("ray._common.utils", "env_integer", ("key", "default"),
            "the process group's shutdown timeout, read as Ray reads it"),
)  # fmt: skip
"""The lean trainer's (``lean_trainer``, ``local_controller``, ``torch_backend``): used
only on a verified Ray."""

OTHERS: tuple[Private, ...] = (
    Private("ray._private.state", "available_resources_per_node", (),
            "what is free on each node (the public API has cluster totals)"),
    Private("ray._private.state", "state.get_cluster_config", (),
            "the node types a platform publishes (no public record of them)"),
    Private(f"{_COORDINATOR}.base_autoscaling_coordinator", "ResourceRequestPriority.HIGH",
            None, "the driver's request for nodes goes first"),
    Private(f"{_COORDINATOR}.default_autoscaling_coordinator",
            "get_or_create_autoscaling_coordinator", (),
            "the coordinator that owns the autoscaler's standing request"),
    Private(f"{_COORDINATOR}.default_autoscaling_coordinator",
            "_AutoscalingCoordinatorActor.request_resources",
            ("self", "requester_id", "resources", "expire_after_s", "request_remaining",
             "priority", "label_selectors", "subcluster_selector", "strategy"),
            "the driver registers its bundles as one more requester"),
    Private(f"{_COORDINATOR}.default_autoscaling_coordinator",
            "_AutoscalingCoordinatorActor.cancel_request", ("self", "requester_id"),
            "and withdraws them when its wait ends"),
    Private(f"{_TRAIN}.execution.context", "__file__", None,
            "the name of the logger of Ray Train's per-report lines"),
    Private(f"{_TRAIN}.execution.context", "get_train_context", (),
            "a worker's own copy of the reclaim notice (a test holds a rank until it came)"),
    Private(f"{_TRAIN}.execution.storage", "StorageContext.build_checkpoint_path_from_name",
            ("self", "checkpoint_name"),
            "where rank 0's checkpoint is uploaded (on its storage_filesystem), as Ray would"),
    Private("ray._private.ray_constants", "DEBUG_AUTOSCALING_STATUS", None,
            "the key of the autoscaler's status report (tests read its standing request)"),
    Private("ray.experimental.internal_kv", "_internal_kv_get", None,
            "reads that report from the GCS's key-value store"),
)  # fmt: skip
"""The rest (``cluster_state``, ``autoscaler``, ``train_logging``, ``checkpoint_upload``,
``notices``): each falls back where the installed Ray lacks it."""

REPEATED: tuple[Private, ...] = (
    Private("ray.train.v2.api.data_parallel_trainer",
            "DataParallelTrainer._initialize_and_run_controller", None,
            "lean_trainer starts the controller as it does"),
    Private("ray.train.torch.config", "_TorchBackend.on_start", None,
            "torch_backend makes its calls from a controller without torch"),
    Private("ray.train.torch.config", "_TorchBackend.on_shutdown", None,
            "torch_backend makes its calls from a controller without torch"),
)  # fmt: skip
"""The methods of Ray that ``compat`` repeats rather than calls."""

STOCK_SOURCE = {
    "2.60.0": {
        "DataParallelTrainer._initialize_and_run_controller": "ea57ec4498323973",
        "_TorchBackend.on_start": "2d82fd3c05311849",
        "_TorchBackend.on_shutdown": "7dab1784f3fc07e5",
    },
}
"""The first 16 hex digits of the SHA-256 of each ``REPEATED`` method's source on each
verified release, so a release that changes one is read again before it is added to
``VERIFIED_RAY``."""


def stock_source_digests() -> dict[str, str]:
    return {
        p.name: hashlib.sha256(inspect.getsource(p.resolve()).encode()).hexdigest()[:16]
        for p in REPEATED
    }
