"""Synthetic token data: no downloads, and a drafter has something to learn."""

from __future__ import annotations

from collections.abc import Iterator

import torch


class MarkovTokens:
    """Sequences from a fixed random sparse Markov chain: each token has `branch`
    possible successors with skewed probabilities, so the next tokens are partly
    predictable and a drafter's loss falls as it learns the chain. Batch `index` is a
    pure function of (seed, index): any process or loop sees the same data.

    With `anchors` (and the drafter's `block`), each batch also has `anchors` [B, seq]:
    per sequence, `anchors` distinct positions p <= seq - block (a whole block after
    each), drawn uniformly and sorted, in the first `anchors` entries; the rest is 0.
    It is [B, seq] so that it travels through a target stage with the tokens, as
    TargetGraphs pads every tensor of a batch along the sequence. The draws come from
    this batch's own generator: the anchors are as reproducible as the tokens, and no
    pipeline stage touches torch's global RNG (Note [Pipeline order])."""

    def __init__(
        self,
        vocab: int,
        seq: int,
        batch: int,
        *,
        seed: int = 0,
        branch: int = 4,
        anchors: int | None = None,
        block: int | None = None,
    ) -> None:
        if vocab < 2 or seq < 2 or batch < 1 or branch < 1:
            raise ValueError(
                f"expected vocab >= 2, seq >= 2, batch >= 1, branch >= 1, got "
                f"{vocab}, {seq}, {batch}, {branch}"
            )
        if anchors is not None:
            if block is None or block < 2:
                raise ValueError(f"expected block >= 2 with anchors, got {block}")
            if not 1 <= anchors <= seq - block + 1:
                raise ValueError(
                    f"expected 1 <= anchors <= seq - block + 1 = {seq - block + 1}, got {anchors}"
                )
        self.vocab, self.seq, self.batch_size, self.seed = vocab, seq, batch, seed
        self.anchors, self.block = anchors, block
        g = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, vocab, (vocab, branch), generator=g)
        weights = torch.rand(vocab, branch, generator=g) ** 3
        self.cumulative = (weights / weights.sum(-1, keepdim=True)).cumsum(-1)
        self.cumulative[:, -1] = 1.0

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        tokens = torch.empty(self.batch_size, self.seq, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab, (self.batch_size,), generator=g)
        draws = torch.rand(self.batch_size, self.seq - 1, generator=g)
        for t in range(1, self.seq):
            previous = tokens[:, t - 1]
            choice = (draws[:, t - 1, None] > self.cumulative[previous]).sum(-1)
            tokens[:, t] = self.successors[previous, choice]
        if self.anchors is None:
            return {"input_ids": tokens}
        return {"input_ids": tokens, "anchors": self.anchor_positions(index)}

    def tokens(self, index: int) -> int:
        """Batch `index`'s tokens (every one real)."""
        return self.batch_size * self.seq

    def anchor_positions(self, index: int) -> torch.Tensor:
        """Batch `index`'s anchors, [B, seq] (see the class)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index + (1 << 40))
        valid = self.seq - self.block + 1
        out = torch.zeros(self.batch_size, self.seq, dtype=torch.long)
        for row in out:
            row[: self.anchors] = torch.randperm(valid, generator=g)[: self.anchors].sort().values
        return out

    def batches(self, start: int, count: int, stride: int = 1, *, pin: bool = False) -> list[dict]:
        """Batches start, start + stride, ... (count of them), made up front so data
        generation stays out of the timed loop."""
        out = [self.batch(start + i * stride) for i in range(count)]
        if pin:
            out = [{key: t.pin_memory() for key, t in b.items()} for b in out]
        return out

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        index = 0
        while True:
            yield self.batch(index)
            index += 1
