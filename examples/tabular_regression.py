"""Tabular regression from Parquet feature columns as a ray_ddp task.

    python examples/make_tabular_data.py data/friedman
    python jobs/train.py --task examples.tabular_regression:TabularRegression \\
        --data-dir data/friedman --num-workers 2 --epochs 10 --batch-size 64

Data: ``<data_dir>/train.parquet`` and ``<data_dir>/val.parquet``, or folders
``<data_dir>/train/`` and ``<data_dir>/val/`` of Parquet shards (read in sorted file order).
One column per feature, numeric (float, int or bool, cast to float32), and one numeric
target column; other columns are ignored when ``feature_columns`` names the features, and
refused when it is left at None (every column except the target). No missing values.
``--train-samples``/``--val-samples`` keep the first N rows of a split.

Standardisation: ``describe`` (once, on the driver) reads the training split's feature and
target columns in one streaming pass and records their means and standard deviations in
the run's facts, which every checkpoint keeps. The model holds them as buffers: it takes
raw feature values and predicts in the target's own units, so ``ray_ddp.load_model`` and
the exported program need no preprocessing. Inside, the MLP sees standardised features and
predicts the standardised target.

Metrics (validation, exact over all ranks):
    loss  MSE of the *standardised* target, (prediction - target)^2 / std_train(target)^2,
          the same quantity as the training loss (both are drawn on one axis); predicting
          the training mean scores about 1.0, so ``1 - loss`` reads like an R^2
    mse   MSE in the target's units;  rmse = sqrt(mse)
    mae   mean absolute error in the target's units; ranks checkpoints and Tune trials

Your own columns: give the task settings and name the instance,
``TAXI = TabularRegression(target_column="fare", feature_columns=["miles", "minutes"])``
in your module, then ``--task your_module:TAXI``. The columns, the statistics and the
hidden sizes all go into the facts, so evaluation and export rebuild the same model from
a checkpoint alone.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from ray_ddp import ConfigError, Sum, Task

SPLITS = ("train", "val")
READ_BATCH_ROWS = 65536


# ---------------------------------------------------------------------- the data
def split_files(data_dir: str | None, split: str) -> list[str]:
    """The Parquet files of ``split``: ``<split>.parquet``, or the files under the folder
    ``<split>/`` in sorted order (so every rank reads the rows in the same order)."""
    if not data_dir:
        raise ConfigError(
            "--data-dir is required: a folder with train.parquet and val.parquet (write one "
            "with: python examples/make_tabular_data.py DIR)"
        )
    file, folder = os.path.join(data_dir, f"{split}.parquet"), os.path.join(data_dir, split)
    if os.path.isfile(file) and os.path.isdir(folder):
        raise ConfigError(f"both {file} and {folder}/ exist: keep one of them")
    if os.path.isfile(file):
        return [file]
    if os.path.isdir(folder):
        import pyarrow.dataset as ds

        files = sorted(ds.dataset(folder, format="parquet").files)
        if not files:
            raise ConfigError(f"{folder}/ holds no Parquet files")
        return files
    raise ConfigError(f"no {split} split: neither {file} nor a folder {folder}/ exists")


def _is_numeric(kind: pa.DataType) -> bool:
    return pa.types.is_floating(kind) or pa.types.is_integer(kind) or pa.types.is_boolean(kind)


def resolve_columns(
    files: list[str], target: str, features: Sequence[str] | None
) -> tuple[list[str], str]:
    """(feature columns, target column), checked against every file's schema (footers
    only, no data read)."""
    schema = pq.read_schema(files[0])
    if features is None:
        features = [name for name in schema.names if name != target]
    features = list(features)
    if not features:
        raise ConfigError(f"{files[0]}: no feature columns besides the target {target!r}")
    if target in features or len(set(features)) != len(features):
        raise ConfigError(f"feature columns {features} repeat a name or include the target")
    for path in files:
        schema = pq.read_schema(path) if path != files[0] else schema
        for name in [*features, target]:
            if name not in schema.names:
                shown = ", ".join(schema.names[:12]) + (", ..." if len(schema.names) > 12 else "")
                raise ConfigError(f"{path}: no column {name!r} (it has: {shown})")
            kind = schema.field(name).type
            if not _is_numeric(kind):
                raise ConfigError(
                    f"{path}: column {name!r} is {kind}, not a number: encode it as numbers, "
                    "or name the feature columns (feature_columns=[...])"
                )
    return features, target


def iter_matrices(files: list[str], columns: list[str], limit: int | None):
    """The rows of ``columns`` (float64 blocks of at most READ_BATCH_ROWS rows), in file
    order, stopping after ``limit`` rows; missing values come out as NaN."""
    left = limit
    for path in files:
        for batch in pq.ParquetFile(path).iter_batches(READ_BATCH_ROWS, columns=columns):
            if left is not None:
                if left <= 0:
                    return
                batch = batch.slice(0, left)
                left -= batch.num_rows
            yield np.column_stack(
                [
                    batch.column(name).to_numpy(zero_copy_only=False).astype(np.float64)
                    for name in columns
                ]
            )


def _check_finite(block: np.ndarray, columns: list[str], where: str) -> None:
    bad = ~np.isfinite(block)
    if bad.any():
        name = columns[int(np.argmax(bad.sum(axis=0)))]
        raise ConfigError(
            f"{where}: column {name!r} has missing or non-finite values: fill or drop those "
            "rows first"
        )


def column_stats(
    files: list[str], columns: list[str], limit: int | None
) -> tuple[int, np.ndarray, np.ndarray]:
    """(rows, mean, population std) of each column, in one streaming pass (Chan et al.'s
    pairwise update, float64), without holding the split in memory."""
    rows, mean, m2 = 0, np.zeros(len(columns)), np.zeros(len(columns))
    for block in iter_matrices(files, columns, limit):
        _check_finite(block, columns, "the train split")
        n = block.shape[0]
        if n == 0:
            continue
        block_mean = block.mean(axis=0)
        block_m2 = ((block - block_mean) ** 2).sum(axis=0)
        total = rows + n
        delta = block_mean - mean
        mean = mean + delta * (n / total)
        m2 = m2 + block_m2 + delta**2 * (rows * n / total)
        rows = total
    std = np.sqrt(m2 / max(rows, 1))
    return rows, mean, std


def read_split(
    files: list[str], features: list[str], target: str, limit: int | None, split: str
) -> TensorDataset:
    """A split as (features float32 [n, d], target float32 [n]) tensors."""
    columns = [*features, target]
    blocks = list(iter_matrices(files, columns, limit))
    table = np.concatenate(blocks) if blocks else np.zeros((0, len(columns)))
    _check_finite(table, columns, f"the {split} split")
    table = torch.from_numpy(table.astype(np.float32))
    return TensorDataset(table[:, :-1].contiguous(), table[:, -1].contiguous())


# ---------------------------------------------------------------------- the model
class TabularMLP(nn.Module):
    """Raw features (batch, d) -> prediction (batch,) in the target's units. Standardises
    its input and de-standardises its output with the training split's statistics, held
    as buffers (saved with the weights). No dropout, no batch norm: a sample's output
    depends on that sample alone, so gradient accumulation is exact."""

    def __init__(
        self,
        hidden_sizes: Sequence[int],
        feature_mean: Sequence[float],
        feature_std: Sequence[float],
        target_mean: float,
        target_std: float,
    ) -> None:
        super().__init__()
        self.register_buffer("feature_mean", torch.tensor(feature_mean, dtype=torch.float32))
        self.register_buffer("feature_std", torch.tensor(feature_std, dtype=torch.float32))
        self.register_buffer("target_mean", torch.tensor(target_mean, dtype=torch.float32))
        self.register_buffer("target_std", torch.tensor(target_std, dtype=torch.float32))
        layers: list[nn.Module] = []
        width = len(feature_mean)
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.SiLU()]
            width = hidden
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        z = self.net((features - self.feature_mean) / self.feature_std).squeeze(-1)
        # The affine back to the target's units in float32, also under autocast.
        return z.float() * self.target_std + self.target_mean


def unwrap(model: nn.Module) -> nn.Module:
    """The TabularMLP inside DDP (``.module``) or torch.compile (``._orig_mod``)."""
    while not isinstance(model, TabularMLP):
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            raise TypeError(f"{type(model).__name__} wraps no TabularMLP")
        model = inner
    return model


# ---------------------------------------------------------------------- the task
class TabularRegression(Task):
    """An MLP regressor on Parquet feature columns; see the module's docstring."""

    best_metric = "mae"
    best_mode = "min"

    def __init__(
        self,
        target_column: str = "target",
        feature_columns: Sequence[str] | None = None,
        hidden_sizes: Sequence[int] = (128, 128),
    ) -> None:
        self.target_column = target_column
        self.feature_columns = None if feature_columns is None else list(feature_columns)
        self.hidden_sizes = list(hidden_sizes)

    def name(self, cfg: Any) -> str:
        return "tabular"

    def describe(self, cfg: Any) -> dict[str, Any]:
        """Columns (checked in every file's footer, both splits), the training split's
        statistics (one pass over its feature and target columns) and the MLP's widths."""
        files = {split: split_files(cfg.data.data_dir, split) for split in SPLITS}
        features, target = resolve_columns(files["train"], self.target_column, self.feature_columns)
        resolve_columns(files["val"], target, features)
        rows, mean, std = column_stats(files["train"], [*features, target], cfg.data.train_samples)
        if rows < 2:
            raise ConfigError(f"the train split has {rows} rows: too few to standardise")
        std = np.where(std > 0, std, 1.0)  # a constant column stays as it is, centred
        return {
            "features": features,
            "target": target,
            "train_rows": rows,
            "feature_mean": [float(v) for v in mean[:-1]],
            "feature_std": [float(v) for v in std[:-1]],
            "target_mean": float(mean[-1]),
            "target_std": float(std[-1]),
            "hidden_sizes": self.hidden_sizes,
        }

    def datasets(self, cfg: Any, facts: dict[str, Any]) -> tuple[Dataset, Dataset]:
        # Columns from the facts, not from self: evaluation rebuilds the task by class.
        features, target = facts["features"], facts["target"]
        limits = {"train": cfg.data.train_samples, "val": cfg.data.val_samples}
        train, val = (
            read_split(
                split_files(cfg.data.data_dir, split), features, target, limits[split], split
            )
            for split in SPLITS
        )
        return train, val

    def model(self, cfg: Any, facts: dict[str, Any]) -> nn.Module:
        return TabularMLP(
            facts["hidden_sizes"],
            facts["feature_mean"],
            facts["feature_std"],
            facts["target_mean"],
            facts["target_std"],
        )

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        features, target = batch
        error = (model(features).float() - target.float()) / unwrap(model).target_std
        return error.pow(2).mean()

    def metrics(self, model: nn.Module, batch: Any) -> dict[str, Sum]:
        features, target = batch
        error = model(features).float() - target.float()
        count = error.numel()
        scaled = error / unwrap(model).target_std
        return {
            "loss": Sum(scaled.pow(2).sum(), count),
            "mse": Sum(error.pow(2).sum(), count),
            "mae": Sum(error.abs().sum(), count),
        }

    def summarize(self, values: dict[str, float]) -> dict[str, float]:
        return {**values, "rmse": math.sqrt(max(values["mse"], 0.0))}

    def predictions(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        features, target = batch
        prediction = model(features).float()
        return {"prediction": prediction, "target": target, "error": prediction - target}

    def random_samples(self, cfg: Any) -> bool:
        return False  # rows as they are, no augmentation

    def example_inputs(self, cfg: Any, facts: dict[str, Any]) -> tuple:
        return (torch.zeros(2, len(facts["features"])),)
