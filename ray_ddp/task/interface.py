"""The task interface: the model, the data, the loss and the metrics of a training run.

Everything else (Ray, DDP, AMP, accumulation with ``no_sync``, exact sharded evaluation,
exact resume, checkpoints, sweeps, evaluation and export) is ray_ddp's and works the same
for every task. The built-in image classification (``ray_ddp.image_classification.task``) is
one implementation; your own is another::

    import torch.nn.functional as F
    from ray_ddp import Sum, Task

    class MyTask(Task):
        best_metric, best_mode = "loss", "min"

        def datasets(self, cfg, facts):
            return MyTrainSet(cfg.data.data_dir), MyValSet(cfg.data.data_dir)

        def model(self, cfg, facts):
            return MyNet()

        def loss(self, model, batch):
            inputs, targets = batch
            return F.mse_loss(model(inputs).float(), targets)     # mean over the batch

        def metrics(self, model, batch):
            inputs, targets = batch
            error = model(inputs).float() - targets
            return {"loss": Sum((error**2).sum(), error.numel()),
                    "mae": Sum(error.abs().sum(), error.numel())}

and ``python jobs/train.py --task my_package.my_module:MyTask`` (or ``ray_ddp.fit``).

Why a base class and not a Protocol or loose callables: the optional parts have defaults
that a subclass inherits (collate, optimizer groups, driver-side checks), the required ones
are ``abstractmethod``s that can be checked by name before Ray starts, and the signatures
live in one place that an editor can complete and a type checker can check.

The contract, which is what makes ray_ddp's guarantees hold for any task:

- ``loss`` is the **mean** over the batch's samples (each sample weighs the same). ray_ddp
  weighs micro-batches by their sample count, so k accumulated micro-batches make the
  same step as one batch k times larger, and a short last batch counts by its size.
- ``metrics`` returns **sums and counts**, never means: ray_ddp adds them over every
  batch and every rank (each validation sample on exactly one rank) and divides once, so
  the result equals a single-process evaluation. Anything that is a ratio of two sums fits
  (accuracy, mean loss, MAE, per-token NLL); ``summarize`` derives the rest (perplexity is
  exp of the mean NLL).
- ``model`` and ``datasets`` are called in every worker process; ``model`` must build the
  same architecture from ``cfg`` and ``facts`` alone (ray_ddp seeds the initial weights
  identically on every rank first), because evaluation and export rebuild it from a
  checkpoint, where no dataset is loaded.
- ``facts`` (from ``describe``, computed once on the driver) are plain JSON values the
  model's shape depends on (class count, vocabulary, feature count). They are saved in
  every checkpoint, and a resume is refused if they changed.
- Samples may draw torch random numbers (augmentation): ray_ddp seeds each one from (seed,
  epoch, index), so a resumed run sees the same augmentation as an uninterrupted one.

The task object is pickled to every worker, so keep its own state small (settings, not
data); its module must be importable on every node (see docs/tasks.md, "A task on a cluster").
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from ray_ddp.task.batches import Batch, first_tensor

if TYPE_CHECKING:
    from ray_ddp.config import TrainConfig


class Sum(NamedTuple):
    """One metric's contribution from a batch: ``total`` / ``count`` is its value."""

    total: torch.Tensor | float
    """Sum over the batch (e.g. correct predictions, summed absolute error)."""
    count: torch.Tensor | float  # type: ignore[assignment]  # shadows tuple.count: the API's name
    """What the sum is over (samples, tokens, ...)."""


