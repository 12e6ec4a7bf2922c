"""Non-finite losses and fp16 skipped steps, on real tensors and a real GradScaler."""

from __future__ import annotations

import pytest
import torch

from ray_ddp.reliability.loss_guard import LossGuard, NonFiniteLossError, nonfinite_message
from ray_ddp.worker.optim import Stepper


def _setup(enabled: bool):
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    scaler = torch.amp.GradScaler("cpu", enabled=enabled, init_scale=2.0**10)
    return model, optimizer, scheduler, scaler


def test_an_overflowed_fp16_step_is_skipped_without_advancing_the_schedule():
    model, optimizer, scheduler, scaler = _setup(enabled=True)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    model.weight.grad[0, 0] = float("inf")  # what an fp16 overflow leaves behind
    assert Stepper(scaler, 1, torch.device("cpu")).step([optimizer], [scheduler]) is False
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scheduler.last_epoch == 0 and optimizer.param_groups[0]["lr"] == 0.1
    assert scaler.get_scale() == 2.0**9  # backed off, ready for the next try

    optimizer.zero_grad()
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    assert Stepper(scaler, 1, torch.device("cpu")).step([optimizer], [scheduler]) is True
    assert scheduler.last_epoch == 1 and optimizer.param_groups[0]["lr"] == 0.05
    assert not torch.equal(before[0], model.weight)


def test_without_a_scaler_every_step_applies():
    model, optimizer, scheduler, scaler = _setup(enabled=False)
    model(torch.ones(2, 3)).sum().backward()
    assert Stepper(scaler, 1, torch.device("cpu")).step([optimizer], [scheduler]) is True
    assert scheduler.last_epoch == 1


def test_the_guard_names_step_and_rank_and_passes_finite_losses():
    guard = LossGuard(torch.device("cpu"), rank=3, check_every=1)
    guard.observe(torch.tensor(1.5), step=1, where="epoch 1, micro-batch 1")
    guard.check()
    with pytest.raises(NonFiniteLossError, match="optimizer step 7 on rank 3 \\(inf"):
        guard.observe(torch.tensor(float("inf")), step=7, where="epoch 1, micro-batch 7")


def test_the_deferred_guard_reports_the_first_bad_step_only_when_checked():
    """The GPU path (no host read per micro-step), run on CPU tensors: the first
    non-finite step is kept on the device and raised at the next check."""
    guard = LossGuard(torch.device("cpu"), rank=1, check_every=5, eager=False)
    guard.observe(torch.tensor(0.7), step=1, where="")
    guard.observe(torch.tensor(float("nan")), step=3, where="")  # recorded, not raised
    guard.observe(torch.tensor(float("inf")), step=4, where="")  # a later one: ignored
    guard.maybe_check(4)  # not a check step: still silent
    with pytest.raises(NonFiniteLossError, match="optimizer step 3 on rank 1"):
        guard.maybe_check(5)
    clean = LossGuard(torch.device("cpu"), rank=0, check_every=1, eager=False)
    clean.observe(torch.tensor(2.0), step=1, where="")
    clean.check()


def test_the_message_is_found_in_a_relayed_traceback():
    relayed = RuntimeError(
        "Traceback (most recent call last):\n  File x\n"
        "ray_ddp.reliability.loss_guard.NonFiniteLossError: non-finite training loss at "
        "optimizer step 4"
    )
    assert nonfinite_message(relayed) == "non-finite training loss at optimizer step 4"
    assert nonfinite_message(RuntimeError("worker died")) is None


def test_the_controller_stops_on_the_workers_own_exception_objects():
    """Ray Train gives its callbacks each worker's exception object itself (not the
    relayed traceback text): a non-finite loss must be recognised in that form too, and
    a repeated error only when type, message and step all match."""
    from ray_ddp.reliability.retry_policy import failure_signature, nonfinite_loss, note_step

    assert nonfinite_loss(NonFiniteLossError("non-finite training loss at step 3")) == (
        "non-finite training loss at step 3"
    )
    first, again, later = (
        OSError("image file is truncated"),
        OSError("image file is truncated"),
        OSError("image file is truncated"),
    )
    note_step(first, 2)
    note_step(again, 2)
    note_step(later, 5)
    assert failure_signature(first) == failure_signature(again)
    assert failure_signature(first) != failure_signature(later)
    assert "OSError: image file is truncated" in failure_signature(first)


def test_one_failed_attempt_polled_again_counts_once(capsys):
    """Ray Train calls ``after_exception`` at every poll that finds errors, and while it
    waits out a reclaim it polls one failed attempt several times: that is one failure,
    said once, not the same error stopping two attempts. A lost rank's error names its
    actor (here a note stands for the actor id Ray's message carries), new in each attempt;
    an error a rank raises again at the same step in the next attempt still stops the run."""
    from ray.exceptions import ActorDiedError

    from ray_ddp.reliability.retry_policy import (
        RepeatedFailureError,
        note_step,
        stop_hopeless_retries,
    )

    def lost(actor: str) -> ActorDiedError:
        error = ActorDiedError()
        error.add_note(f"actor_id: {actor}")
        return error

    def raised() -> OSError:
        error = OSError("Connection closed by peer")
        note_step(error, 12)
        return error

    retries = stop_hopeless_retries()
    first = lost("a1")
    retries.after_exception(None, {1: first})
    retries.after_exception(None, {1: first})  # the same attempt, polled again
    retries.after_exception(None, {1: first, 0: raised()})  # rank 0 fails too, later
    retries.after_exception(None, {1: lost("b2")})  # the next attempt loses a rank too
    assert capsys.readouterr().out.splitlines() == [
        "attempt failed: lost rank 1 (process or node gone)",
        "attempt failed at optimizer step 12: lost rank 1 (process or node gone); rank 0 raised",
        "attempt failed: lost rank 1 (process or node gone)",
    ]
    with pytest.raises(RepeatedFailureError, match="Connection closed by peer"):
        retries.after_exception(None, {1: lost("c3"), 0: raised()})
