"""Stop on a non-finite training loss, naming the step and the rank, before it can reach
a checkpoint.

On CPU the loss is checked as it is computed (a free host read). On a GPU a host read
every micro-step would stall the pipeline, so the first bad step is recorded on the device
and read every ``check_every`` optimizer steps and before every checkpoint; the weights
may go bad in between, but they are never saved (every rank passes this check before the
all-gather that precedes a checkpoint write). fp16 steps skipped by the GradScaler have a
finite loss (the overflow is in the gradients) and never trip this.
"""

from __future__ import annotations

import torch


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite."""


class LossGuard:
    def __init__(
        self, device: torch.device, rank: int, check_every: int, eager: bool | None = None
    ) -> None:
        """``eager``: check every loss as it comes (default: on CPU, where it is free)."""
        self.rank = rank
        self.eager = device.type == "cpu" if eager is None else eager
        self.check_every = check_every
        self.first_bad: torch.Tensor | None = (
            None if self.eager else torch.full((), -1, device=device)
        )

    def observe(self, loss: torch.Tensor, step: int, where: str) -> None:
        """``loss`` of a micro-batch of optimizer step ``step`` (1-based)."""
        if self.eager:
            if not torch.isfinite(loss).item():
                self._fail(step, f" ({loss.item()}, {where})")
            return
        assert self.first_bad is not None  # kept on the device unless eager
        bad = ~torch.isfinite(loss.detach())
        self.first_bad = torch.where(bad & (self.first_bad < 0), step, self.first_bad)

    def check(self) -> None:
        """Raise if a non-finite loss was recorded (a host read on GPU)."""
        if self.first_bad is not None and (step := int(self.first_bad.item())) >= 0:
            self._fail(step, "")

    def maybe_check(self, step: int) -> None:
        if step % self.check_every == 0:
            self.check()

    def _fail(self, step: int, detail: str) -> None:
        raise NonFiniteLossError(
            f"non-finite training loss at optimizer step {step} on rank {self.rank}{detail}; "
            "the run stopped and its last checkpoint is intact. Lower --lr, set --grad-clip, "
            "or use --amp bf16 / off"
        )


def nonfinite_message(error: BaseException) -> str | None:
    """Our message, if a worker's error (as Ray relays it, traceback and all) is one."""
    for line in str(error).splitlines():
        if f"{NonFiniteLossError.__name__}: " in line:
            return line.split(f"{NonFiniteLossError.__name__}: ", 1)[1]
    return None
