"""A causal language model trained by a loop of its own, its loss weighted by tokens
(``docs/own-loop.md``).

Sequences of 6 to 40 tokens from a small random Markov chain (the same from the seed on
every worker, nothing downloaded), padded per micro-batch. A micro-batch's loss is the
``Sum`` of its tokens' negative log-likelihoods over its token count: the step's gradient
is then the mean over every token of the step, however the ranks and micro-batches split
its sequences (a mean per sequence, or per micro-batch, would weigh a short sequence's
tokens more). The registered states are the model, its optimizer and its schedule.

    python examples/own_loop/lm.py --num-workers 2 --batch-size 8 --epochs 2 --name lm
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import ray_ddp  # noqa: E402

VOCAB = 24
PAD = -100  # a target the loss ignores


def sequences(seed: int, count: int, split: int) -> list[torch.Tensor]:
    """``count`` token sequences of 6-40 tokens from the Markov chain of ``seed``; each
    ``split`` (0: train, 1: validation) its own draws from it."""
    chain = torch.Generator().manual_seed(seed)
    transitions = torch.softmax(3 * torch.randn(VOCAB, VOCAB, generator=chain), dim=1)
    generator = torch.Generator().manual_seed(seed * 2 + 1 + split)
    out = []
    for _ in range(count):
        length = int(torch.randint(6, 41, (1,), generator=generator))
        tokens = [int(torch.randint(VOCAB, (1,), generator=generator))]
        for _ in range(length - 1):
            tokens.append(int(torch.multinomial(transitions[tokens[-1]], 1, generator=generator)))
        out.append(torch.tensor(tokens))
    return out


def collate(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, padded to the longest sequence (targets with PAD)."""
    longest = max(len(s) for s in samples) - 1
    inputs = torch.zeros(len(samples), longest, dtype=torch.long)
    targets = torch.full((len(samples), longest), PAD, dtype=torch.long)
    for row, sample in enumerate(samples):
        inputs[row, : len(sample) - 1] = sample[:-1]
        targets[row, : len(sample) - 1] = sample[1:]
    return inputs, targets


class TinyLM(nn.Module):
    """An embedding, a GRU (causal: each position sees only those before it), a head."""

    def __init__(self, width: int = 48) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(tokens))[0])


def token_nll(model: nn.Module, batch) -> ray_ddp.Sum:
    """The batch's summed negative log-likelihood over its real tokens, and their count."""
    inputs, targets = batch
    logits = model(inputs).float()
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=PAD,
                            reduction="sum")  # fmt: skip
    return ray_ddp.Sum(total, (targets != PAD).sum())


def train(run: ray_ddp.Run) -> None:
    cfg = run.config
    train_set = sequences(cfg.optim.seed, cfg.data.train_samples or 1024, 0)
    val_set = sequences(cfg.optim.seed, cfg.data.val_samples or 256, 1)
    model = run.setup(TinyLM())
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=0.9)
    warmup = 10
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    run.register(model=model, optimizer=optimizer, schedule=schedule)
    for _epoch in run.epochs():
        for micro in run.batches(train_set, collate):
            run.backward(token_nll(model, micro.data), micro)
            if micro.closes_step:
                run.step(optimizer, schedules=[schedule])
        scores = run.evaluate(model, val_set, lambda m, b: {"loss": token_nll(m, b)}, collate)
        run.report({"val_loss": scores["loss"], "val_perplexity": math.exp(scores["loss"])})


def main(argv: list[str] | None = None) -> int:
    return ray_ddp.main(train, argv, lr=0.5, batch_size=8, epochs=2, train_samples=1024,
                        val_samples=256)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
