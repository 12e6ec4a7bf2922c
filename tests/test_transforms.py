"""Augmentation policies (``--augment``): each builds, is seeded per sample, and
``has_random_transform`` is true exactly when the policy draws random numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from formats import write_imagefolder
from PIL import Image

from ray_ddp.config.fields import field_docs, resume_safe_fields
from ray_ddp.config.flags import from_args
from ray_ddp.config.train import AUGMENT_POLICIES, DATASETS, TrainConfig
from ray_ddp.data.loaders import SeededSamples
from ray_ddp.driver.cli import train_main, train_parser
from ray_ddp.driver.rerun_guard import config_changes
from ray_ddp.image_classification.datasets import build_datasets
from ray_ddp.image_classification.transforms import (
    DEFAULT_AUGMENT,
    GENERIC_STATS,
    MNIST_STATS,
    augment_policy,
    augmentation,
    has_random_transform,
    image_transform,
)


def _image(mode: str, size: int) -> Image.Image:
    """A structured image (a ramp and a bright corner), so shifts and flips show."""
    rng = np.random.default_rng(size)
    pixels = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    pixels[: size // 3, : size // 3] = 255
    return Image.fromarray(pixels).convert(mode)


def _cfg(policy: str, dataset: str = "imagefolder", **kwargs) -> TrainConfig:
    return TrainConfig(dataset=dataset, data_dir="unused", augment=policy, **kwargs)


# Grey 28-pixel images as MNIST has (no resize: the crop must keep their own size), RGB
# files resized to 32 as ImageFolder does, grey files repeated to RGB for torchvision models.
SHAPES = [
    pytest.param("mnist", "small_cnn", "L", 28, (1, 28, 28), id="mnist-grey"),
    pytest.param("imagefolder", "small_cnn", "RGB", 20, (3, 32, 32), id="imagefolder-rgb"),
    pytest.param("mnist", "resnet18", "L", 28, (3, 28, 28), id="mnist-as-rgb"),
]


@pytest.mark.parametrize("policy", AUGMENT_POLICIES)
@pytest.mark.parametrize(("dataset", "model", "mode", "size", "shape"), SHAPES)
def test_every_policy_builds_keeps_the_shape_and_is_deterministic_per_seed(
    policy, dataset, model, mode, size, shape
):
    stats = MNIST_STATS if dataset == "mnist" else GENERIC_STATS
    cfg = _cfg(policy, dataset, model=model)
    train = image_transform(cfg.data, cfg.target, stats, train=True)
    image = _image(mode, size)
    outputs = []
    for seed in range(8):
        torch.manual_seed(seed)
        first = train(image)
        torch.manual_seed(seed)
        assert torch.equal(first, train(image)), "same torch seed, same augmented sample"
        assert first.shape == shape
        outputs.append(first)
    distinct = {o.numpy().tobytes() for o in outputs}
    if policy == "none":
        evaluation = image_transform(cfg.data, cfg.target, stats, train=False)
        assert len(distinct) == 1 and torch.equal(outputs[0], evaluation(image))
    else:
        assert len(distinct) > 1, "another seed, another augmentation"


@pytest.mark.parametrize("policy", AUGMENT_POLICIES)
def test_has_random_transform_is_true_exactly_when_the_policy_draws_from_torch(policy):
    """What ``loaders.SeededSamples`` relies on: a policy that draws random numbers draws
    them from torch's global RNG (the one it seeds per sample), and only such a policy
    makes ``has_random_transform`` true."""
    cfg = _cfg(policy)
    train = image_transform(cfg.data, cfg.target, train=True)
    image = _image("RGB", 20)
    for seed in range(5):
        torch.manual_seed(seed)
        before = torch.get_rng_state()
        train(image)
        assert (not torch.equal(before, torch.get_rng_state())) == has_random_transform(cfg.data)
    assert (augmentation(policy) == []) == (policy == "none")


def test_no_random_transform_without_images():
    for cfg in (TrainConfig(), _cfg(None, "parquet", feature_column="features")):
        assert augment_policy(cfg.data) == "none" and not has_random_transform(cfg.data)


def test_each_dataset_default_and_the_help_text_that_states_it():
    expected = {
        "synthetic": "none",
        "cifar10": "crop-flip",
        "mnist": "none",
        "fashion-mnist": "none",
        "imagefolder": "crop-flip",
        "parquet": "none",
    }
    assert {d: augment_policy(_cfg(None, d).data) for d in DATASETS} == expected
    assert {d: has_random_transform(_cfg(None, d).data) for d in DATASETS} == {
        d: p != "none" for d, p in expected.items()
    }
    # An explicit choice wins over the default, both ways.
    assert augment_policy(_cfg("none", "cifar10").data) == "none"
    assert augment_policy(_cfg("crop", "mnist").data) == "crop"
    # --help says the same as DEFAULT_AUGMENT.
    doc = " ".join(field_docs(TrainConfig)["augment"].split())
    flipped = sorted(d for d in DEFAULT_AUGMENT if DEFAULT_AUGMENT[d] == "crop-flip")
    assert f"Auto: crop-flip for {' and '.join(flipped)}, none for" in doc
    for dataset in set(DATASETS) - set(DEFAULT_AUGMENT) - {"synthetic"}:
        assert dataset in doc.split("none for")[1].split(".")[0]
    assert "--augment" in train_parser().format_help()


def test_augment_parses_and_is_not_resume_safe():
    for policy in AUGMENT_POLICIES:
        cfg = from_args(TrainConfig, train_parser().parse_args(["--augment", policy]))
        assert cfg.data.augment == policy
    assert from_args(TrainConfig, train_parser().parse_args([])).data.augment is None
    # It changes what is trained: a re-run of a named run may not change it.
    assert "augment" not in resume_safe_fields(TrainConfig)
    assert config_changes({"augment": "crop-flip"}, {"augment": "none"}) == [
        "--augment crop-flip -> none"
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--augment", "flip"], "unknown --augment 'flip'; choose one of: none, crop, crop-flip"),
        (["--augment", "crop"], "--augment crop needs images; the built-in dataset takes"),
        (
            ["--dataset", "parquet", "--data-dir", ".", "--feature-column", "f"]
            + ["--augment", "crop-flip", "--model", "mlp"],
            "a --feature-column takes --augment none",
        ),
    ],
)
def test_a_bad_augment_exits_2_with_one_line(argv, message, tmp_path, capsys):
    code = train_main([*argv, "--storage-path", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and message in err, err
    assert "\n" not in err
    assert not (tmp_path / "runs").exists()


def test_the_real_reader_with_the_real_seeded_sampler(tmp_path):
    """ImageFolder files through ``build_datasets`` and ``loaders.SeededSamples``: a
    sample is the same for the same (seed, epoch, index), another in another epoch; with
    ``--augment none`` the training split is exactly the evaluation transform's."""
    write_imagefolder(str(tmp_path))
    cfg = TrainConfig(dataset="imagefolder", data_dir=str(tmp_path), augment="trivialaugment")
    train, _, _ = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
    seeded = SeededSamples(train, seed=7)
    assert torch.equal(seeded[(2, 5)][0], seeded[(2, 5)][0])
    assert not all(torch.equal(seeded[(2, i)][0], seeded[(3, i)][0]) for i in range(6))
    plain_cfg = TrainConfig(dataset="imagefolder", data_dir=str(tmp_path))
    plain, _, _ = build_datasets(plain_cfg.data, plain_cfg.target, plain_cfg.optim.seed, False)
    none_cfg = TrainConfig(dataset="imagefolder", data_dir=str(tmp_path), augment="none")
    none, _, _ = build_datasets(none_cfg.data, none_cfg.target, none_cfg.optim.seed)
    assert all(torch.equal(none[i][0], plain[i][0]) for i in range(len(plain)))
