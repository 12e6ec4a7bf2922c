"""The command line: flags generated from the config fields, and exit codes.

Bad input exits 2 with one actionable line, before any training starts (and before Ray).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import typing

import pytest
from formats import write_cifar10, write_imagefolder, write_parquet

from ray_ddp.config import SweepConfig, TrainConfig, sections, sweep
from ray_ddp.config import train as config
from ray_ddp.config.fields import config_fields, field_docs, field_value, flag_of, sections_of
from ray_ddp.config.flags import first_sentence, from_args
from ray_ddp.driver.cli import (
    evaluate_main,
    evaluate_parser,
    exit_code,
    train_main,
    train_parser,
    tune_main,
    tune_parser,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _job(script: str, *argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "jobs", script), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


# ----------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> str:
    """Data, a checkpoint and two kept runs for the refusals below to be refused about."""
    from test_checkpoint import _write as write_checkpoint  # here: only these cases need it

    tmp = str(tmp_path_factory.mktemp("inputs"))
    write_imagefolder(os.path.join(tmp, "folder"))
    shutil.rmtree(os.path.join(tmp, "folder", "val"))
    write_parquet(os.path.join(tmp, "pq"))
    write_cifar10(os.path.join(tmp, "cifar"), per_batch=20)  # 100 training images
    write_imagefolder(os.path.join(tmp, "images"))  # 24 training images
    write_checkpoint(os.path.join(tmp, "ckpt"))
    os.makedirs(os.path.join(tmp, "empty"))
    # A run started with another learning rate, and a run record that is not JSON.
    for name, text in (("earlier", '{"lr": 0.5, "model": "small_resnet"}'), ("garbled", "{nope")):
        os.makedirs(os.path.join(tmp, "kept", name))
        with open(os.path.join(tmp, "kept", name, "ray_ddp_config.json"), "w") as f:
            f.write(text)
    return tmp


KEPT = ["--storage-path", "{tmp}/kept"]
BAD_INPUTS = [
    pytest.param(["--lr", "0"], "--lr must be positive", id="lr-zero"),
    pytest.param(["--lr", "-1"], "--lr must be positive", id="lr-negative"),
    pytest.param(["--batch-size", "0"], "--batch-size must be positive", id="batch-size"),
    pytest.param(["--epochs", "0"], "--epochs must be positive", id="epochs"),
    pytest.param(["--seed", "-1"], "--seed must be in 0..2**63-1", id="seed-negative"),
    pytest.param(["--accum-steps", "-2"], "--accum-steps must be positive", id="accum-steps"),
    pytest.param(["--num-workers", "0"], "--num-workers must be positive", id="num-workers"),
    pytest.param(["--dataset", "imagenet"], "unknown --dataset 'imagenet'", id="dataset"),
    pytest.param(["--model", "resnet9000"], "unknown --model 'resnet9000'", id="model"),
    pytest.param(["--amp", "fp16", "--no-gpu"], "--amp fp16 needs GPUs", id="fp16-on-cpu"),
    pytest.param(["--amp", "int4"], "unknown --amp 'int4'", id="amp"),
    pytest.param(["--optimizer", "lamb"], "unknown --optimizer 'lamb'", id="optimizer"),
    pytest.param(["--dataset", "cifar10"], "needs --data-dir", id="data-dir-missing"),
    pytest.param(
        ["--dataset", "cifar10", "--data-dir", "{tmp}/nope"], "does not exist", id="data-dir-absent"
    ),
    pytest.param(
        ["--dataset", "mnist", "--data-dir", "{tmp}/empty"], "pass --download", id="not-downloaded"
    ),
    pytest.param(
        ["--dataset", "imagefolder", "--data-dir", "{tmp}/folder"],
        "val/ with one sub-folder per class",
        id="imagefolder-no-val",
    ),
    pytest.param(
        ["--dataset", "imagefolder", "--data-dir", "{tmp}/empty"],
        "train/ with",
        id="imagefolder-empty",
    ),
    pytest.param(
        ["--dataset", "parquet", "--data-dir", "{tmp}/pq", "--label-column", "y"],
        "has no column 'y'",
        id="parquet-column",
    ),
    pytest.param(
        ["--dataset", "parquet", "--data-dir", "{tmp}/empty"],
        "train.parquet or",
        id="parquet-empty",
    ),
    pytest.param(
        ["--resume-from", "{tmp}/empty"], "is not a ray_ddp checkpoint", id="resume-not-ckpt"
    ),
    pytest.param(
        ["--resume-from", "{tmp}/ckpt", "--model", "mlp"],
        "saved with model=small_cnn",
        id="resume-other-model",
    ),
    pytest.param(
        ["--num-workers", "2", "--train-samples", "100", "--batch-size", "64"],
        "larger than a worker's share",
        id="batch-over-shard",
    ),
    pytest.param(
        ["--dataset", "cifar10", "--data-dir", "{tmp}/cifar", "--num-workers", "2"]
        + ["--train-samples", "64", "--batch-size", "64"],
        "larger than a worker's share of the 64 training samples (32)",
        id="cifar10-batch-over-shard",
    ),
    pytest.param(
        ["--dataset", "imagefolder", "--data-dir", "{tmp}/images", "--num-workers", "2"]
        + ["--batch-size", "16"],
        "larger than a worker's share of the 24 training samples (12)",
        id="imagefolder-batch-over-shard",
    ),
    pytest.param(
        ["--image-size", "32"],
        "--image-size does not apply to the built-in dataset",
        id="builtin-image-size",
    ),
    pytest.param(
        ["--num-workers", "2", "--train-samples", "400", "--batch-size", "64"]
        + ["--accum-steps", "8"],
        "--accum-steps 8 makes a global batch of 1024 (64 x 2 workers x 8), more than the 400",
        id="accum-over-shard",
    ),
    pytest.param(["--name", "a/b"], "--name must be a plain directory name", id="name"),
    pytest.param(
        ["--checkpoint-every", "0"], "--checkpoint-every must be positive", id="checkpoint-every"
    ),
    pytest.param(
        ["--wait-for-resources", "-5"],
        "--wait-for-resources must be zero or more",
        id="wait-for-resources",
    ),
    pytest.param(
        ["--placement-strategy", "scatter"],
        "unknown --placement-strategy 'SCATTER'",
        id="placement-strategy",
    ),
    pytest.param(
        ["--name", "earlier", *KEPT],
        "exists with another config (--lr 0.5 -> 0.003)",
        id="rerun-other-config",
    ),
    pytest.param(["--name", "garbled", *KEPT], "is not readable JSON", id="rerun-garbled-record"),
    pytest.param(
        ["--num-workers", "4-8"],
        "--num-workers 4-8 would leave workers idle on 7 workers",
        id="elastic-range-leaves-workers-idle",
    ),
    pytest.param(["--num-workers", "3-2"], "need 1 <= MIN <= MAX", id="elastic-range-reversed"),
]


def _files(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files)


@pytest.mark.parametrize(("argv", "message"), BAD_INPUTS)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(
    argv, message, inputs, tmp_path, capsys
):
    argv = [arg.format(tmp=inputs) for arg in argv]
    runs = tmp_path / "runs"
    if "--storage-path" not in argv:
        argv += ["--storage-path", str(runs)]
    before = _files(inputs)
    code = train_main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and message in err, err
    assert "\n" not in err, err
    assert not runs.exists(), "nothing is written for refused input"
    assert _files(inputs) == before  # nor beside the kept runs


def test_fp16_is_refused_where_no_gpu_is_visible(tmp_path):
    """Auto GPU choice, and none visible (whatever this machine has): refused, not run."""
    proc = _job(
        "train.py", "--amp", "fp16", "--storage-path", str(tmp_path), CUDA_VISIBLE_DEVICES=""
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "error: --amp fp16 needs GPUs and this machine has none; use --amp bf16 or --amp off"
    )
    assert os.listdir(tmp_path) == []


@pytest.mark.ray
def test_requests_the_cluster_cannot_hold_exit_2(ray_session, tmp_path, capsys):
    for argv, message in [
        (["--num-workers", "3"], "3 workers x 1 CPUs = 3 CPUs asked, the Ray cluster has 2"),
        (["--use-gpu"], "the Ray cluster has no GPUs"),
        (["--cpus-per-worker", "1.5"], "2 workers x 1.5 CPUs = 3 CPUs asked"),
    ]:
        started = time.monotonic()
        assert train_main(argv + ["--storage-path", str(tmp_path)]) == 2
        assert time.monotonic() - started < 30  # not Ray's endless pending
        assert message in capsys.readouterr().err
    # An autoscaling cluster: told to wait, it says so, waits that long, then refuses.
    started = time.monotonic()
    argv = ["--num-workers", "3", "--wait-for-resources", "3", "--storage-path", str(tmp_path)]
    assert train_main(argv) == 2
    assert 3 <= time.monotonic() - started < 30
    out, err = capsys.readouterr()
    assert "waiting up to 3 s for nodes" in out and "3 CPUs asked" in err


def test_the_script_itself_exits_2_before_starting_ray():
    proc = _job("train.py", "--lr", "-1")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --lr must be positive, got -1.0"
    assert "Ray" not in proc.stdout + proc.stderr  # refused before any Ray start-up


def test_argparse_errors_also_exit_2():
    proc = _job("train.py", "--epochs", "three")
    assert proc.returncode == 2 and "invalid int value: 'three'" in proc.stderr
    proc = _job("train.py", "--use-gpu", "--no-gpu")
    assert proc.returncode == 2 and "--no-gpu: not allowed with argument --use-gpu" in proc.stderr


# ----------------------------------------------------------------------------- exit codes
@pytest.mark.parametrize(
    ("main", "argv", "message"),
    [
        (train_main, ["--lr", "-1"], "--lr must be positive, got -1.0"),
        (tune_main, ["--lr-min", "0"], "need 0 < --lr-min <= --lr-max, got 0 and 0.01"),
        (tune_main, ["--reduction-factor", "1"], "--reduction-factor must be greater than 1"),
        (evaluate_main, ["ckpt", "--num-workers", "0"], "--num-workers must be positive, got 0"),
    ],
    ids=["train", "tune", "tune-sweep-field", "evaluate"],
)
def test_every_entry_point_exits_2_on_bad_input(main, argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


@pytest.mark.parametrize("main", [train_main, tune_main, evaluate_main])
def test_every_entry_point_exits_130_on_ctrl_c(main, monkeypatch, capsys):
    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", ctrl_c)
    assert main(["ckpt"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_exit_codes_of_failed_training_and_of_a_bug(capsys):
    from ray.train import TrainingFailedError

    def fail(exc: Exception):
        def job():
            raise exc

        return job

    assert exit_code(lambda: None) == 0
    assert exit_code(fail(TrainingFailedError("worker 1 died"))) == 1
    assert capsys.readouterr().err == "training failed: worker 1 died\n"
    no_result = fail(RuntimeError("no trial reported a result"))
    assert exit_code(no_result, failed=(RuntimeError,)) == 1  # how tune_main calls it
    with pytest.raises(RuntimeError):  # elsewhere a RuntimeError is a bug: its traceback stays
        exit_code(no_result)


def test_ray_log_dedup_is_turned_off_by_running_a_job_not_by_importing(monkeypatch):
    code = "import os, ray_ddp.driver.cli; print(os.environ.get('RAY_DEDUP_LOGS'))"
    env = {k: v for k, v in os.environ.items() if k != "RAY_DEDUP_LOGS"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert proc.stdout.strip() == "None", proc.stderr
    monkeypatch.delenv("RAY_DEDUP_LOGS", raising=False)
    exit_code(lambda: None)
    assert os.environ["RAY_DEDUP_LOGS"] == "0"


@pytest.mark.parametrize("script", ["train.py", "tune.py", "evaluate.py"])
def test_each_script_has_help(script):
    short, full = (_job(script, flag, COLUMNS="80") for flag in ("--help", "--help-all"))
    for proc in (short, full):
        assert proc.returncode == 0 and proc.stdout.startswith(f"usage: jobs/{script}")
    assert short.stdout.count("\n") <= 120 and full.stdout.count("\n") > short.stdout.count("\n")


# ----------------------------------------------------------------------------- one source
def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


# The flags as they were before the CLI was generated: the README, cluster.yaml and the
# benchmarks use these names, so none may change or go.
TRAIN_FLAGS = {
    "-h", "--help", "--num-workers", "--cpus-per-worker", "--use-gpu", "--no-gpu", "--address",
    "--strategy",
    "--placement-strategy", "--max-failures", "--wait-for-resources", "--epochs",
    "--batch-size", "--accum-steps", "--lr", "--optimizer", "--momentum", "--weight-decay",
    "--warmup-steps", "--min-lr-ratio", "--grad-clip", "--amp", "--seed", "--max-steps",
    "--dataset", "--data-dir", "--download", "--train-samples", "--val-samples", "--image-size",
    "--label-column", "--image-column", "--feature-column", "--loader-workers", "--pin-memory",
    "--no-pin-memory", "--channels-last", "--no-channels-last", "--model", "--storage-path",
    "--name", "--resume-from", "--allow-config-change", "--keep-checkpoints",
    "--checkpoint-every", "--summary-json", "--no-tensorboard", "--log-every-steps",
    "--log-all-ranks", "--no-export", "--comm-stats",
    "--augment",  # added since: issue 12's augmentation policies
    "--task",  # issue 13: your own model, data and loss
    "--resources-per-worker",  # issue 14: custom resources (autoscaled node types)
    "--resize-check-s",  # issue 15: elastic runs
    # issue 17: data larger than memory, Ray Data, bad samples
    "--parquet-read", "--shuffle-buffer", "--data-engine", "--max-bad-samples",
    "--compile",  # issue 18: torch.compile in the training path
    "--hang-timeout", "--hang-grace",  # issue 16: the hang watchdog
    "--restart-epoch",  # issue 27: an epoch whose order changed under a resume
    "--checkpoint-mode", "--preemption-check-steps",  # issue 28: async checkpoints, reclaims
    "--tracking", "--tracking-uri", "--experiment", "--profile-steps",  # issue 29
    "--help-all",  # issue 46: the short --help's full explanations
}  # fmt: skip
SWEEP_FLAGS = {
    "--lr-min", "--lr-max", "--batch-sizes", "--num-samples", "--max-concurrent-trials",
    "--grace-period", "--reduction-factor", "--no-early-stop", "--scale-lr", "--resume"
}  # fmt: skip
EVALUATE_FLAGS = {
    "-h", "--help", "--split", "--num-workers", "--cpus-per-worker", "--use-gpu", "--no-gpu",
    "--address", "--data-dir", "--batch-size", "--storage-path", "--predictions",
    "--summary-json", "--task",
    "--max-bad-samples",  # issue 27: unreadable samples in an evaluation
    "--help-all",  # issue 46
}  # fmt: skip


def test_every_flag_keeps_its_name():
    assert _options(train_parser()) == TRAIN_FLAGS
    not_swept = {"--lr", "--allow-config-change", "--checkpoint-every", "--resize-check-s",
                 "--restart-epoch"}  # fmt: skip
    assert _options(tune_parser()) == (TRAIN_FLAGS - not_swept) | SWEEP_FLAGS
    assert _options(evaluate_parser()) == EVALUATE_FLAGS


def _dashed(name: str) -> str:
    return "--" + name.replace("_", "-")


def _set_every_field(cls: type, only_swept: bool = False) -> tuple[list[str], dict]:
    """argv giving every flagged field of ``cls`` a value other than its default, and
    those values."""
    hints = {}
    for _, section in sections_of(cls):
        hints.update(typing.get_type_hints(section))
    argv, values = [], {}
    for f in config_fields(cls):
        facts = flag_of(f)
        if not facts.cli or (only_swept and not facts.sweep):
            continue
        default = field_value(cls(), f.name)
        if hints[f.name] is bool and default:
            argv.append(facts.negative or _dashed("no_" + f.name))
            values[f.name] = False
            continue
        if hints[f.name] in (bool, bool | None):
            argv.append(_dashed(f.name))
            values[f.name] = True
            continue
        if facts.choices:
            value = next(c for c in reversed(facts.choices) if c != default)
        elif hints[f.name] == list[int]:
            value = [5, 7]
        elif "dict" in str(hints[f.name]):
            value = {"trainer_slot": 1.0}
        elif f.name == "profile_steps":
            value = "3-5"  # optimizer steps A-B
        elif "str" in str(hints[f.name]):
            value = f"some-{f.name}"
        else:  # a number
            value = (default or 0) + 3
        argv += [
            _dashed(f.name),
            ",".join(map(str, value))
            if isinstance(value, list)
            else json.dumps(value)
            if isinstance(value, dict)
            else str(value),
        ]
        values[f.name] = value
    return argv, values


def test_every_train_field_has_a_flag_that_sets_it():
    argv, values = _set_every_field(TrainConfig)
    cfg = from_args(TrainConfig, train_parser().parse_args(argv))
    assert cfg == dataclasses.replace(TrainConfig(), **values)
    internal = {"progress_interval_s", "log_prefix"}
    internal |= {"min_workers"}  # set by --num-workers MIN-MAX
    assert set(values) | internal == {f.name for f in TrainConfig.fields()}
    # The off switches of the tri-state flags, and a strategy in lower case.
    args = train_parser().parse_args(
        ["--no-gpu", "--no-pin-memory", "--no-channels-last", "--placement-strategy", "spread"]
    )
    cfg = from_args(TrainConfig, args)
    assert (cfg.scaling.use_gpu, cfg.data.pin_memory, cfg.data.channels_last) == (
        False,
        False,
        False,
    )
    assert cfg.scaling.placement_strategy == "SPREAD"
    assert from_args(TrainConfig, train_parser().parse_args([])) == TrainConfig()


def test_every_sweep_field_has_a_flag_that_sets_it():
    sweep_argv, sweep_values = _set_every_field(SweepConfig)
    train_argv, train_values = _set_every_field(TrainConfig, only_swept=True)
    args = tune_parser().parse_args(sweep_argv + train_argv)
    assert from_args(SweepConfig, args) == dataclasses.replace(SweepConfig(), **sweep_values)
    assert from_args(TrainConfig, args) == dataclasses.replace(TrainConfig(), **train_values)
    assert set(sweep_values) | {"trial_cpus"} == {f.name for f in dataclasses.fields(SweepConfig)}


def test_evaluate_flags_override_only_what_is_given():
    args = evaluate_parser().parse_args(["ckpt", "--num-workers", "3", "--no-gpu"])
    assert (args.checkpoint, args.split, args.num_workers, args.use_gpu) == (
        "ckpt",
        "val",
        3,
        False,
    )
    assert args.batch_size is None and args.storage_path is None  # keep the checkpoint's


def _flat(text: str) -> str:
    return "".join(text.replace("``", "").split())  # argparse re-wraps the lines


def _printed(parser: argparse.ArgumentParser, flag: str) -> str:
    """What ``flag`` (``--help``, ``--help-all``) prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        parser.parse_args([flag])
    assert stop.value.code == 0
    return out.getvalue()


