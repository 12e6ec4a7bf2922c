"""Preflight's model check: a model that would crash in the workers' first training step
on the data is refused before Ray starts, as bad input (exit 2, one line saying what to
do); a model that runs is let through."""

from __future__ import annotations

import time

import pytest
from formats import write_imagefolder

from ray_ddp.config import ConfigError, TrainConfig
from ray_ddp.driver.cli import train_main
from ray_ddp.driver.preflight import preflight
from ray_ddp.image_classification.models import BUILTIN_MODELS, check_model_name
from ray_ddp.image_classification.probe import check_model_runs


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> str:
    """An ImageFolder tree: 32x32 images as the models see them (the default size)."""
    root = str(tmp_path_factory.mktemp("images"))
    write_imagefolder(root, train=2, val=1)
    return root


@pytest.mark.parametrize(
    ("model", "message"),
    [
        pytest.param(
            "googlenet",
            "--model googlenet returns GoogLeNetOutputs in training mode, not one tensor of "
            "class scores",
            id="googlenet-tuple",
        ),
        pytest.param(
            "inception_v3",
            "--model inception_v3 returns InceptionOutputs in training mode",
            id="inception-tuple",
        ),
        pytest.param(
            "vit_b_16",
            "--model vit_b_16 fails on the data's 32x32 input (Wrong image height! Expected "
            "224 but got 32!); it runs on 224x224 images: pass --image-size 224",
            id="vit-size",
        ),
    ],
)
def test_a_model_that_cannot_train_on_the_data_exits_2(model, message, images, tmp_path, capsys):
    runs = tmp_path / "runs"
    argv = ["--dataset", "imagefolder", "--data-dir", images, "--model", model]
    assert train_main(argv + ["--storage-path", str(runs)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {message}"), err
    assert "\n" not in err, err
    assert not runs.exists()


def _preflight(tmp_path, **fields) -> None:
    preflight(TrainConfig(storage_path=str(tmp_path), **fields))


@pytest.mark.parametrize("model", [*BUILTIN_MODELS, "resnet18"])
def test_models_that_run_on_the_data_pass(model, images, tmp_path):
    _preflight(tmp_path, dataset="imagefolder", data_dir=images, model=model)


def test_the_size_it_names_is_one_the_model_runs_on(images, tmp_path):
    _preflight(tmp_path, dataset="imagefolder", data_dir=images, model="vit_b_16", image_size=224)


def test_the_built_in_data_is_not_resized_so_it_names_no_size(tmp_path):
    with pytest.raises(ConfigError, match=r"16x16 input \(.*\); choose another model$"):
        _preflight(tmp_path, model="vgg11")


def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        line = next(x for x in status if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def test_the_check_builds_no_weights():
    """On the meta device: even a model of 630M parameters (2.5 GB of weights, seconds to
    initialise on CPU) costs no memory. Measured as the process's peak resident memory
    during the check (reset first), not as time: these machines are noisy."""
    check_model_name("resnet50")  # imports torchvision (about 1 s), as preflight does first
    for model in ("resnet50", "vit_h_14"):
        baseline = _rss_mb("VmRSS")
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # the peak (VmHWM) starts again from the current size
        started = time.perf_counter()
        check_model_runs(model, (3, 224, 224), 1000)
        grown = _rss_mb("VmHWM") - baseline
        print(f"{model} check: {time.perf_counter() - started:.3f} s, peak +{grown:.0f} MB")
        assert grown < 300  # the real vit_h_14 would hold 2500 MB of weights
