"""Each real format is read by the real loading code from files in its on-disk format."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
from formats import write_cifar10, write_imagefolder, write_mnist, write_parquet
from PIL import Image

from ray_ddp.config import ConfigError, TrainConfig
from ray_ddp.config.sections import Data, Target
from ray_ddp.image_classification.datasets import build_datasets, describe_dataset
from ray_ddp.image_classification.synthetic import make_synthetic


def test_builtin_dataset_is_deterministic_and_balanced():
    a_train, a_val = make_synthetic(3, 500, 101)
    b_train, b_val = make_synthetic(3, 500, 101)
    (a_images, a_labels), (b_images, b_labels) = (
        a_train.batch(range(500)),
        b_train.batch(range(500)),
    )
    assert torch.equal(a_images, b_images) and torch.equal(a_labels, b_labels)
    assert torch.equal(a_val.batch(range(101))[1], b_val.batch(range(101))[1])
    assert len(a_train) == 500 and len(a_val) == 101
    other, _ = make_synthetic(4, 500, 101)
    assert not torch.equal(a_images, other.batch(range(500))[0])
    # The validation split does not depend on how many train samples were asked for.
    _, c_val = make_synthetic(3, 900, 101)
    assert torch.equal(a_val.batch(range(101))[0], c_val.batch(range(101))[0])
    counts = torch.bincount(a_labels, minlength=10)
    assert counts.min() > 20  # every class present


def test_a_builtin_sample_is_made_from_its_index_alone_at_any_split_size():
    """Sample i is the same read alone, in any micro-batch, in a split of any size (a
    billion costs no memory); past the split's end is an IndexError, as a list's."""
    small, _ = make_synthetic(5, 64, 8)
    huge, _ = make_synthetic(5, 10**9, 8)
    image, label = small[37]
    together = huge.batch([10**9 - 1, 37, 2])
    assert torch.equal(together[0][1], image) and together[1][1] == label
    assert torch.equal(
        torch.stack([s[0] for s in small.__getitems__([2, 37])]), together[0][[2, 1]]
    )
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32
    with pytest.raises(IndexError):
        small[64]
    # A small split is kept whole once read (made in chunks: across their edges too), and
    # holds the samples made on read; a copy sent elsewhere makes its own.
    mid, _ = make_synthetic(5, 2100, 8)
    edges = [0, 1023, 1024, 2047, 2048, 2099]
    assert torch.equal(mid.batch(edges)[0], huge.batch(edges)[0])
    assert torch.equal(mid.batch(edges)[1], huge.batch(edges)[1])
    assert small.whole is not None and mid.whole is not None and huge.whole is None
    assert pickle.loads(pickle.dumps(mid)).whole is None


def test_cifar10_batch_files(tmp_path):
    batches = write_cifar10(str(tmp_path), per_batch=6, test=5)
    cfg = TrainConfig(dataset="cifar10", data_dir=str(tmp_path))
    train, val, info = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
    assert (len(train), len(val)) == (30, 5)
    assert info.num_classes == 10 and info.input_shape == (3, 32, 32)
    data, labels = batches["test_batch"]
    image, label = val[2]
    assert label == labels[2]
    expected = torch.tensor(data[2].reshape(3, 32, 32), dtype=torch.float32) / 255
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)
    assert torch.allclose(image, (expected - mean) / std, atol=1e-5)
    assert train[0][0].shape == (3, 32, 32)  # augmented (crop + flip), same shape


@pytest.mark.parametrize(
    ("dataset", "folder"), [("mnist", "MNIST"), ("fashion-mnist", "FashionMNIST")]
)
def test_mnist_idx_folders(tmp_path, dataset, folder):
    written = write_mnist(str(tmp_path), folder=folder, train=12, test=7)
    cfg = TrainConfig(dataset=dataset, data_dir=str(tmp_path))
    train, val, info = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
    assert (len(train), len(val)) == (12, 7)
    assert info.input_shape == (1, 28, 28)
    image, label = val[4]
    assert label == int(written["t10k"][1][4])
    assert image.shape == (1, 28, 28)
    # torchvision models take RGB: grey is repeated to 3 channels for them.
    rgb = TrainConfig(dataset=dataset, data_dir=str(tmp_path), model="resnet18")
    _, val_rgb, info_rgb = build_datasets(rgb.data, rgb.target, rgb.optim.seed)
    assert info_rgb.input_shape == (3, 28, 28) and val_rgb[4][0].shape == (3, 28, 28)
    assert torch.allclose(val_rgb[4][0][0], image[0]) and torch.allclose(val_rgb[4][0][2], image[0])


def test_missing_torchvision_files_name_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="pass --download"):
        describe_dataset(Data(dataset="mnist", data_dir=str(tmp_path)), Target())


def test_imagefolder_tree(tmp_path):
    write_imagefolder(str(tmp_path), train=8, val=3, size=20)
    cfg = TrainConfig(dataset="imagefolder", data_dir=str(tmp_path), image_size=24)
    train, val, info = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
    assert (len(train), len(val), info.num_classes) == (24, 9, 3)
    image, label = val[0]
    assert image.shape == (3, 24, 24) and label == 0
    assert {val[i][1] for i in range(len(val))} == {0, 1, 2}


def test_imagefolder_without_val_is_refused(tmp_path):
    write_imagefolder(str(tmp_path))
    import shutil

    shutil.rmtree(tmp_path / "val")
    with pytest.raises(ConfigError, match="val/ with one sub-folder per class"):
        describe_dataset(Data(dataset="imagefolder", data_dir=str(tmp_path)), Target())


@pytest.mark.parametrize("hf_struct", [False, True])
def test_parquet_image_bytes(tmp_path, hf_struct):
    write_parquet(str(tmp_path), train=40, val=11, classes=3, size=16, hf_struct=hf_struct)
    cfg = TrainConfig(dataset="parquet", data_dir=str(tmp_path))
    train, val, info = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
    assert (len(train), len(val), info.num_classes) == (40, 11, 3)
    image, label = val[5]
    assert image.shape == (3, 32, 32) and isinstance(int(label), int)
    # The class colour survives decoding: channel (label % 3) is the bright one.
    assert int(image.mean(dim=(1, 2)).argmax()) == int(label) % 3


def test_parquet_features_need_mlp(tmp_path):
    write_parquet(str(tmp_path), features=5)
    cfg = TrainConfig(dataset="parquet", data_dir=str(tmp_path), feature_column="features")
    with pytest.raises(ConfigError, match="needs --model mlp"):
        describe_dataset(cfg.data, cfg.target)
    cfg.target.model = "mlp"
    train, val, info = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
    assert info.input_shape == (5,) and train[0][0].dtype == torch.float32
    assert len(val) == 11


def test_parquet_without_label_column_is_refused(tmp_path):
    write_parquet(str(tmp_path))
    cfg = TrainConfig(dataset="parquet", data_dir=str(tmp_path), label_column="target")
    with pytest.raises(ConfigError, match="has no column 'target'"):
        describe_dataset(cfg.data, cfg.target)


def test_subset_is_seeded_and_sized(tmp_path):
    write_mnist(str(tmp_path), train=12, test=7)
    cfg = TrainConfig(dataset="mnist", data_dir=str(tmp_path), train_samples=5, val_samples=3)
    train, val, _ = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
    again, _, _ = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
    assert (len(train), len(val)) == (5, 3)
    assert np.array_equal(train.indices, again.indices)


# ------------------------------------------------------------- sizes known at preflight
def _write(dataset: str, root: str) -> None:
    if dataset == "cifar10":
        write_cifar10(root, per_batch=6, test=5)
    elif dataset in ("mnist", "fashion-mnist"):
        write_mnist(root, folder="MNIST" if dataset == "mnist" else "FashionMNIST")
    elif dataset == "imagefolder":
        write_imagefolder(root, train=5, val=2)
        # ImageFolder takes images by extension, in nested folders too; nothing else.
        os.makedirs(os.path.join(root, "train", "dog", "more"))
        Image.new("RGB", (20, 20)).save(os.path.join(root, "train", "dog", "more", "x.JPEG"))
        with open(os.path.join(root, "train", "cat", "notes.txt"), "w") as f:
            f.write("not an image")
    else:
        write_parquet(root, train=40, val=11)


@pytest.mark.parametrize("limits", [(None, None), (7, 2), (1000, 1000)], ids=str)
@pytest.mark.parametrize("dataset", ["cifar10", "mnist", "fashion-mnist", "imagefolder", "parquet"])
def test_every_dataset_knows_its_sizes_before_loading(tmp_path, dataset, limits):
    """The driver checks the batch against them: each equals the loaded split's length."""
    _write(dataset, str(tmp_path))
    cfg = TrainConfig(
        dataset=dataset, data_dir=str(tmp_path), train_samples=limits[0], val_samples=limits[1]
    )
    info = describe_dataset(cfg.data, cfg.target)
    train, val, built = build_datasets(cfg.data, cfg.target, cfg.optim.seed)
    assert (info.train_size, info.val_size) == (len(train), len(val))
    assert (built.train_size, built.val_size) == (len(train), len(val))


