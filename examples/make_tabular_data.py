"""Write a tabular regression data set as Parquet: Friedman's benchmark #1, with known noise.

    python examples/make_tabular_data.py data/friedman            # 20000 train, 4000 val rows
    python examples/make_tabular_data.py data/friedman --shards 4 # train/ and val/ as folders

The table (J. H. Friedman, "Multivariate adaptive regression splines", Annals of Statistics
19(1), 1991; also scikit-learn's ``make_friedman1``): ten features ``x0``..``x9`` drawn
independently and uniformly from [0, 1), and a target

    target = 10 sin(pi x0 x1) + 20 (x2 - 0.5)^2 + 10 x3 + 5 x4 + noise,  noise ~ N(0, sigma^2)

``x5``..``x9`` do not enter the formula (a model has to learn to ignore them). Because the
noise is independent of the features, no model can do better on average than the formula
itself: the **Bayes-optimal** validation MSE is ``sigma^2`` and the optimal MAE is
``sigma * sqrt(2 / pi)`` (0.798 for sigma = 1), while predicting the mean scores the
target's variance (about 24 + sigma^2). These are the figures a trained model is held to.

The rows are a function of ``(seed, split)`` (numpy's PCG64 generator): the same command
writes the same table again. On a cluster, write it once to storage every node reads.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FEATURES = 10
TARGET = "target"


def friedman1(rows: int, noise: float, seed: int) -> dict[str, np.ndarray]:
    """``rows`` samples of Friedman #1: columns ``x0``..``x9`` and ``target`` (float32)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    x = rng.uniform(0.0, 1.0, size=(rows, FEATURES))
    clean = (
        10 * np.sin(np.pi * x[:, 0] * x[:, 1])
        + 20 * (x[:, 2] - 0.5) ** 2
        + 10 * x[:, 3]
        + 5 * x[:, 4]
    )
    target = clean + noise * rng.standard_normal(rows)
    columns = {f"x{j}": x[:, j].astype(np.float32) for j in range(FEATURES)}
    columns[TARGET] = target.astype(np.float32)
    return columns


def bayes_floor(noise: float) -> dict[str, float]:
    """The best validation MSE and MAE any model can reach on this data (in expectation)."""
    return {"mse": noise**2, "mae": noise * math.sqrt(2 / math.pi)}


def write_friedman(
    out_dir: str,
    train_rows: int = 20000,
    val_rows: int = 4000,
    noise: float = 1.0,
    seed: int = 0,
    shards: int = 1,
) -> dict[str, str]:
    """Write ``train`` and ``val`` under ``out_dir``: ``<split>.parquet``, or with
    ``shards`` > 1 a folder ``<split>/`` of that many files (``part-00000.parquet``, ...).
    The splits come from different seeds (independent rows). Returns split -> path."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for offset, (split, rows) in enumerate((("train", train_rows), ("val", val_rows))):
        table = pa.table(friedman1(rows, noise, seed * 2 + offset))
        if shards <= 1:
            path = os.path.join(out_dir, f"{split}.parquet")
            pq.write_table(table, path)
        else:
            path = os.path.join(out_dir, split)
            os.makedirs(path, exist_ok=True)
            bounds = np.linspace(0, rows, shards + 1).round().astype(int)
            for i, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
                part = table.slice(int(start), int(stop - start))
                pq.write_table(part, os.path.join(path, f"part-{i:05d}.parquet"))
        paths[split] = path
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("out_dir", help="where train(.parquet) and val(.parquet) go")
    parser.add_argument("--train-rows", type=int, default=20000)
    parser.add_argument("--val-rows", type=int, default=4000)
    parser.add_argument("--noise", type=float, default=1.0, help="sigma of the Gaussian noise")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1, help="files per split (>1: a folder)")
    args = parser.parse_args(argv)
    paths = write_friedman(
        args.out_dir, args.train_rows, args.val_rows, args.noise, args.seed, args.shards
    )
    floor = bayes_floor(args.noise)
    for split, path in paths.items():
        print(f"{split}: {path}")
    print(
        f"features x0..x{FEATURES - 1}, target {TARGET!r}; Bayes-optimal val MSE "
        f"{floor['mse']:.4f}, MAE {floor['mae']:.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
