"""The reclaim notice's close, without Ray: after the notice's first checkpoint the watch
trains on while another step and a checkpoint fit before the deadline, then asks for the
last checkpoint and holds after it until the node goes (here: until a short grace past
the deadline); with no room even for a checkpoint, it holds at once."""

from __future__ import annotations

import statistics
import time

from ray_ddp.worker.preemption import PreemptionWatch

STEP_S = 0.02
MARGIN_S = 0.5


def _watch(said: list[str], events: list[str]) -> PreemptionWatch:
    watch = PreemptionWatch(
        0, said.append, lambda: events.append("upload waited"), lambda: events.append("held"),
        lambda timeout_s: events.append("registration waited") or True,
    )  # fmt: skip
    watch.hold_grace_s, watch.margin_s = 0.1, MARGIN_S
    return watch


def _noticed(watch: PreemptionWatch, step: int, deadline_in: float) -> float:
    """The state a notice with a deadline leaves at ``step`` (what ``_ask`` sets from Ray's
    answer), its first checkpoint then due; the deadline."""
    watch.deadline = time.time() + deadline_in
    watch.insured, watch.final, watch.hold_due = (step, time.perf_counter()), None, False
    return watch.deadline


def test_the_last_checkpoint_comes_before_the_deadline_and_training_holds_after_it():
    said, events = [], []
    watch = _watch(said, events)
    for step in range(1, 6):
        assert not watch(step)
        time.sleep(STEP_S)
    checkpoint_s = 0.3
    before = list(watch.steps_s)  # the 4 intervals of steps 1-5
    deadline = _noticed(watch, 5, deadline_in=MARGIN_S + checkpoint_s + 1.0)
    time.sleep(checkpoint_s)  # the notice's checkpoint
    step = next(s for s in range(6, 500) if watch(s) or time.sleep(STEP_S))
    left = deadline - time.time()
    assert said == [f"last checkpoint before the deadline: at step {step}"]
    assert step > 6  # trained on after the notice's checkpoint
    # It measured the notice's checkpoint, and stopped at the first boundary where another
    # step would leave less than that and the margin: the one before still had room.
    # (what passed since the notice less the median step; with the interval of 5-6, which
    # holds the checkpoint, that median is at most the longest of the 4 before)
    assert watch.checkpoint_s >= checkpoint_s - max(before)
    step_s, interval = statistics.median(watch.steps_s), watch.steps_s[-1]
    room = step_s + watch.checkpoint_s + MARGIN_S
    assert room - interval - 0.25 < left < room  # 0.25 s: this process descheduled
    watch.after_checkpoint(step)  # the planned one: it holds
    assert time.time() >= deadline + watch.hold_grace_s
    assert events == ["registration waited", "upload waited", "held", "registration waited"]
    assert said[1].startswith(f"holding at step {step} until the node goes")
    assert "its checkpoint registered)" in said[1]
    assert said[2].startswith("the node was not reclaimed by 0 s past its deadline")
    assert not watch(step + 1) and watch.deadline is None  # training on, as before


def test_without_time_for_another_checkpoint_it_holds_at_once():
    said, events = [], []
    watch = _watch(said, events)
    for step in range(1, 4):
        watch(step)
        time.sleep(STEP_S)
    deadline = _noticed(watch, 3, deadline_in=MARGIN_S / 2)
    assert not watch(4)  # no checkpoint: the notice's is the last; held here
    assert time.time() >= deadline + watch.hold_grace_s
    assert said[0] == "no time for another checkpoint before the deadline"
    assert said[1].startswith("holding at step 4 until the node goes")
    assert events == ["registration waited", "upload waited", "held", "registration waited"]


def test_an_epochs_own_checkpoint_in_the_close_is_the_last_where_no_other_would_fit():
    """An epoch ends between two boundaries' decisions: the boundary before its end had
    room to train on, its validation and checkpoint then took that room. It is the last
    checkpoint: hold after it, not after one more step that would be lost with the node.
    Where room is left after it, training goes on."""
    said, events = [], []
    watch = _watch(said, events)
    for step in range(1, 6):
        watch(step)
        time.sleep(STEP_S)
    deadline = _noticed(watch, 5, deadline_in=MARGIN_S + 0.4)
    assert not watch(6)  # the notice's checkpoint measured; room to train on
    watch.after_checkpoint(6)  # an epoch's end right after: still room
    assert said == [] and events == ["registration waited"] and watch.final is None
    time.sleep(max(0.0, deadline - time.time() - MARGIN_S - watch.checkpoint_s))  # its validation
    watch.after_checkpoint(6)
    assert said[0] == "last checkpoint before the deadline: at step 6"
    assert said[1].startswith("holding at step 6 until the node goes")
    assert time.time() >= deadline + watch.hold_grace_s
    assert events[1:] == ["upload waited", "held", "registration waited"]
