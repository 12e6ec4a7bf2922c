"""--download: one fetch per node, rank 0's node first, nobody reading before it ends."""

from __future__ import annotations

import pytest

from ray_ddp.worker.data import download_turn


def test_rank_0_fetches_first_then_one_worker_per_other_node():
    # 2 nodes x 2 workers: ranks 0, 1 on the first node, 2, 3 on the second.
    turns = [download_turn(rank, local) for rank, local in [(0, 0), (1, 1), (2, 0), (3, 1)]]
    assert turns == [0, None, 1, None]


@pytest.mark.ray
def test_a_tasks_download_runs_once_and_every_worker_reads_after_it(ray_session, tmp_path):
    import broken_tasks
    import fetch_task
    from ray import cloudpickle

    import ray_ddp

    for module in (fetch_task, broken_tasks):
        cloudpickle.register_pickle_by_value(module)
    try:
        ray_ddp.fit(
            fetch_task.FetchOnce(), num_workers=2, epochs=1, batch_size=8, download=True,
            data_dir=str(tmp_path), storage_path=str(tmp_path / "runs"), name="fetch",
            export=False, tensorboard=False,
        )  # fmt: skip
    finally:
        for module in (fetch_task, broken_tasks):
            cloudpickle.unregister_pickle_by_value(module)
    events = [line.split() for line in (tmp_path / "fetch.log").read_text().splitlines()]
    fetches = [(rank, what) for rank, what, _ in events if what.startswith("fetch")]
    assert fetches == [("0", "fetch-start"), ("0", "fetch-end")]
    fetched_at = float(next(t for _, what, t in events if what == "fetch-end"))
    reads = [(rank, float(t)) for rank, what, t in events if what == "read"]
    assert sorted(rank for rank, _ in reads) == ["0", "1"]
    assert all(t > fetched_at for _, t in reads), events
