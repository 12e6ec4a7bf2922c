"""Mixed precision: autocast for the forward pass, a GradScaler only for fp16."""

from __future__ import annotations

import contextlib

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(amp: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward-pass context for ``amp`` (``off`` is a no-op)."""
    if amp == "off":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[amp])


def grad_scaler(amp: str, device: torch.device) -> torch.amp.GradScaler:
    """fp16 needs loss scaling against gradient underflow; bf16 has fp32's range and does
    not. A disabled scaler passes calls straight through, so the loop has one code path."""
    return torch.amp.GradScaler(device.type, enabled=amp == "fp16")
