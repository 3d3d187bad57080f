"""DFlash's training objective as published: which block positions count, and how much.

Note [DFlash objective]: SpecForge's DFlash trainer (`OnlineDFlashModel`) and z-lab's
DFlash define the loss over a microbatch as

    loss = sum_{b, k} w[b, k] * CE(logits[b, k], x[p_b + k]) / sum_{b, k} w[b, k]
    w[b, k] = keep[b] * supervised[p_b + k] * exp(-(k - 1) / gamma),  k = 1 .. block - 1

1. A block b starts at its anchor p_b, and the whole block lies in the sequence
   (p_b + block <= length).
2. An anchor is kept only where its token and the next are supervised
   (supervised[p] and supervised[p + 1]): assistant turns count, prompts do not.
   The data draws up to `anchors` such positions per sequence (`jsonl.draw_anchors`);
   when a sequence has fewer, the rest are fillers that `anchor_mask` marks 0.
3. supervised[t] is the data's loss mask (1 on assistant tokens), 0 at or past a row's
   real length (padding, Note [Padding contract]): a masked label adds nothing.
4. Slot 0 (the anchor itself, given as input) is not predicted; slot k is weighted by
   exp(-(k - 1) / gamma): 1 for the first prediction, decaying along the block.
   DFlash's defaults: gamma = 7 at block 16, 4 at block 8 (`default_gamma`).
5. The normalisation is the sum of the weights, counted on the device: a padded
   microbatch has the unpadded one's loss.
"""

from __future__ import annotations

import torch

# DFlash's published gamma per block size (SpecForge's recipes; z-lab's DFlash).
PUBLISHED_GAMMA = {8: 4.0, 16: 7.0}


def default_gamma(block: int) -> float:
    """The published gamma for `block`, elsewhere the line through the published points
    (3 * block / 8 + 1: 2.5 at block 4)."""
    return PUBLISHED_GAMMA.get(block, 3 * block / 8 + 1)


def position_weights(block: int, gamma: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """exp(-(k - 1) / gamma) for the predicted slots k = 1 .. block - 1, [block - 1] fp32."""
    if gamma <= 0:
        raise ValueError(f"expected gamma > 0, got {gamma}")
    k = torch.arange(1, block, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def supervised_positions(
    input_ids: torch.Tensor, loss_mask: torch.Tensor | None, lengths: torch.Tensor | None
) -> torch.Tensor:
    """[B, T] bool: the loss mask (every position without one), cut at each row's length."""
    batch, length = input_ids.shape
    if loss_mask is None:
        supervised = torch.ones(batch, length, dtype=torch.bool, device=input_ids.device)
    else:
        supervised = loss_mask != 0
    if lengths is not None:
        positions = torch.arange(length, device=input_ids.device)
        supervised = supervised & (positions < lengths[:, None])
    return supervised


def block_weights(
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    block: int,
    gamma: float,
    *,
    loss_mask: torch.Tensor | None = None,
    anchor_mask: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight of every predicted label, [B, n, block - 1], summing to 1 (or all 0 when
    nothing is supervised): Note [DFlash objective].

    Args:
        input_ids: [B, T] tokens.
        anchors: [B, n] anchor positions (fillers anywhere in [0, T)).
        block: the drafter's block size.
        gamma: the decay of the slot weights.
        loss_mask: [B, T], nonzero where a token is supervised; None: every token.
        anchor_mask: [B, n], nonzero for a real anchor, 0 for a filler; None: all real.
        lengths: [B] real lengths of a right-padded microbatch; None: all of T.
    """
    batch, length = input_ids.shape
    supervised = supervised_positions(input_ids, loss_mask, lengths)
    # A whole block in the sequence: its labels p + 1 .. p + block - 1 exist.
    real_length = length if lengths is None else lengths[:, None]
    keep = (anchors + block <= real_length) & (anchors >= 0)
    safe = anchors.clamp(0, length - 1)
    after = (safe + 1).clamp(max=length - 1)
    keep = keep & supervised.gather(1, safe) & supervised.gather(1, after)
    if anchor_mask is not None:
        keep = keep & (anchor_mask != 0)
    offsets = torch.arange(1, block, device=anchors.device)
    label_positions = (anchors[:, :, None] + offsets).clamp(0, length - 1).view(batch, -1)
    labelled = supervised.gather(1, label_positions).view(batch, -1, block - 1)
    weights = position_weights(block, gamma, anchors.device) * (labelled & keep[..., None])
    return weights / weights.sum().clamp_min(torch.finfo(weights.dtype).tiny)
