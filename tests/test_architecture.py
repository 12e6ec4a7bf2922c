"""The package's architecture, held in seconds (no Ray started): the import contracts of
pyproject.toml (layers, the worker and data rules, Ray's private modules behind
ray_ddp.compat, no circles), no mention of Ray's private modules elsewhere, every private
Ray name compat uses still where it was, functions short enough to read, and the
command-line flags unchanged."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import pytest

from ray_ddp.compat import apis, versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRIVATE = re.compile(r"ray\._private|ray\._raylet|ray\.[\w.]*\._internal|ray\._common")


def test_the_import_contracts_hold():
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    done = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "Contracts: 5 kept, 0 broken." in done.stdout


def _shipped_files() -> list[str]:
    """Every file shipped or run by users: the package, the jobs, examples, benchmarks."""
    found = []
    for top in ("ray_ddp", "jobs", "examples", "benchmarks"):
        for folder, _, names in os.walk(os.path.join(ROOT, top)):
            found += [os.path.join(folder, n) for n in names if n.endswith((".py", ".sh"))]
    return found


LONGEST_FUNCTION = 80  # lines, docstring included


def test_no_function_of_the_package_or_the_jobs_is_longer_than_a_screen():
    long = []
    for path in _shipped_files():
        if not path.endswith(".py") or os.sep + "benchmarks" + os.sep in path:
            continue
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST_FUNCTION:
                    long.append(
                        f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({lines})"
                    )
    assert not long, long


def test_the_modules_that_take_the_whole_config_are_those_the_architecture_doc_lists():
    """Code takes the config sections it reads (issue 46); the modules that name
    ``TrainConfig`` are the ones docs/architecture.md lists, each with why."""
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        doc = f.read().split("## Who takes the whole config", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (`[^|]*) \|", doc, flags=re.M)
    listed = {name for row in rows for name in re.findall(r"`([\w/]+\.py)`", row)}
    package = os.path.join(ROOT, "ray_ddp")
    naming = set()
    for folder, _, names in os.walk(package):
        for name in (n for n in names if n.endswith(".py")):
            with open(os.path.join(folder, name)) as f:
                if "TrainConfig" in f.read():
                    naming.add(os.path.relpath(os.path.join(folder, name), package))
    assert naming == listed, (sorted(naming - listed), sorted(listed - naming))


def test_only_the_compat_package_mentions_rays_private_modules():
    """The tests too: the fake autoscaling cluster's reads go through ``compat``."""
    compat = os.path.join(ROOT, "ray_ddp", "compat") + os.sep
    tests = [os.path.join(ROOT, "tests", n) for n in os.listdir(os.path.join(ROOT, "tests"))]
    offenders = []
    for path in _shipped_files() + [t for t in tests if t.endswith(".py")]:
        if path.startswith(compat) or path == os.path.abspath(__file__):
            continue
        with open(path) as file:
            for number, line in enumerate(file, 1):
                if PRIVATE.search(line):
                    offenders.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.skipif(
    versions.ray_version() not in versions.VERIFIED_RAY, reason="a Ray ray_ddp was not verified on"
)
@pytest.mark.parametrize("name", apis.LEAN + apis.OTHERS, ids=lambda p: f"{p.module}:{p.name}")
def test_every_private_ray_name_compat_uses_is_where_it_was(name):
    """On a verified Ray each name resolves, and a callable has the parameters the code
    calls or overrides it with."""
    name.resolve()  # raises naming the module or attribute that moved
    if name.params is not None:
        assert name.parameters() == name.params, f"{name.module}:{name.name} changed"


def test_compat_repeats_the_stock_methods_of_this_ray():
    version = versions.ray_version()
    if version not in versions.VERIFIED_RAY:
        pytest.skip(f"Ray {version}: the stock trainer runs")
    digests, pinned = apis.stock_source_digests(), apis.STOCK_SOURCE[version]
    changed = [name for name, digest in pinned.items() if digests[name] != digest]
    assert not changed, (
        f"{changed} changed: read them against ray_ddp/compat/lean_trainer.py and "
        "torch_backend.py before trusting this Ray"
    )
    assert set(digests) == set(pinned)


