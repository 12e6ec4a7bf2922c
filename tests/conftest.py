"""Shared fixtures and the tiers' rules. One real local Ray instance for the whole test
session.

The order (``pytest_collection_modifyitems``): the fast tier first (tests without the
``ray`` marker: no Ray at all), then the tests on the shared Ray, then the modules that
need a cluster of their own (several simulated nodes, a token-auth head, a benchmark that
starts its own Ray), marked ``own_cluster``: the shared instance starts once and is
stopped once, before them.

The fast tier is a rule, not a convention (``_no_ray_without_the_marker``): Ray's
temporary folder is one of this session's own (``RAY_TMPDIR``, inherited by every
process a test starts), and a test without the ``ray`` marker that calls ``ray.init`` or
leaves anything in that folder (a Ray started by a subprocess) fails, naming the marker.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ray_ddp.cluster.connect import QUIET_LOCAL_RAY, shutdown  # noqa: E402 - after the path
from ray_ddp.io import timeline  # noqa: E402

# Ray reads this once, on import: every worker prints the same rank-table header and
# restart lines, which deduplication would fold away (the entry points set it too).
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# The Ray the tests start is a local one, like the one jobs/train.py starts for itself:
# the same quiet settings (cluster.QUIET_LOCAL_RAY), and fits on it get the same trimmed
# Ray Train (lean_trainer). Every Train controller (Tune trials' and the own clusters'
# too) polls its workers every 0.5 s instead of 2 s: a finished run is noticed sooner.
# Measured on 2 cores, a 1-epoch run: 9.5 s instead of 14 s, over ~30 runs in the suite.
os.environ.update(QUIET_LOCAL_RAY)
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


# Every Ray this session starts, in the tests' own process or in one they start, keeps its
# sessions here (a short path: Ray's socket paths must stay under 108 bytes). Empty while
# the fast tier runs.
_OWN_TMP = "RAY_TMPDIR" not in os.environ
RAY_TMP = os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="rdt-", dir="/tmp"))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The folder made for this session goes with it (every Ray in it has stopped)."""
    if _OWN_TMP:
        import shutil

        shutil.rmtree(RAY_TMP, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fast tier first, then the tests on the shared Ray, then those with a cluster
    of their own (a stable sort keeps the order within each)."""

    def tier(item: pytest.Item) -> int:
        if item.get_closest_marker("own_cluster") is not None:
            return 2
        return 1 if item.get_closest_marker("ray") is not None else 0

    items.sort(key=tier)


# RAY_DDP_TEST_CPU=FILE: how busy the machine was during each test (the share of both
# cores' time, from /proc/stat), written to FILE (test, wall s, busy share) and summed per
# module at the end. Where a slow test leaves the cores idle, it waits (a timeout, a
# poll, a one-worker job) rather than computes: the first place to look for time.
_CPU_FILE = os.environ.get("RAY_DDP_TEST_CPU")
_CPU_ROWS: list[tuple[str, float, float]] = []


def _cpu_ticks() -> tuple[int, int]:
    """Busy and total ticks of all cores since boot."""
    with open("/proc/stat") as stat:
        ticks = [int(t) for t in stat.readline().split()[1:9]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # less idle and iowait


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    timeline.mark(timeline.TEST_STARTED, who=item.nodeid)  # where RAY_DDP_TIMELINE is set
    if not _CPU_FILE:
        yield
        return
    (busy, total), started = _cpu_ticks(), time.monotonic()
    yield
    (busy_end, total_end), wall = _cpu_ticks(), time.monotonic() - started
    _CPU_ROWS.append((item.nodeid, wall, (busy_end - busy) / max(1, total_end - total)))


def pytest_terminal_summary(terminalreporter) -> None:
    if not _CPU_FILE or not _CPU_ROWS:
        return
    with open(_CPU_FILE, "w") as out:
        out.writelines(f"{test}\t{wall:.2f}\t{busy:.3f}\n" for test, wall, busy in _CPU_ROWS)
    modules: dict[str, list[float]] = {}
    for test, wall, busy in _CPU_ROWS:
        sums = modules.setdefault(test.split("::")[0], [0.0, 0.0])
        sums[0], sums[1] = sums[0] + wall, sums[1] + wall * busy
    terminalreporter.section("machine busy per module (RAY_DDP_TEST_CPU)")
    for module, (wall, busy) in sorted(modules.items(), key=lambda kv: -kv[1][0])[:25]:
        terminalreporter.write_line(f"{wall:8.1f} s  {100 * busy / wall:3.0f}% busy  {module}")
    wall, busy = sum(w for _, w, _ in _CPU_ROWS), sum(w * b for _, w, b in _CPU_ROWS)
    terminalreporter.write_line(f"{wall:8.1f} s  {100 * busy / wall:3.0f}% busy  all ({_CPU_FILE})")


def _ray_started() -> list[str]:
    """What Ray left in this session's temporary folder (nothing until a Ray starts)."""
    return sorted(os.listdir(RAY_TMP)) if os.path.isdir(RAY_TMP) else []


@pytest.fixture(autouse=True)
def _no_ray_without_the_marker(request: pytest.FixtureRequest):
    """A test without the ``ray`` marker may not start Ray: ``ray.init`` raises in it, and
    a Ray started by a process it ran (a job script) fails it once it returns."""
    if request.node.get_closest_marker("ray") is not None:
        yield
        return
    before = _ray_started()
    if "ray" in sys.modules:  # imported by a module under test; else nothing can call it

        def refuse(*args, **kwargs):
            raise RuntimeError(
                f"{request.node.nodeid} starts Ray without the `ray` marker: the fast tier "
                "(pytest -m 'not ray') never starts Ray; mark it @pytest.mark.ray"
            )

        monkeypatch = request.getfixturevalue("monkeypatch")
        monkeypatch.setattr(sys.modules["ray"], "init", refuse)
    yield
    started = [entry for entry in _ray_started() if entry not in before]
    if started:
        pytest.fail(
            f"{request.node.nodeid} started Ray (it left {started} in RAY_TMPDIR={RAY_TMP}) "
            "without the `ray` marker; mark it @pytest.mark.ray",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def s3():
    """The session's S3-compatible server (``s3server``): its ``host:port``, with the
    environment pointing at it until the session ends."""
    pytest.importorskip("moto", reason="pip install -e '.[test]' (moto[server])")
    import s3server

    with s3server.serving() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def tracking_server(tmp_path_factory):
    """The session's MLflow tracking server (``mlflow_server``: SQLite store, local
    artifacts, 127.0.0.1), started by the first test that asks for it."""
    from mlflow_server import MlflowServer, server_command

    if server_command() is None:
        pytest.skip("pip install -e '.[test]' (mlflow)")
    server = MlflowServer(str(tmp_path_factory.mktemp("mlflow"))).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def ray_session(request: pytest.FixtureRequest):
    """A real local Ray with 2 CPUs, shared by every test that trains. Started after the
    S3 server (where moto is installed), so its workers read and write its buckets."""
    import importlib.util

    import ray

    if importlib.util.find_spec("moto") is not None:
        request.getfixturevalue("s3")
    if not ray.is_initialized():
        ray.init(num_cpus=2, logging_level="WARNING")
    yield ray
    shutdown()  # with any worker left hanging in its exit (cluster.connect.shutdown)


@pytest.fixture(scope="session")
def straight_run(ray_session, tmp_path_factory):
    """The uninterrupted 2-worker run of ``ledgers.EXACT_RUN`` that the exactness tests
    (faults, hangs, other world sizes, lost nodes) compare with. Session-wide, so the
    simulated cluster of test_nodes (which shuts the shared Ray down) reuses it rather
    than training it again on its slower nodes."""
    from ledgers import EXACT_RUN, LEDGER

    from ray_ddp.driver.run import fit

    storage = str(tmp_path_factory.mktemp("straight"))
    return fit(
        "ray_ddp.image_classification:ImageClassification",
        num_workers=2,
        storage_path=storage,
        name="straight",
        harness=LEDGER,
        **EXACT_RUN,
    )


@pytest.fixture(scope="module")
def no_shared_ray():
    """For a module that starts its own cluster: the shared instance must not run beside
    it (one Ray per machine), and runs last (see ``pytest_collection_modifyitems``)."""
    shutdown()
    yield
    shutdown()


@pytest.fixture
def storage(tmp_path):
    path = tmp_path / "runs"
    path.mkdir()
    return str(path)
