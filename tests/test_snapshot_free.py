"""The snapshot-free publisher (``snapshot="none"``): exact receivers without a copy of the
model, its gates and fallbacks, digests that catch a wrong reconstruction.

Small models, a few dozen AdamW steps each; every published version is compared bit-wise
(int16 views) with torch's bf16 cast of the trainer's parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from deltastore import Publisher, Subscriber  # noqa: E402
from deltastore.publish.digests import BLOCK  # noqa: E402

nn = torch.nn


class Net(nn.Module):  # type: ignore[misc]
    """Embedding, LayerNorm (weights 1), two Linear layers with zero biases, a buffer."""

    def __init__(self, vocab: int = 64, dim: int = 48, hidden: int = 96) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, vocab)
        for lin in (self.up, self.down):
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)
        self.register_buffer("scale", torch.ones(vocab))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(tokens[:, :-1]))
        logits = self.down(torch.nn.functional.gelu(self.up(h))) * self.scale
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def batch(step: int, vocab: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (8, 17), generator=g)


def train_step(net: Net, opt: torch.optim.Optimizer, step: int) -> None:
    opt.zero_grad()
    net.loss(batch(step)).backward()
    opt.step()


def expected(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """What a receiver must hold: torch's bf16 cast of float32 tensors, others as they are."""
    out = {}
    for name, t in tensors.items():
        t = t.detach()
        if t.dtype == torch.float32:
            t = t.to(torch.bfloat16)
        out[name] = t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)
    return {n: t.numpy().copy() for n, t in out.items()}


def assert_exact(sub: Subscriber, tensors: dict[str, torch.Tensor], version: int) -> None:
    sub.sync()
    assert sub.version == version
    held = sub.tensors
    assert held is not None
    for name, want in expected(tensors).items():
        got = held[name].contiguous()
        got = got.view(torch.int16 if got.element_size() == 2 else torch.int32).numpy()
        assert np.array_equal(got, want), f"{name} differs at version {version}"


def setup(
    tmp_path: Path, make_opt: Callable[[Any], torch.optim.Optimizer] | None = None, **options: Any
) -> tuple[Net, torch.optim.Optimizer, Publisher, Subscriber]:
    torch.manual_seed(0)
    net = Net()
    opt = (
        make_opt(net.parameters())
        if make_opt is not None
        else torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.1, foreach=True)
    )
    options.setdefault("max_frame_bytes", 8192)  # several frames and blocks per tensor
    pub = Publisher(tmp_path, snapshot="none", optimizer=opt, **options)
    return net, opt, pub, Subscriber(tmp_path)


def published(net: Net) -> dict[str, torch.Tensor]:
    return dict(net.named_parameters())


def test_bit_exact_foreach_adamw(tmp_path: Path) -> None:
    net, opt, pub, sub = setup(tmp_path)
    first = pub.publish(published(net), version=1)
    assert first.kind == "anchor" and first.snapshot_free is not None
    assert first.snapshot_free.reconstructed == 0
    assert_exact(sub, published(net), 1)
    uncertain = 0
    for v in range(2, 26):
        train_step(net, opt, v)
        report = pub.publish(published(net), version=v)
        stats = report.snapshot_free
        assert report.kind == "delta" and stats is not None
        assert stats.blocks_raw == 0 and not stats.absolute and not stats.snapshots
        assert stats.reconstructed == len(published(net))
        assert stats.blocks_verified > 0
        uncertain += stats.uncertain
        assert_exact(sub, published(net), v)
    assert uncertain > 0  # the zero biases of the first step at least


def test_no_copy_of_reconstructed_tensors(tmp_path: Path) -> None:
    net, opt, pub, _ = setup(tmp_path)
    pub.publish(published(net), version=1)
    train_step(net, opt, 2)
    pub.publish(published(net), version=2)
    held = pub._held.tensors
    assert held is not None
    assert all(s.words.size == 0 for s in held.values())
    digests = pub._snapfree.digests  # type: ignore[union-attr]
    total = sum(p.numel() for p in net.parameters())
    assert sum(d.nbytes for d in digests.values()) <= total * 2 / BLOCK * 4 + 8 * len(digests)


def test_v1_codecs_and_missing_optimizer_refused(tmp_path: Path) -> None:
    net = Net()
    opt = torch.optim.AdamW(net.parameters())
    with pytest.raises(ValueError, match="xor-patch"):
        Publisher(tmp_path, snapshot="none", optimizer=opt, codecs="v1")
    with pytest.raises(ValueError, match="optimizer="):
        Publisher(tmp_path, snapshot="none")
    with pytest.raises(ValueError, match="snapshot='none'"):
        Publisher(tmp_path, optimizer=opt)