def test_another_ray_or_the_switch_gets_the_stock_trainer(monkeypatch, capsys):
    from ray.train.torch import TorchTrainer

    versions.lean_trainer_ok.cache_clear()
    try:
        # The lean trainer's module is imported on a verified Ray only: on another its
        # private imports may not even resolve.
        verified = versions.ray_version() in versions.VERIFIED_RAY
        if verified:
            from ray_ddp.compat.lean_trainer import LeanTorchTrainer
        expected = LeanTorchTrainer if verified else TorchTrainer
        assert versions.torch_trainer_class() is expected  # this Ray
        capsys.readouterr()
        versions.lean_trainer_ok.cache_clear()
        monkeypatch.setenv(versions.STOCK_ENV, "1")
        assert versions.torch_trainer_class() is TorchTrainer
        monkeypatch.delenv(versions.STOCK_ENV)
        versions.lean_trainer_ok.cache_clear()
        monkeypatch.setattr(versions, "ray_version", lambda: "9.99.0")
        assert versions.torch_trainer_class() is TorchTrainer
        assert versions.torch_trainer_class() is TorchTrainer  # said once
        out = capsys.readouterr().out.splitlines()
        assert out == [
            "ray_ddp: Ray 9.99.0 is not one its lean start-up was verified on "
            f"({', '.join(versions.VERIFIED_RAY)}); runs use Ray Train's stock TorchTrainer "
            "(slower to start, the same training)"
        ]
    finally:
        versions.lean_trainer_ok.cache_clear()


def _flags(parser) -> list[str]:
    return sorted(s for action in parser._actions for s in action.option_strings)


# Flags added since d86bdea, by job (none removed or renamed).
ADDED_SINCE_D86BDEA = {
    "evaluate": ["--max-bad-samples", "--help-all"],  # issues 27, 46
    "train": [
        "--help-all",  # 46
        "--restart-epoch",
        "--checkpoint-mode",
        "--preemption-check-steps",  # 27, 28
        "--tracking",
        "--tracking-uri",
        "--experiment",
        "--profile-steps",
        "--strategy",  # 31
    ],  # 29
    "tune": [
        "--help-all",  # 46
        "--checkpoint-mode",
        "--preemption-check-steps",  # issue 28
        "--tracking",
        "--tracking-uri",
        "--experiment",
        "--profile-steps",
        "--strategy",  # 31
    ],  # 29
}


def test_the_jobs_flags_are_those_before_the_redesign():
    """Every flag of jobs/train.py, jobs/tune.py and jobs/evaluate.py as it was at d86bdea
    (before issue 26), and the few added since: users' command lines keep working."""
    from ray_ddp.driver.cli import evaluate_parser, train_parser, tune_parser

    with open(os.path.join(ROOT, "tests", "data", "flags_d86bdea.json")) as file:
        before = json.load(file)
    for job, added in ADDED_SINCE_D86BDEA.items():
        before[job] = sorted(before[job] + added)
    now = {
        "train": _flags(train_parser()),
        "tune": _flags(tune_parser()),
        "evaluate": _flags(evaluate_parser()),
    }
    assert now == before


def test_what_the_train_controller_unpickles_imports_no_torch():
    """The controller imports the modules of its class, its backend settings and its
    callbacks; none may import torch (``ray_ddp/compat/local_controller.py``). The Ray test
    ``test_training.py::test_a_local_run_starts_only_the_actors_it_uses`` checks a real
    controller's process."""
    modules = [
        "ray_ddp.compat.local_controller",
        "ray_ddp.compat.torch_backend",
        "ray_ddp.reliability.retry_policy",
    ]
    code = (
        f"import sys\nfor m in {modules!r}: __import__(m)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_lean_backend_takes_ray_s_plain_torch_config_only():
    from ray.train.torch import TorchConfig

    from ray_ddp.compat.torch_backend import LeanTorchBackend, LeanTorchConfig

    lean = LeanTorchConfig.of(TorchConfig(backend=None, timeout_s=99))
    assert lean == LeanTorchConfig(backend=None, init_method="env", timeout_s=99)
    assert lean.to_dict() == TorchConfig(backend=None, timeout_s=99).to_dict()
    assert lean.backend_cls is LeanTorchBackend and LeanTorchBackend.share_cuda_visible_devices
    assert lean.train_func_context is TorchConfig().train_func_context
    assert lean.framework == TorchConfig().framework
    tpu = TorchConfig(backend="tpu_dist")
    assert LeanTorchConfig.of(tpu) is tpu
