"""A small byte-level causal language model as a ray_ddp task.

The corpus is the English documentation that ships with every CPython
(``pydoc_data.topics``: the language reference's topics, ~465 KB), so nothing is downloaded
and every worker on every node has the same text. The model is a GPT-style decoder (pre-norm
blocks, causal self-attention, learned positions, tied input/output embedding) over bytes:
vocabulary 256, no tokenizer, no vocab file.

    python jobs/train.py --task examples.char_lm:CharLM --num-workers 2 --epochs 3
    python jobs/train.py --task examples.char_lm:TINY ...      # a smaller variant

Data: the topics in sorted order, joined by blank lines, UTF-8 encoded; the first 90% of the
bytes is the training split, the last 10% the validation split (contiguous, so no validation
text is ever trained on). Each split is chopped into non-overlapping blocks of ``block``
predictions: a sample is ``block + 1`` bytes, input ``x = bytes[:-1]``, target
``y = bytes[1:]``. Every sample has the same number of tokens, so the mean loss over samples
(the Task contract) is the mean over tokens, and the validation loss summed over tokens and
divided once is exactly the per-token NLL of the whole validation split.

The architecture lives in ``facts`` (``describe``), not only in the task object: facts are
saved in every checkpoint, so evaluation and export rebuild the same model whichever
instance (``CharLM()``, ``TINY``) trained it, and a resume with another shape is refused.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ray_ddp import Sum, Task

VOCAB = 256
VAL_FRACTION = 0.1


# ---------------------------------------------------------------------- the data
def corpus_bytes() -> torch.Tensor:
    """The whole corpus as a uint8 tensor (deterministic for a given Python version)."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    text = "\n\n".join(topics[key] for key in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def split_bytes(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val): the first 90% and the last 10% of the bytes."""
    cut = int(len(data) * (1 - VAL_FRACTION))
    return data[:cut], data[cut:]


class Blocks(Dataset):
    """Non-overlapping windows of ``block + 1`` bytes (consecutive windows share one byte,
    so every byte after the first is a target exactly once); ``limit`` keeps that many
    windows, evenly spread over the split."""

    def __init__(self, data: torch.Tensor, block: int, limit: int | None = None) -> None:
        self.data = data
        self.block = block
        count = (len(data) - 1) // block
        if limit is not None and limit < count:
            self.starts = torch.linspace(0, count - 1, limit).round().long() * block
        else:
            self.starts = torch.arange(count) * block

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.starts[index])
        chunk = self.data[start : start + self.block + 1].long()
        return chunk[:-1], chunk[1:]


