"""A weighted cross entropy over a large vocabulary that never holds all the logits.

    loss = linear_cross_entropy(hidden, head_weight, labels, weights, chunk=1024)
    # == (F.cross_entropy(hidden @ head_weight.T, labels, reduction="none") * weights).sum()

At the DFlash recipe's shapes (2 x 256 anchors x 15 predicted positions = 7,680 rows, a
151,936-token vocabulary) the [rows x vocab] logits are 4.7 GB in fp32, as much again
for their gradient. Here the rows go through in chunks: each chunk's logits (bf16 matmul,
fp32 accumulation), its softmax in fp32, its loss, and straight away the gradient of the
loss with respect to the chunk's hidden states (and the head's weight, when it trains).
Only that gradient, [rows x hidden], is kept for the backward, which scales it by the
incoming gradient: the logits are computed once and never stored.

Note [Loss without logsumexp]: each row's loss is lse - z_y. The fp32 softmax p is
needed for the gradient anyway, and the row's largest logit z_m has p_m = exp(z_m - lse)
>= 1/vocab, which cannot underflow; so lse = z_m - log p_m costs an argmax and two
gathers instead of another pass over the chunk.

Rows whose label is `ignore_index` (or whose weight is 0) add nothing. Shapes do not
depend on the data and nothing syncs with the host, so the loss can be captured in a
CUDA graph with the rest of the drafter's step.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        row_weights: torch.Tensor,
        chunk: int,
        ignore_index: int,
    ) -> torch.Tensor:
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        rows = hidden.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32, or fp64 in tests
        valid = labels != ignore_index
        row_weights = torch.where(valid, row_weights.to(acc), 0)
        safe = torch.where(valid, labels, 0)
        total = hidden.new_zeros((), dtype=acc)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=acc) if need_weight else None
        kind = hidden.device.type
        with torch.autocast(kind, enabled=False) if kind in ("cpu", "cuda") else nullcontext():
            for lo in range(0, rows, chunk):
                hi = min(lo + chunk, rows)
                h, y, w = hidden[lo:hi], safe[lo:hi, None], row_weights[lo:hi, None]
                logits = h @ weight.t()  # [c, vocab] in the inputs' dtype
                p = torch.softmax(logits, dim=-1, dtype=acc)
                top = logits.argmax(dim=-1, keepdim=True)
                lse = logits.gather(1, top).to(acc) - p.gather(1, top).log()
                losses = lse - logits.gather(1, y).to(acc)  # Note [Loss without logsumexp]
                total = total + (losses * w).sum()
                if grad_hidden is None and grad_weight is None:
                    continue
                # d loss / d logits = w * (softmax - onehot(y))
                p.scatter_add_(1, y, torch.full_like(w, -1.0))
                grad_logits = torch.mul(p, w, out=torch.empty_like(logits))
                if grad_hidden is not None:
                    torch.mm(grad_logits, weight, out=grad_hidden[lo:hi])
                if grad_weight is not None:
                    grad_weight += (grad_logits.t() @ h).to(acc)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple:
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_total.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_total).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    chunk: int = 1024,
    ignore_index: int = -100,
) -> torch.Tensor:
    """sum_i weights[i] * cross_entropy(hidden[i] @ weight.T, labels[i]), in chunks of
    `chunk` rows.

    Args:
        hidden: [rows, dim], the head's input.
        weight: [vocab, dim], the head's weight (no bias); gets a gradient when it
            requires one.
        labels: [rows], int64; rows equal to `ignore_index` count for nothing.
        weights: [rows], each row's weight in the sum (default 1).
        chunk: rows per chunk; the peak extra memory is about chunk x vocab x 10 bytes.
        ignore_index: the label of rows to leave out.
    """
    hidden, weights = _checked(hidden, weight, labels, weights, chunk)
    return _LinearCrossEntropy.apply(hidden, weight, labels, weights, chunk, ignore_index)


def _checked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both kernels' arguments checked: the hidden states in the head's dtype, and the row
    weights (default 1)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [rows, dim] and weight [vocab, dim], got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"expected labels [{hidden.shape[0]}], got {tuple(labels.shape)}")
    if chunk < 1:
        raise ValueError(f"expected chunk >= 1, got {chunk}")
    if weights is None:
        weights = torch.ones(labels.shape, device=hidden.device)
    return hidden.to(weight.dtype), weights


def liger_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    chunk: int = 1024,
    ignore_index: int = -100,
) -> torch.Tensor:
    """`linear_cross_entropy` through liger-kernel's LigerFusedLinearCrossEntropyLoss
    (Triton, CUDA only; `chunk` is liger's own choice and ignored here). The per-row
    weights need its reduction="none", whose backward recomputes each chunk's logits
    (a third head matmul), and its forward counts the rows with a host sync (.item()),
    so a graph drafter runs this loss eagerly."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError as exc:
        raise ModuleNotFoundError(
            "the liger loss kernel needs liger-kernel: pip install liger-kernel", name=exc.name
        ) from exc
    hidden, weights = _checked(hidden, weight, labels, weights, chunk)
    loss = LigerFusedLinearCrossEntropyLoss(
        ignore_index=ignore_index, reduction="none", accum_dtype=torch.float32
    )
    return (loss(weight, hidden, labels).float() * weights).sum()


# The head + cross entropy kernels a drafter can use (DrafterConfig.loss_kernel).
KERNELS = {"chunked": linear_cross_entropy, "liger": liger_linear_cross_entropy}
