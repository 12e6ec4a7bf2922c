"""The reclaim notice's close, without Ray: after the notice's first checkpoint the watch
trains on while another step and a checkpoint fit before the deadline, then asks for the
last checkpoint and holds after it until the node goes (here: until a short grace past
the deadline); with no room even for a checkpoint, it holds at once."""

from __future__ import annotations

import statistics

import pytest
from waits import Clock

from ray_ddp.worker.preemption import HOLD_GRACE_S, MARGIN_S, PreemptionWatch

STEP_S = 0.5
NOW = 1.8e9
"""Where the tests' clock starts: seconds since the epoch, as a notice's deadline is."""


def _watch(said: list[str], events: list[str], clock: Clock) -> PreemptionWatch:
    """A watch with the run's own margin and grace, on ``clock``."""
    return PreemptionWatch(
        0, said.append, lambda: events.append("upload waited"), lambda: events.append("held"),
        lambda timeout_s: events.append("registration waited") or True,
        clock=clock, sleep=clock.sleep,
    )  # fmt: skip


def _steps(watch: PreemptionWatch, clock: Clock, steps: range) -> None:
    """Steps of STEP_S before the notice: none asks for a checkpoint."""
    for step in steps:
        clock.sleep(STEP_S)
        assert not watch(step)


def _noticed(watch: PreemptionWatch, step: int, deadline_in: float) -> float:
    """The state a notice with a deadline leaves at ``step`` (what ``_ask`` sets from Ray's
    answer), its first checkpoint then due; the deadline."""
    watch.deadline = watch.clock() + deadline_in
    watch.insured, watch.final, watch.hold_due = (step, watch.clock()), None, False
    return watch.deadline


def test_the_last_checkpoint_comes_before_the_deadline_and_training_holds_after_it():
    said, events, clock = [], [], Clock(NOW)
    watch = _watch(said, events, clock)
    _steps(watch, clock, range(1, 6))
    checkpoint_s = 3.0
    deadline = _noticed(watch, 5, deadline_in=MARGIN_S + checkpoint_s + 10.1)
    clock.sleep(checkpoint_s)  # the notice's checkpoint, then steps on
    step = 5
    while True:
        step += 1
        clock.sleep(STEP_S)
        if watch(step):
            break
    left = deadline - clock()
    assert said == [f"last checkpoint before the deadline: at step {step}"]
    assert step > 6  # trained on after the notice's checkpoint
    # It measured the notice's checkpoint (the interval that held it less a step), and
    # stopped at the first boundary where another step would leave less than that and
    # the margin: the one before still had room.
    assert watch.checkpoint_s == pytest.approx(checkpoint_s)
    room = statistics.median(watch.steps_s) + watch.checkpoint_s + MARGIN_S
    assert room - STEP_S <= left < room, (left, room)
    watch.after_checkpoint(step)  # the planned one: it holds until the grace is out
    assert clock() >= deadline + HOLD_GRACE_S
    assert events == ["registration waited", "upload waited", "held", "registration waited"]
    assert said[1].startswith(f"holding at step {step} until the node goes")
    assert "its checkpoint registered)" in said[1]
    assert said[2].startswith(f"the node was not reclaimed by {HOLD_GRACE_S:.0f} s past its")
    assert not watch(step + 1) and watch.deadline is None  # training on, as before


def test_without_time_for_another_checkpoint_it_holds_at_once():
    said, events, clock = [], [], Clock(NOW)
    watch = _watch(said, events, clock)
    _steps(watch, clock, range(1, 4))
    deadline = _noticed(watch, 3, deadline_in=MARGIN_S / 2)
    clock.sleep(STEP_S)
    assert not watch(4)  # no checkpoint: the notice's is the last; held here
    assert clock() >= deadline + HOLD_GRACE_S
    assert said[0] == "no time for another checkpoint before the deadline"
    assert said[1].startswith("holding at step 4 until the node goes")
    assert events == ["registration waited", "upload waited", "held", "registration waited"]


def test_an_epochs_own_checkpoint_in_the_close_is_the_last_where_no_other_would_fit():
    """An epoch ends between two boundaries' decisions: the boundary before its end had
    room to train on, its validation and checkpoint then took that room. It is the last
    checkpoint: hold after it, not after one more step that would be lost with the node.
    Where room is left after it, training goes on."""
    said, events, clock = [], [], Clock(NOW)
    watch = _watch(said, events, clock)
    _steps(watch, clock, range(1, 6))
    deadline = _noticed(watch, 5, deadline_in=MARGIN_S + 4.0)
    clock.sleep(1.0 + STEP_S)  # the notice's checkpoint (1 s), then step 6
    assert not watch(6)  # the notice's checkpoint measured; room to train on
    assert watch.checkpoint_s == pytest.approx(1.0)
    watch.after_checkpoint(6)  # an epoch's end right after: still room
    assert said == [] and events == ["registration waited"] and watch.final is None
    # Its validation: less than a step and a checkpoint left, more than a checkpoint.
    clock.sleep(deadline - clock() - (MARGIN_S + watch.checkpoint_s + STEP_S / 2))
    watch.after_checkpoint(6)
    assert said[0] == "last checkpoint before the deadline: at step 6"
    assert said[1].startswith("holding at step 6 until the node goes")
    assert clock() >= deadline + HOLD_GRACE_S
    assert events[1:] == ["upload waited", "held", "registration waited"]