# ---------------------------------------------------------------------- the model
class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class ByteGPT(nn.Module):
    """Bytes (batch, time) -> next-byte logits (batch, time, 256)."""

    def __init__(self, block: int, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
        self.block_size = block
        self.embed = nn.Embedding(VOCAB, d_model)
        self.position = nn.Parameter(torch.zeros(block, d_model))
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied input/output embedding
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.dim() >= 2:
                # GPT-2's init; residual projections scaled down by depth
                std = (
                    0.02 / math.sqrt(2 * layers)
                    if name.endswith(("proj.weight", "2.weight"))
                    else 0.02
                )
                nn.init.normal_(param, 0.0, std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# ---------------------------------------------------------------------- sampling
@torch.no_grad()
def sample(
    model: nn.Module, prompt: str, length: int, seed: int = 0, temperature: float = 0.8
) -> str:
    """``prompt`` continued by ``length`` sampled bytes (decoded as UTF-8, bad bytes
    replaced), drawn with a generator seeded by ``seed``: the same model, prompt and seed
    give the same text. The context is cropped to the model's block size."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    block = model.block_size
    generator = torch.Generator().manual_seed(seed)
    tokens = list(prompt.encode("utf-8")) or [ord("\n")]
    for _ in range(length):
        context = torch.tensor([tokens[-block:]], dtype=torch.long, device=device)
        logits = model(context)[0, -1].float().cpu()
        if temperature <= 0:
            tokens.append(int(logits.argmax()))
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
    model.train(was_training)
    return bytes(tokens).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------- the task
class CharLM(Task):
    """Next-byte prediction on Python's documentation; reports loss (NLL per byte, nats),
    perplexity, bits per byte and next-byte accuracy on the validation split."""

    best_metric = "loss"
    best_mode = "min"

    def __init__(
        self,
        block: int = 64,
        d_model: int = 128,
        layers: int = 2,
        heads: int = 4,
        prompt: str = "The ",
        report_samples: int = 3,
        report_length: int = 160,
        temperature: float = 0.8,
    ) -> None:
        self.block = block
        self.d_model = d_model
        self.layers = layers
        self.heads = heads
        self.prompt = prompt
        self.report_samples = report_samples
        self.report_length = report_length
        self.temperature = temperature

    def name(self, cfg: Any) -> str:
        return f"char_lm-{self.layers}x{self.d_model}"

    def describe(self, cfg: Any) -> dict[str, Any]:
        return {
            "vocab": VOCAB,
            "block": self.block,
            "d_model": self.d_model,
            "layers": self.layers,
            "heads": self.heads,
        }

    def datasets(self, cfg: Any, facts: dict[str, Any]) -> tuple[Dataset, Dataset]:
        train, val = split_bytes(corpus_bytes())
        block = facts.get("block", self.block)
        return Blocks(train, block, cfg.data.train_samples), Blocks(
            val, block, cfg.data.val_samples
        )

    def model(self, cfg: Any, facts: dict[str, Any]) -> nn.Module:
        shape = {**self.describe(cfg), **facts}
        return ByteGPT(shape["block"], shape["d_model"], shape["layers"], shape["heads"])

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        logits = model(inputs).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    def metrics(self, model: nn.Module, batch: Any) -> dict[str, Sum]:
        inputs, targets = batch
        logits = model(inputs).float()
        nll = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")
        correct = (logits.argmax(-1) == targets).sum()
        return {"loss": Sum(nll, targets.numel()), "acc": Sum(correct, targets.numel())}

    def summarize(self, values: dict[str, float]) -> dict[str, float]:
        return {
            **values,
            "perplexity": math.exp(min(values["loss"], 700.0)),
            "bpb": values["loss"] / math.log(2),
        }

    def param_groups(self, model: nn.Module, cfg: Any) -> list[dict[str, Any]]:
        """Weight decay on the matrices of the linear layers only (not on biases, norms,
        positions or the embedding)."""
        decay = [
            p
            for n, p in model.named_parameters()
            if n.endswith("weight") and p.dim() == 2 and not n.startswith(("embed", "head"))
        ]
        chosen = {id(p) for p in decay}
        rest = [p for p in model.parameters() if id(p) not in chosen]
        return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]

    def random_samples(self, cfg: Any) -> bool:
        return False  # fixed windows, no augmentation

    def example_inputs(self, cfg: Any, facts: dict[str, Any]) -> tuple:
        return (torch.zeros(2, facts.get("block", self.block), dtype=torch.long),)

    def final_report(self, model: nn.Module, cfg: Any) -> str | None:
        """A few sampled continuations of ``prompt`` by the best checkpoint's model."""
        if self.report_samples <= 0:
            return None
        lines = [
            f"[{i}] "
            + sample(
                model, self.prompt, self.report_length, seed=i, temperature=self.temperature
            ).replace("\n", " / ")
            for i in range(self.report_samples)
        ]
        return f"samples (prompt {self.prompt!r}, temperature {self.temperature}):\n" + "\n".join(
            lines
        )


TINY = CharLM(d_model=64, layers=1, heads=4)
"""A one-layer variant, for quick smoke runs (``--task examples.char_lm:TINY``)."""
