"""A small test trainer shared by the reconstruction and snapshot-free publishing tests.

Models whose initial values are where a reconstruction of AdamW's previous weights is hardest
(LayerNorm weights at 1, zero-initialised biases, small matrices), two param groups, a warm-up
+ cosine schedule, deterministic token batches, and the bf16 words of a tensor (torch's own
cast: the reference every test compares against). Importing this module imports torch: import
it after ``pytest.importorskip("torch")``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

nn = torch.nn

#: The three ``torch.optim.AdamW`` implementations, by the keyword arguments that choose them.
IMPLS: dict[str, dict[str, bool]] = {
    "foreach": {"foreach": True},
    "fused": {"fused": True},
    "single": {"foreach": False},
}


class TinyLM(nn.Module):  # type: ignore[misc]
    """Embedding, pre-LN MLP blocks (LayerNorm weights 1, zero biases), a head with a zero
    bias: the shapes and initial values where a reconstruction is hardest."""

    def __init__(self, vocab: int, dim: int, hidden: int, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)
            )
            for _ in range(blocks)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)

    @property
    def vocab(self) -> int:
        return int(self.embed.num_embeddings)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens[:, :-1])
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(self.norm(h))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


class Block(nn.Module):  # type: ignore[misc]
    """A pre-LN transformer block: causal multi-head self-attention (fused q/k/v projection
    with a bias), then a GELU MLP; every Linear has a zero-initialised bias."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        h = h + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return h + self.down(nn.functional.gelu(self.up(self.ln2(h))))


class TinyTransformer(nn.Module):  # type: ignore[misc]
    """A decoder-only transformer: token and position embeddings, ``blocks`` pre-LN blocks, a
    final LayerNorm and an output head tied to the token embedding (``tied=True``; else its own
    matrix). LayerNorm weights start at 1 and biases at 0; matrices are N(0, 0.02)."""

    def __init__(
        self,
        vocab: int = 2048,
        dim: int = 256,
        heads: int = 4,
        hidden: int = 1024,
        blocks: int = 2,
        context: int = 64,
        tied: bool = True,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
        if tied:
            self.head.weight = self.embed.weight

    @property
    def vocab(self) -> int:
        return int(self.embed.num_embeddings)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs = tokens[:, :-1]
        positions = torch.arange(inputs.shape[1], device=tokens.device)
        h = self.embed(inputs) + self.pos(positions)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def words(t: torch.Tensor) -> np.ndarray:
    """bf16 words of a tensor, flat (torch's own cast, the reference)."""
    return (
        t.detach().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(-1).copy()
    )


def groups(model: nn.Module, lr: float, wd: float) -> list[dict[str, object]]:
    """Two param groups: matrices with weight decay, vectors (biases, LayerNorm) without
    decay at half the lr."""
    mats = [p for p in model.parameters() if p.dim() > 1]
    vecs = [p for p in model.parameters() if p.dim() <= 1]
    return [
        {"params": mats, "lr": lr, "weight_decay": wd},
        {"params": vecs, "lr": lr / 2, "weight_decay": 0.0},
    ]


def warmup_cosine(steps: int) -> Callable[[int], float]:
    """The lr factor of step ``i`` (from 0) of ``steps``: linear warm-up over the first tenth,
    then a cosine decay (for ``torch.optim.lr_scheduler.LambdaLR``)."""
    warm = max(1, steps // 10)
    return lambda i: (i + 1) / warm if i < warm else 0.5 * (1 + math.cos(math.pi * i / steps))


def batches(vocab: int, shape: tuple[int, int], seed: int = 1) -> Callable[[], torch.Tensor]:
    """Deterministic token batches of ``shape`` (batch, sequence + 1): the same sequence of
    batches for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return lambda: torch.randint(0, vocab, shape, generator=gen)
