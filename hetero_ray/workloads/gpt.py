"""A small GPT-style language model trained on the Python standard library's own sources.

The corpus is on every machine that has Python, so the demo needs no download.
Tokens are bytes (vocabulary 256): no tokenizer to fetch either.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from hetero_ray.workloads.base import Layered, Workload


def stdlib_corpus(max_bytes: int) -> bytes:
    """The first ``max_bytes`` of the standard library's ``.py`` files, in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


class ByteWindows(Dataset):
    """Non-overlapping windows of ``block_size + 1`` bytes: (input, next-byte target)."""

    def __init__(self, data: bytes, block_size: int):
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range (dataset has {len(self)})")
        chunk = self.tokens[i * self.block_size : (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(n_embd)
        # No bias: the key bias has an exactly-zero gradient (softmax ignores a shift), and
        # Adam would turn its rounding noise into full-size steps.
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class Embed(nn.Module):
    """Token plus position embeddings: the first pipeline layer."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))  # (B, T, C)


class Head(nn.Module):
    """Final norm and vocabulary projection: the last pipeline layer."""

    def __init__(self, n_embd: int, vocab_size: int):
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))  # (B, T, vocab)


class GPT(nn.Module):
    """Decoder-only transformer (nanoGPT layout, no dropout so runs are deterministic)."""

    def __init__(self, *, n_layer: int, n_head: int, n_embd: int, block_size: int, vocab_size: int = 256):
        super().__init__()
        self.embed = Embed(vocab_size, block_size, n_embd)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head) for _ in range(n_layer)))
        self.out = Head(n_embd, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.embed(idx)))

    def layers(self) -> list[nn.Module]:
        """Embedding, each block, head: the units a pipeline stage holds a range of."""
        return [self.embed, *self.blocks, self.out]


def byte_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next byte over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def next_byte_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the next byte over every position of the batch."""
    x, y = batch
    return byte_cross_entropy(model(x), y)


LAYERED = Layered(
    layers=GPT.layers, inputs=lambda batch: batch[0], targets=lambda batch: batch[1], output_loss=byte_cross_entropy
)


def build(
    *,
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 64,
    block_size: int = 64,
    corpus_bytes: int = 1_000_000,
) -> Workload:
    """The demo workload: a GPT of the given size on ``corpus_bytes`` of stdlib sources.

    Initial weights come from torch's global RNG, which the runtime seeds.
    """
    if n_embd % n_head:
        raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
    model = GPT(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size)
    return Workload(
        model=model,
        loss_fn=next_byte_loss,
        dataset=ByteWindows(stdlib_corpus(corpus_bytes), block_size),
        layered=LAYERED,
    )