@pytest.mark.parametrize(
    ("parser", "cls"), [(train_parser, TrainConfig), (tune_parser, SweepConfig)]
)
def test_help_is_the_field_docstrings_in_their_sections(parser, cls, monkeypatch):
    """``--help``: each flag's first sentence, in its section's group; ``--help-all``: the
    whole docstring."""
    monkeypatch.setenv("COLUMNS", "80")
    short, full = _printed(parser(), "--help"), _printed(parser(), "--help-all")
    docs = field_docs(cls)
    for title, section in sections_of(cls):
        for f in dataclasses.fields(section):
            if flag_of(f).cli:
                assert _flat(first_sentence(docs[f.name])) in _flat(short), f.name
                assert _flat(docs[f.name]) in _flat(full), f.name
                assert f"\n{title}:\n" in short and f"\n{title}:\n" in full, f.name
    assert "(default: 64)" in short or cls is SweepConfig
    assert _flat("Reference per-worker batch of --scale-lr") in _flat(_printed(tune_parser(), "-h"))
    assert len(short.splitlines()) <= 120 < 200 < len(full.splitlines())


def _entries(text: str) -> dict[str, list[str]]:
    """Each option of a help text and its lines (the invocation's and the help's)."""
    entries: dict[str, list[str]] = {}
    for line in text.splitlines():
        if re.match(r"  -", line):
            entries[line.split()[0].rstrip(",")] = current = [line]
        elif line.startswith("      ") and entries:
            current.append(line)
        else:
            current = []
    return entries


