"""Which worker failures a restart can cure, decided in Ray Train's controller.

``--max-failures`` restarts all workers from the latest checkpoint after a failure: right
for a lost worker or node, useless for a failure the restart will meet again. Two are
stopped at once, whatever ``--max-failures`` allows:

- a non-finite loss: the same data and weights diverge again;
- more unreadable samples than ``--max-bad-samples`` (``ray_ddp.data.unreadable``): the same
  files are unreadable again;
- a checkpoint whose position inside an epoch cannot be continued on today's data or flags
  (``ResumeRefusedError``): the restart would restore the same checkpoint;
- the same error at the same optimizer step as an earlier attempt (a sample that cannot
  be decoded, a bug): it is deterministic, and with ``--max-failures -1`` it would be
  retried forever. The worker loop notes the step on every error it raises. A hang (the
  watchdog's reports, ``ray_ddp.reliability.hangs.report``) counts as the same when its stuck ranks
  are at the same places after the same step.
"""

from __future__ import annotations

from collections import Counter

from ray_ddp.reliability.hangs.report import latest_hang

STEP_NOTE = "ray_ddp: raised at optimizer step"


class RepeatedFailureError(RuntimeError):
    """A worker failed the same way twice: a restart will not get past it."""


def note_step(error: BaseException, step: int) -> None:
    """Mark ``error`` with the optimizer step it interrupted (shown in its traceback)."""
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(f"{STEP_NOTE} {step}")


# What Ray raises for a rank whose process or node is gone (by name: the classes live in
# ray.exceptions and Ray Train's internals).
_LOST = ("ActorDiedError", "ActorUnavailableError", "WorkerHealthCheckFailedError")


def failure_line(worker_exceptions: dict[int, BaseException]) -> str:
    """One line on an attempt's failure, printed by Ray Train's controller: which ranks
    were lost and which failed, and the optimizer step the survivors were at."""
    lost = sorted(r for r, e in worker_exceptions.items() if type(e).__name__ in _LOST)
    failed = sorted(r for r in worker_exceptions if r not in lost)
    steps = [step_of(e) for e in worker_exceptions.values()]
    known = [s for s in steps if s is not None]
    parts = []
    if lost:
        parts.append(
            f"lost rank{'s' if len(lost) > 1 else ''} {_ranks(lost)} (process or node gone)"
        )
    if failed:
        parts.append(f"rank{'s' if len(failed) > 1 else ''} {_ranks(failed)} raised")
    where = f" at optimizer step {max(known)}" if known else ""
    return f"attempt failed{where}: {'; '.join(parts)}"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def step_of(error: BaseException) -> int | None:
    """The optimizer step :func:`note_step` marked ``error`` with, if any."""
    for note in getattr(error, "__notes__", []):
        if note.startswith(STEP_NOTE):
            return int(note.removeprefix(STEP_NOTE))
    return None


def failure_signature(error: BaseException) -> str:
    """What identifies a failure across attempts: the exception's type, message and the
    step note (Ray Train hands the controller the worker's own exception object)."""
    notes = getattr(error, "__notes__", [])
    return "\n".join([f"{type(error).__name__}: {error}", *notes])


def final_errors() -> tuple[type[Exception], ...]:
    """The errors a restart would meet again: the run stops with the first of them.
    Imported when an attempt has failed: their modules import torch, and this module is
    imported by Ray Train's controller, which otherwise has no use for torch
    (``ray_ddp.compat.local_controller``)."""
    from ray_ddp.checkpoint.format import ResumeRefusedError
    from ray_ddp.data.unreadable import BadSamplesError
    from ray_ddp.reliability.loss_guard import NonFiniteLossError

    return (NonFiniteLossError, BadSamplesError, ResumeRefusedError)


def final_message(error: BaseException, kind: type[Exception]) -> str | None:
    """``error``'s message if it is a ``kind``, or relays one (Ray may hand over a worker's
    error as its traceback's text)."""
    if isinstance(error, kind):
        return str(error)
    marker = f"{kind.__name__}: "
    for line in str(error).splitlines():
        if marker in line:
            return line.split(marker, 1)[1]
    return None


def nonfinite_loss(error: BaseException) -> str | None:
    """The message of a non-finite loss error, as the exception itself or relayed."""
    from ray_ddp.reliability.loss_guard import NonFiniteLossError

    return final_message(error, NonFiniteLossError)


def stop_hopeless_retries(run_dir: str | None = None):
    """The Ray Train callback (it runs in the controller) that applies the rules above,
    and says so when the attempt hung (the hang reports in ``run_dir``): a hang that
    repeats at the same place after the same step is not retried either."""
    from ray.train import UserCallback

    class StopHopelessRetries(UserCallback):
        def __init__(self) -> None:
            self.seen: Counter[str] = Counter()
            self.hangs: set[str] = set()
            self.attempt: set[str] = set()
            """The signatures this attempt has shown: Ray calls ``after_exception`` at
            every poll that finds errors, and while it waits out a reclaim (Ray 2.60's
            preempting state) it polls the same failed attempt several times."""

        def after_exception(self, run_context, worker_exceptions) -> None:
            signatures = {failure_signature(e) for e in worker_exceptions.values()}
            lost = {
                failure_signature(e)
                for e in worker_exceptions.values()
                if type(e).__name__ in _LOST
            }
            # A lost rank's error names its actor, new in every attempt: one already
            # shown means this is the same attempt, polled again.
            if not lost & self.attempt:
                self.attempt = set()
            elif signatures <= self.attempt:
                return
            print(failure_line(worker_exceptions), flush=True)
            for error in worker_exceptions.values():
                for kind in final_errors():
                    message = final_message(error, kind)
                    if message:
                        raise kind(message)
            new = signatures - self.attempt
            self.attempt |= signatures
            hang = latest_hang(run_dir) if run_dir else None
            if hang is not None and hang[0] not in self.hangs:  # this attempt's, not older
                self.hangs.add(hang[0])
                print(hang[0], flush=True)
                new = {hang[1]}  # the lost ranks' messages differ, the place not
            # Once per attempt: several ranks failing alike count once.
            for signature in new:
                self.seen[signature] += 1
                if self.seen[signature] >= 2:
                    shown = signature.replace("\n", " | ")
                    raise RepeatedFailureError(
                        f"the same error stopped two attempts, so it is not retried again: "
                        f"{shown}. The last checkpoint is intact: fix the cause and re-run "
                        "with the same --name"
                    )

    return StopHopelessRetries()
