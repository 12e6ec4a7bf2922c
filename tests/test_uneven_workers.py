"""What ``--num-workers``' help says of counts that do not divide a step's micro-batches,
held against the parser, the config check and the data order (issue 27 #9: the help said
every MIN..MAX count must divide the global batch, which uneven splits made untrue)."""

from __future__ import annotations

from ray_ddp.config import validate
from ray_ddp.data.order.global_order import EpochPlan
from ray_ddp.driver.cli import train_config, train_parser


def test_an_elastic_range_whose_counts_do_not_divide_the_step_trains_them_unevenly():
    """``--num-workers 4-8 --accum-steps 2``: 16 micro-batches a step, which 5, 6 and 7
    workers do not divide, is accepted; on 6 workers ranks 0-3 train 3 of them and ranks
    4-5 train 2, every micro-batch of the step once."""
    argv = ["--num-workers", "4-8", "--accum-steps", "2", "--batch-size", "8"]
    cfg = train_config(train_parser().parse_args(argv))
    validate(cfg)  # what preflight checks first, before any cluster work
    assert (cfg.scaling.min_workers, cfg.scaling.num_workers, cfg.global_batch_size) == (4, 8, 128)
    plan = EpochPlan(256, cfg.optim.batch_size, cfg.global_batch_size, seed=0, epoch=0)
    for workers in range(4, 9):
        slots = [plan.slots(rank, workers) for rank in range(workers)]
        first_step = [[s for s in mine if s.step == 0] for mine in slots]
        counts = [len(mine) for mine in first_step]
        assert sorted({s.micro for mine in first_step for s in mine}) == list(range(16))
        assert counts == [-(-(16 - rank) // workers) for rank in range(workers)]
        if workers == 6:
            assert counts == [3, 3, 3, 3, 2, 2]