def _joined(lines: list[str]) -> str:
    return " ".join(" ".join(lines).split())


@pytest.mark.parametrize("parser", [train_parser, tune_parser, evaluate_parser])
def test_help_gives_each_flag_two_lines_at_most_with_its_default(parser, monkeypatch):
    """On an 80-column terminal. A field's first sentence is what --help shows of it: a
    long one here needs a shorter first sentence in its docstring."""
    monkeypatch.setenv("COLUMNS", "80")
    entries = _entries(_printed(parser(), "--help"))
    assert len(entries) >= 14
    long = {flag: lines for flag, lines in entries.items() if len(lines) > 2}
    assert not long, long
    if parser is train_parser:
        shown = {flag: _joined(lines) for flag, lines in entries.items()}
        assert "(default: 64)" in shown["--batch-size"] and "(default: 0.003)" in shown["--lr"]
        assert "(default: auto)" in shown["--num-workers"]  # None, "Auto: ..."
        assert "(default: auto)" in shown["--[no-]pin-memory"]  # --pin-memory | --no-pin-memory
        assert "(default: on)" in shown["--no-export"] and "(default: off)" in shown["--compile"]
        assert "default" not in shown["--data-dir"]  # None, and no "Auto:"
        assert "(default: built-in)" in shown["--task"]  # its shown name, not the long value
    if parser is evaluate_parser:
        assert "(default: unchanged)" in _joined(entries["--batch-size"])


def test_help_shows_the_defaults_an_own_loop_gives(monkeypatch, capsys):
    """``ray_ddp.main(loop, lr=0.5)``: its --help says 0.5, as its run uses."""
    import ray_ddp

    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as stop:
        ray_ddp.main(lambda run: None, ["--help"], lr=0.5, epochs=2)
    assert stop.value.code == 0
    shown = {flag: _joined(lines) for flag, lines in _entries(capsys.readouterr().out).items()}
    assert "(default: 0.5)" in shown["--lr"] and "(default: 2)" in shown["--epochs"]
    assert "(default: 64)" in shown["--batch-size"]  # TrainConfig's, where the loop gives none


def test_every_flag_named_in_config_exists():
    """Messages and help that name other flags (``--dataset X needs --data-dir``) stay
    true when a field is renamed."""
    source = "".join(inspect.getsource(m) for m in (config, sections, sweep))
    named = set(re.findall(r"--[a-z][a-z0-9-]+", source))
    assert named <= _options(train_parser()) | _options(tune_parser())
