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
from ray_ddp.worker.own_parts import Stepper
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
    stepper = Stepper(grad_scaler("off", torch.device("cpu")), 0.0, 1, torch.device("cpu"))
    tokens = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0])]
    for values, last in zip(tokens, (False, True), strict=True):
        stepper.backward(Sum((weight * values).sum(), len(values)), _micro([0], 2, last))
    stepper.step([optimizer], (), 0.0)
    assert weight.item() == pytest.approx(1.0 - (1 + 2 + 3 + 10) / 4)


def test_a_mean_loss_weighs_by_the_micro_batchs_share_of_the_step():
    weight = torch.nn.Parameter(torch.tensor(0.0))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    stepper = Stepper(grad_scaler("off", torch.device("cpu")), 0.0, 1, torch.device("cpu"))
    stepper.backward(weight * 2.0, _micro([0, 1, 2], 4, False))  # mean 2 over 3 samples
    stepper.backward(weight * 6.0, _micro([3], 4, True))  # mean 6 over 1 sample
    stepper.step([optimizer], (), 0.0)
    assert weight.item() == pytest.approx(-(3 * 2.0 + 6.0) / 4)


def test_draws_are_keyed_by_the_sample_and_the_stream():
    assert draw_seed(0, 1, 5) == draw_seed(0, 1, 5)
    assert len({draw_seed(0, 1, 5), draw_seed(0, 1, 6), draw_seed(0, 2, 5),
                draw_seed(0, 1, 5, stream=1)}) == 4  # fmt: skip


@pytest.mark.parametrize(
    "fields, flag",
    [({"strategy": "fsdp2"}, "--strategy fsdp2"), ({"data_engine": "ray"}, "--data-engine"),
     ({"tracking": "mlflow"}, "--tracking"), ({"profile_steps": "3-4"}, "--profile-steps")],
)  # fmt: skip
def test_what_an_own_loop_cannot_run_yet_is_refused_before_ray(fields, flag):
    with pytest.raises(ConfigError, match=flag):
        refuse_unsupported(dataclasses.replace(TrainConfig(), **fields))
