"""The parts under an own loop's verbs, without Ray (one process): the position, the
weighted backward and step (``Sum`` losses), the seeded draws, the refusals before Ray."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ray_ddp import ConfigError, Sum, TrainConfig
from ray_ddp.data.order.global_order import Slot
from ray_ddp.data.seeding import draw_seed
from ray_ddp.driver.own_loop import refuse_unsupported
from ray_ddp.worker.micro import Micro
from ray_ddp.worker.optim import Stepper
from ray_ddp.worker.position import Position
from ray_ddp.worker.precision import grad_scaler


def test_the_position_advances_by_steps_and_ends_epochs():
    position = Position()
    position.advance(32)
    position.advance(64)
    assert (position.epoch, position.step, position.sample) == (0, 2, 64)
    position.end_epoch()
    assert Position.from_dict(position.to_dict()) == Position(1, 2, 0)


def _micro(indices: list[int], step_samples: int, boundary: bool) -> Micro:
    slot = Slot(indices, step=0, micro=0, boundary=boundary, step_samples=step_samples)
    return Micro(None, slot, epoch=0, step=1)


def test_a_sum_loss_makes_the_mean_over_every_token_of_the_step():
    """Two micro-batches of 3 and 1 tokens: their Sum losses give the gradient of the mean
    over the 4 tokens, not the mean of the two micro-batches' means."""
    weight = torch.nn.Parameter(torch.tensor(1.0))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    stepper = Stepper(grad_scaler("off", torch.device("cpu")), 1, torch.device("cpu"))
    tokens = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0])]
    for values, last in zip(tokens, (False, True), strict=True):
        stepper.backward(Sum((weight * values).sum(), len(values)), _micro([0], 2, last).weight)
    stepper.step([optimizer], (), 0.0)
    assert weight.item() == pytest.approx(1.0 - (1 + 2 + 3 + 10) / 4)


def test_a_mean_loss_weighs_by_the_micro_batchs_share_of_the_step():
    weight = torch.nn.Parameter(torch.tensor(0.0))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    stepper = Stepper(grad_scaler("off", torch.device("cpu")), 1, torch.device("cpu"))
    stepper.backward(weight * 2.0, _micro([0, 1, 2], 4, False).weight)  # mean 2 over 3 samples
    stepper.backward(weight * 6.0, _micro([3], 4, True).weight)  # mean 6 over 1 sample
    stepper.step([optimizer], (), 0.0)
    assert weight.item() == pytest.approx(-(3 * 2.0 + 6.0) / 4)


def test_draws_are_keyed_by_the_sample_and_the_stream():
    assert draw_seed(0, 1, 5) == draw_seed(0, 1, 5)
    assert len({draw_seed(0, 1, 5), draw_seed(0, 1, 6), draw_seed(0, 2, 5),
                draw_seed(0, 1, 5, stream=1)}) == 4  # fmt: skip


@pytest.mark.parametrize(
    "fields, flag",
    [({"data_engine": "ray"}, "--data-engine")],
)  # fmt: skip
def test_what_an_own_loop_cannot_run_yet_is_refused_before_ray(fields, flag):
    with pytest.raises(ConfigError, match=flag):
        refuse_unsupported(dataclasses.replace(TrainConfig(), **fields).data)


class _Tokens(torch.utils.data.Dataset):
    """Sample i: a sequence of 1 to 4 "tokens" (3 features each) and their targets."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(3)
        self.rows = [
            (torch.randn(n, 3, generator=gen), torch.randn(n, generator=gen))
            for n in (1, 4, 2, 3, 1, 1, 4, 2, 3, 2, 4, 1, 2, 3, 1, 4)
        ]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int):
        return self.rows[index]


class _TokenTask:
    """A built-in loop's task whose loss is a ``Sum`` of squared errors over tokens."""

    def loss(self, model, batch):
        return Sum(sum(((model(x).squeeze(-1) - y) ** 2).sum() for x, y in batch),
                   sum(len(y) for _, y in batch))  # fmt: skip


def _token_epoch(micro: int):
    """One epoch of the built-in loop's pass (``train_segment``, one rank) over
    ``_Tokens``, 8 samples a step in micro-batches of ``micro``."""
    from torch.utils.data import DataLoader

    from ray_ddp.data.order.global_order import GlobalOrderBatches
    from ray_ddp.worker.hooks import Hooks
    from ray_ddp.worker.state import EpochSums, TrainState
    from ray_ddp.worker.step import Limits, StepCore, train_segment

    order = GlobalOrderBatches(16, batch_size=micro, global_batch=8, seed=4, rank=0,
                               world_size=1, tag_epoch=False)  # fmt: skip
    order.set_position(0, 0)
    loader = DataLoader(_Tokens(), batch_sampler=order, collate_fn=list)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    state = TrainState(model, optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False))
    core = StepCore(state, _TokenTask(), "off", torch.device("cpu"), 4, 0.0)
    segment = train_segment(core, order, loader, EpochSums(), Hooks(), Limits())
    steps = [list(order.slots)[i : i + 8 // micro] for i in range(0, 16 // micro, 8 // micro)]
    return segment, model, steps


def test_a_task_whose_loss_is_a_sum_trains_the_mean_over_every_token_of_each_step():
    """The built-in loop with ``Task.loss`` returning ``Sum``: 8 samples a step in one
    micro-batch or in four give the same weights (within float rounding), those of the
    rule by hand (each step: the gradient of its tokens' mean squared error), and the
    epoch's train loss is the mean per token, not per sample."""
    data = _Tokens()
    whole, model_1, steps = _token_epoch(8)
    split, model_4, _ = _token_epoch(2)
    torch.manual_seed(0)
    by_hand = torch.nn.Linear(3, 1)
    sgd = torch.optim.SGD(by_hand.parameters(), lr=0.1)
    totals, tokens = 0.0, 0
    for step in steps:
        rows = [data[i] for slot in step for i in slot.indices]
        errors = torch.cat([(by_hand(x).squeeze(-1) - y) ** 2 for x, y in rows])
        totals, tokens = totals + errors.sum().item(), tokens + len(errors)
        errors.mean().backward()
        sgd.step()
        sgd.zero_grad()
    for model in (model_1, model_4):
        for mine, theirs in zip(model.parameters(), by_hand.parameters(), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    for segment in (whole, split):
        assert segment.sums.count == tokens == 38 and segment.sums.samples == 16
        assert segment.sums.loss_sum / segment.sums.count == pytest.approx(totals / tokens)