def test_a_download_counts_the_published_sizes(tmp_path):
    cfg = TrainConfig(dataset="cifar10", data_dir=str(tmp_path), download=True, val_samples=500)
    info = describe_dataset(cfg.data, cfg.target)  # downloads nothing: the workers do
    assert (info.train_size, info.val_size) == (50_000, 500)
    assert os.listdir(tmp_path) == []


def test_unreadable_files_are_refused_with_their_path(tmp_path):
    write_mnist(str(tmp_path))
    path = os.path.join(tmp_path, "MNIST", "raw", "t10k-images-idx3-ubyte")
    with open(path, "wb") as f:
        f.write(b"\x1f\x8b gzip, not IDX")
    with pytest.raises(ConfigError, match="t10k-images-idx3-ubyte is not an IDX image file"):
        describe_dataset(Data(dataset="mnist", data_dir=str(tmp_path)), Target())
    write_imagefolder(str(tmp_path / "folder"))
    for name in os.listdir(tmp_path / "folder" / "val" / "owl"):
        os.remove(tmp_path / "folder" / "val" / "owl" / name)
    with pytest.raises(ConfigError, match="Found no valid file for the classes owl"):
        describe_dataset(Data(dataset="imagefolder", data_dir=str(tmp_path / "folder")), Target())
