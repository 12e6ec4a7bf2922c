"""Experiment tracking without Ray: the params' flattening, the flags' checks, and the
sender's queue against a real MLflow client whose server is down (a closed port of
127.0.0.1) or a delivery that fails and recovers. The real server and real runs are
test_tracking_runs's."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from ray_ddp.config import ConfigError, TrainConfig, validate
from ray_ddp.driver.cli import train_main
from ray_ddp.driver.tracking import check_profile_steps, check_tracking
from ray_ddp.tracking.params import Settings, flatten
from ray_ddp.tracking.sender import Rejected, Sender
from ray_ddp.tracking.tracker import epoch_values


def test_params_are_the_config_flattened():
    flat = flatten({"lr": 0.003, "warmup_steps": None, "batch_sizes": [32, 64],
                    "resources_per_worker": {"slot": 1.0}, "compile": False})  # fmt: skip
    assert flat == {"lr": "0.003", "warmup_steps": "auto", "batch_sizes": "32,64",
                    "resources_per_worker.slot": "1.0", "compile": "False"}  # fmt: skip
    assert flatten(TrainConfig().to_dict())["task"].endswith(":ImageClassification")
    assert len(flatten({"long": "x" * 10_000})["long"]) == 6000  # MLflow's limit


def test_epoch_metrics_are_named_apart_from_the_step_ones():
    values = epoch_values({"epoch": 1, "step": 8, "train_loss": 2.0, "lr": 0.1,
                           "samples_per_s": 400.0, "val_acc": 0.5})  # fmt: skip
    assert values == {"epoch": 1, "epoch_train_loss": 2.0, "epoch_samples_per_s": 400.0,
                      "val_acc": 0.5}  # fmt: skip


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(profile_steps="5-3"), "need 1 <= A <= B"),
        (dict(profile_steps="0-2"), "need 1 <= A <= B"),
        (dict(profile_steps="5-9", max_steps=8), "the run has 8 optimizer steps (--max-steps)"),
        (dict(tracking_uri="http://x"), "--tracking-uri needs --tracking mlflow"),
        (dict(experiment="e"), "--experiment needs --tracking mlflow"),
        (dict(tracking="wandb", tracking_uri="http://x"), "W&B reads its server"),
    ],
)
def test_bad_tracking_and_profile_flags_are_refused_in_one_line(fields, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(TrainConfig(**fields))


def test_profile_steps_must_lie_within_the_run():
    # 512 samples in global batches of 64: 8 steps an epoch, 16 in 2 epochs.
    cfg = TrainConfig(profile_steps="15-17", num_workers=2, batch_size=32, epochs=2)
    with pytest.raises(ConfigError, match=r"the run has 16 optimizer steps \(2 epochs\)"):
        check_profile_steps(cfg.logging, cfg.optim, cfg.scaling, 512)
    fits = TrainConfig(profile_steps="15-16", num_workers=2, batch_size=32, epochs=2)
    check_profile_steps(fits.logging, fits.optim, fits.scaling, 512)


def test_a_tracker_that_is_not_installed_is_one_line_before_any_cluster_work(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what Python does for a blocked import
    with pytest.raises(ConfigError, match=r"needs the wandb package.*pip install -e '.\[wandb\]'"):
        check_tracking(TrainConfig(tracking="wandb").logging)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert train_main(["--tracking", "mlflow", "--epochs", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tracking mlflow needs a server" in err[0], err


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once it is closed


def test_a_server_that_is_down_is_said_once_and_never_blocks_the_caller():
    from ray_ddp.tracking.mlflow_sink import MlflowSink

    uri = f"http://127.0.0.1:{_closed_port()}"
    settings = Settings("mlflow", uri, "e", "r", "/nonexistent/run", {})
    lines: list[str] = []
    sink = MlflowSink(settings, None, lambda run_id: None, lambda: "key")
    sender = Sender(sink, lines.append, "MLflow tracking", interval_s=0.05,
                    backoff_s=(0.01, 0.02))  # fmt: skip
    started = time.perf_counter()
    for step in range(1, 5001):
        sender.put(("point", "train_loss", 1.0 / step, step, 0))
    assert time.perf_counter() - started < 0.5  # the training thread never waits
    deadline = time.monotonic() + 30
    while not sender.failing and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # several more intervals of failing tries
    sender.put(("point", "train_loss", 0.0, 5001, 0))
    started = time.perf_counter()
    assert sender.close(timeout_s=20) is False
    assert time.perf_counter() - started < 5  # one last try: the server is known down
    assert len(lines) == 1 and lines[0].startswith("warning: MLflow tracking failed"), lines
    assert "training goes on" in lines[0]
    assert sender.sent == 0 and sender.dropped == 5001 and sender.unsent == {"point": 5001}


def test_a_backlog_reaches_a_server_that_comes_back_in_order_and_once():
    got: list[int] = []
    failures = {"left": 3}
    lines: list[str] = []

    def deliver(items):
        if failures["left"]:
            failures["left"] -= 1
            raise ConnectionError("connection refused")
        got.extend(item[3] for item in items)

    sender = Sender(deliver, lines.append, "MLflow tracking", interval_s=0.02, backoff_s=(0.01,))
    for step in range(1, 101):
        sender.put(("metric", "loss", 0.5, step, 0))
        if step % 10 == 0:
            time.sleep(0.02)
    assert sender.close(timeout_s=10)
    assert got == list(range(1, 101))
    assert len(lines) == 1 and "ConnectionError: connection refused" in lines[0]


def test_what_the_tracker_rejects_is_dropped_not_retried():
    calls, lines = [], []

    def deliver(items):
        calls.append(len(items))
        raise Rejected("INVALID_PARAMETER_VALUE")

    sender = Sender(deliver, lines.append, "MLflow tracking", interval_s=0.01)
    sender.put(("param", "a", "1"))
    assert sender.close(timeout_s=5) is False  # it did not reach the tracker
    assert calls == [1] and sender.dropped == 1 and sender.rejected == {"param": 1}
    assert len(lines) == 1 and "rejected 1 items" in lines[0]


def test_a_slow_delivery_does_not_hold_the_putting_thread():
    release = threading.Event()

    def deliver(items):
        release.wait(5)  # a server that takes its time

    sender = Sender(deliver, print, "MLflow tracking", interval_s=0.01)
    sender.put(("metric", "loss", 1.0, 1, 0))
    time.sleep(0.1)  # the sending thread is now inside deliver
    started = time.perf_counter()
    for step in range(2, 10_002):
        sender.put(("metric", "loss", 1.0, step, 0))
    assert time.perf_counter() - started < 0.5
    release.set()
    assert sender.close(timeout_s=10)


def test_a_tracker_far_behind_thins_step_points_only_and_says_exactly_what_it_lost():
    """A tracker far slower than the run: its first send (the params) blocks until
    released, while 200 steps' points (3 a step) and 10 epochs' metrics (2 each) are put
    into a queue of 60 step points. The params in flight are neither touched nor counted
    lost; params and metrics all arrive; step points are thinned, each counted; the end
    line's numbers are what arrived and what did not."""
    entered, release = threading.Event(), threading.Event()
    got: list = []

    def deliver(items):
        entered.set()
        release.wait(10)  # the first send only: afterwards it is set
        got.extend(items)

    lines: list[str] = []
    sender = Sender(deliver, lines.append, "MLflow tracking", interval_s=0.01, capacity=60)
    sender.put(*(("param", f"p{i}", str(i)) for i in range(10)))
    sender.flush()
    assert entered.wait(5)  # the params are being sent
    for step in range(1, 201):
        sender.put(*(("point", key, 1.0 / step, step, 0) for key in ("loss", "lr", "speed")))
        if step % 20 == 0:
            sender.put(("metric", "val_loss", 0.5, step, 0), ("metric", "val_acc", 0.9, step, 0))
    release.set()
    assert sender.close(timeout_s=10) is False  # not everything arrived
    assert [item[1] for item in got[:10]] == [f"p{i}" for i in range(10)]
    assert sorted(item[3] for item in got if item[0] == "metric") == sorted(
        [step for step in range(20, 201, 20)] * 2
    )  # every epoch's metrics, once
    points = [item for item in got if item[0] == "point"]
    steps = sorted({item[3] for item in points})
    assert len(points) == 3 * len(steps) == len(set(points))  # each step whole, once
    assert steps[-1] == 200 and steps[0] <= 10  # the newest kept, the span too
    assert len(points) <= 60 and sender.thinned == 600 - len(points) > 0
    assert sender.delivered == {"param": 10, "metric": 20, "point": len(points)}
    assert sender.dropped == sender.thinned and sender.sent == 30 + len(points)
    assert sender.line() == (
        f"MLflow tracking: not everything reached the tracker: {600 - len(points)} step "
        "points thinned out while the tracker lagged behind (every other step waiting, the "
        f"newest kept); it has {len(points)} step points, 20 metrics, 10 params"
    )
    assert lines == []  # slow, never failing: no warning


def test_what_never_left_is_counted_by_kind_and_said_in_the_end_line():
    """A server down until the end: nothing arrives, and the end line says what was left,
    by kind; everything arriving is one line too."""

    def down(items):
        raise ConnectionError("connection refused")

    sender = Sender(down, lambda _: None, "MLflow tracking", interval_s=0.01, backoff_s=())
    sender.put(("param", "lr", "0.1"), ("point", "loss", 1.0, 1, 0), ("metric", "val", 1.0, 1, 0))
    assert sender.close(timeout_s=2) is False
    assert sender.unsent == {"param": 1, "point": 1, "metric": 1} and sender.dropped == 3
    assert sender.line() == ("MLflow tracking: not everything reached the tracker: 1 step "
                             "point, 1 metric, 1 param still unsent when the run ended; it "
                             "has nothing")  # fmt: skip
    fine = Sender(lambda items: None, lambda _: None, "MLflow", interval_s=0.01)
    fine.put(("param", "lr", "0.1"), ("param", "wd", "0"), ("point", "loss", 1.0, 1, 0))
    assert fine.close(timeout_s=2)
    assert fine.line() == "MLflow: everything reached the tracker (1 step point, 2 params)"
