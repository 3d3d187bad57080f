"""The seed workload's FLOPs, counted from the shapes (Note [Counted FLOPs]): what its
MFU divides by."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from examples.dflash.loops import Models
from examples.dflash.models import BlockDrafter, query_groups


# Note [Counted FLOPs]: MFU here is the FLOPs of both stages, counted from the shapes, over
# wall time, against the GPU's dense bf16 peak: for the FP8 rows too, where it reads as
# "bf16-equivalent" (an FP8 GEMM's peak is twice bf16's, so it can pass 100 %). FP8 rows
# also give the FP8 GEMMs' own FLOPs over wall time against the dense FP8 peak
# (limits.PEAK_FP8_FLOPS). Per microbatch of B rows of length L:
# - target forward: 2 x L x B x (weights of the linear layers it runs); each softmax
#   attention layer 2 x heads x head_dim x L^2 x B (QK^T and PV, causal half); each
#   gated-delta-rule layer (FLA's chunked kernels, chunk 64) L x B x value heads x (4 x
#   key_dim x value_dim + 128 x (key_dim + value_dim)), an estimate (5 % of GPU time);
# - drafter forward and backward, Q = anchors x block queries per row: 3 x 2 x (rows x
#   weights) for its trainable linear layers (key/value projections on L + Q rows, the rest
#   on Q), 2 x 2 x L x weights for fc (the features take no gradient); attention 3.5 x 4
#   x heads x head_dim x Q x keys (the keys of each query group, masked ones included: the
#   fused kernel computes them); the frozen head 2 x 2 x anchors x (block - 1) x dim x
#   vocab (forward and input gradient). Not counted: the optimizer, norms, gates, rotary,
#   the short convolution (elementwise, a third of the target's GPU time in a profile).
def target_shape(target: nn.Module) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(linear weights a forward runs, (attention layers, heads, head_dim), (delta-rule
    layers, value heads, key_dim, value_dim)): what target_flops counts with."""
    base = getattr(getattr(target, "model", None), "base_model", None)
    if base is not None:  # examples.dflash.hf.HFTarget: the layers up to the last capture
        cfg, run = base.config, max(target.layers) + 1  # (Note [Capture layers only])
        kinds = list(cfg.layer_types)[:run]
        attn = (kinds.count("full_attention"), cfg.num_attention_heads, cfg.head_dim)
        keys, values = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        delta = (kinds.count("linear_attention"), cfg.linear_num_value_heads, keys, values)
        linear = base.layers[:run]
    else:  # examples.dflash.models.HybridTarget: the layers up to the last capture
        cfg = target.cfg
        run = max(cfg.capture_layers) + 1
        attn = (run // cfg.attn_every, cfg.heads, cfg.head_dim)
        delta = (run - run // cfg.attn_every, cfg.heads, cfg.head_dim, cfg.head_dim)
        linear = target.layers[:run]
    return linear_weights(linear), attn, delta


def linear_weights(module: nn.Module, fp8_only: bool = False) -> int:
    """The weights of the linear layers in `module`: nn.Linear and FP8Linear (examples/
    dflash/fp8.py, named here: that module may be absent), or FP8Linear's only."""
    total = 0
    for m in module.modules():
        fp8 = type(m).__name__ == "FP8Linear"
        if fp8 or (isinstance(m, nn.Linear) and not fp8_only):
            total += m.in_features * m.out_features
    return total


def target_flops(shape: tuple, batch: int, length: int) -> float:
    weights, attn, delta = shape
    tokens = batch * length
    return (
        2 * tokens * weights
        + attn[0] * 2 * attn[1] * attn[2] * length * tokens
        + delta[0] * tokens * delta[1] * (4 * delta[2] * delta[3] + 128 * (delta[2] + delta[3]))
    )


def drafter_flops(drafter: BlockDrafter, batch: int, length: int) -> float:
    cfg, dim = drafter.cfg, drafter.fc.out_features
    n = cfg.anchors or length // cfg.block
    q = n * cfg.block
    inner, kv = cfg.heads * cfg.head_dim, cfg.kv_heads_ * cfg.head_dim
    mlp = sum(m.weight.numel() for m in drafter.layers[0].mlp.modules() if isinstance(m, nn.Linear))
    per_layer = q * (2 * dim * inner + mlp) + (length + q) * dim * 2 * kv
    keys = length + q // query_groups(cfg, n, length)
    attention = cfg.layers * 4 * inner * q * keys
    head = n * (cfg.block - 1) * drafter.lm_head.weight.numel()
    fc = length * drafter.fc.weight.numel()  # its input, the features, takes no gradient
    return batch * (6 * cfg.layers * per_layer + 4 * fc + 3.5 * attention + 4 * head)


def flop_counter(models: Models) -> Callable[[list[dict]], float]:
    """Both stages' FLOPs of a list of microbatches (Note [Counted FLOPs])."""
    shape, drafter = target_shape(models.targets[0]), models.drafters[0]
    return lambda batches: sum(
        target_flops(shape, *b["input_ids"].shape) + drafter_flops(drafter, *b["input_ids"].shape)
        for b in batches
    )


def fp8_flop_counter(models: Models) -> Callable[[list[dict]], float]:
    """The FLOPs of the target's FP8 GEMMs over a list of microbatches (0 for bf16)."""
    target = models.targets[0]
    base = getattr(getattr(target, "model", None), "base_model", None)
    run = base.layers[: max(target.layers) + 1] if base is not None else target
    weights = linear_weights(run, fp8_only=True)
    return lambda batches: sum(2 * b["input_ids"].numel() * weights for b in batches)