class Task(abc.ABC):
    """Subclass it, implement the four abstract methods, override any optional one."""

    best_metric: ClassVar[str] = "loss"
    """The validation metric (a key of ``metrics`` or ``summarize``) that ranks checkpoints
    and Tune trials; reported as ``val_<best_metric>``."""
    best_mode: ClassVar[str] = "min"
    """``min`` (a loss, an error) or ``max`` (an accuracy)."""

    # ------------------------------------------------------------------ required
    @abc.abstractmethod
    def datasets(
        self, cfg: TrainConfig, facts: dict[str, Any]
    ) -> tuple[Dataset[Any], Dataset[Any]]:
        """The train and validation splits: map-style datasets (``__getitem__`` and
        ``__len__``) whose samples ``collate`` can batch. Called in every worker.

        With ``--download`` it is first called with ``cfg.data.download`` True to fetch the data
        into ``cfg.data.data_dir``: by rank 0 alone, then by the first worker of every other
        node (the rest wait). Skip what is already there: nodes sharing ``data_dir`` find
        the files complete on their turn."""

    @abc.abstractmethod
    def model(self, cfg: TrainConfig, facts: dict[str, Any]) -> nn.Module:
        """A freshly initialised model, built from ``cfg`` and ``facts`` alone."""

    @abc.abstractmethod
    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor | Sum:
        """The training loss of ``batch``: a scalar, the mean over its samples; or a
        ``Sum(total, count)`` where samples weigh unequally (a language model's tokens over
        sequences of different lengths): the step's gradient is then that of every rank's
        totals over every rank's counts, exact however micro-batches and ranks split the
        step, and the epoch's ``train_loss`` is the mean per count. Runs under autocast
        with ``--amp``: compute the loss itself in float32 (``logits.float()``)."""

    @abc.abstractmethod
    def metrics(self, model: nn.Module, batch: Batch) -> dict[str, Sum]:
        """Validation sums of ``batch`` (in eval mode, without gradients): name -> Sum.
        Every batch returns the same names; ``loss`` is expected among them."""

    # ------------------------------------------------------------------ optional
    def name(self, cfg: TrainConfig) -> str:
        """A short name for the data line and automatic run names."""
        return type(self).__name__.lower()

    def describe(self, cfg: TrainConfig) -> dict[str, Any]:
        """Facts about the data that the model's shape depends on, as plain JSON values.
        Runs once, on the driver, before Ray starts: keep it cheap; raise
        ``ray_ddp.ConfigError`` with one line for data that cannot work."""
        return {}

    def summarize(self, values: dict[str, float]) -> dict[str, float]:
        """Derived metrics from the exact means (``total / count`` per name), e.g.
        perplexity = exp(loss). Returns the metrics to report (default: as they are)."""
        return values

    def collate(self, samples: list[Any]) -> Batch:
        """A list of samples -> one batch (default: torch's ``default_collate``)."""
        return default_collate(samples)

    def batch_size(self, batch: Batch) -> int:
        """The number of samples in ``batch`` (default: the first tensor's first
        dimension), by which evaluation counts its samples. (Training weighs each
        micro-batch by the dataset samples the data order put in it.)"""
        tensor = first_tensor(batch)
        if tensor is None or tensor.dim() == 0:
            raise TypeError(
                f"{type(self).__name__}.batch_size: a batch of {type(batch).__name__} holds no "
                "tensor with a batch dimension; override batch_size()"
            )
        return int(tensor.shape[0])

    def param_groups(self, model: nn.Module, cfg: TrainConfig) -> Iterable[Any]:
        """What the optimizer updates: parameters, or param-group dicts that may set their
        own ``weight_decay`` or ``lr_scale`` (a factor on the schedule's lr), e.g. no decay
        on biases and norms. Default: every parameter, with ``--weight-decay``."""
        return model.parameters()

    def fsdp_blocks(self, model: nn.Module) -> list[nn.Module] | None:
        """With ``--strategy fsdp2``: the submodules sharded each on its own before the
        whole model (a transformer's layers): each one's parameters are gathered only
        while it computes, so the fewer parameters a block holds, the less memory beyond
        the shards. None (the default): every item holding parameters of the model's
        outermost ``ModuleList``/``Sequential`` containers, else its children that hold
        parameters."""
        return None

    def random_samples(self, cfg: TrainConfig) -> bool:
        """Whether fetching a training sample draws torch random numbers (augmentation).
        If so (the default), each sample's draw is seeded from (seed, epoch, index) for an
        exact resume; return False to skip that small per-sample cost."""
        return True

    def example_inputs(self, cfg: TrainConfig, facts: dict[str, Any]) -> tuple[Any, ...] | None:
        """Inputs of a forward call (batch of 2) for ``torch.export`` of the best model at
        the end; None (the default) exports the weights only."""
        return None

    def evaluation_metrics(self, model: nn.Module, batch: Batch) -> dict[str, Sum]:
        """The metrics of a full evaluation (``jobs/evaluate.py``): default, the same as
        every epoch's. Add breakdowns here (per class: ``acc/cat``)."""
        return self.metrics(model, batch)

    def predictions(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor] | None:
        """Per-sample columns for ``jobs/evaluate.py --predictions`` (each tensor's first
        dimension is the batch); None (the default) means the task has none."""
        return None

    def final_report(self, model: nn.Module, cfg: TrainConfig) -> str | None:
        """Text to print at the end of a run, made with the best checkpoint's model (on the
        driver, CPU, eval mode): samples from a language model, a few predictions. None
        (the default) prints nothing."""
        return None

    def check(self, cfg: TrainConfig, facts: dict[str, Any]) -> tuple[int | None, int | None]:
        """Driver-side checks before Ray starts; returns (train, val) sample counts (None:
        not known on the driver, whose checks that need them are then skipped).
        The default builds the datasets, batches two training samples and runs ``loss``
        and ``metrics`` on them with the model's weights on the meta device (shapes only,
        no memory), so a broken task fails here in one line, not in every worker."""
        from ray_ddp.task.checks import dry_run

        return dry_run(self, cfg, facts)
