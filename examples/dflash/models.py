"""A small Qwen3-Next-style hybrid target and a DFlash-style block drafter.

Target: token embedding, then layers that are gated-delta-rule linear attention except
every `attn_every`-th, which is gated softmax attention; each layer is pre-norm with a
SwiGLU MLP. Its forward returns the hidden states of `capture_layers`, concatenated:
what the drafter is conditioned on.

Drafter (after DFlash, block diffusion drafting): for each anchor position p it
predicts the `block - 1` tokens after x_p in one parallel pass. A block's input is
[embed(x_p), mask, ..., mask]; each drafter layer attends from the block to the
target's context features at positions <= p and, bidirectionally, to its own block.
Embedding and LM head are frozen copies of the target's.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .gated_delta import gated_delta_rule


@dataclass(frozen=True)
class TargetConfig:
    vocab: int = 4096
    dim: int = 1024
    layers: int = 12
    attn_every: int = 4  # layer i is softmax attention when (i + 1) % attn_every == 0
    heads: int = 8
    head_dim: int = 128
    mlp_ratio: float = 3.0
    conv_size: int = 4
    capture_layers: tuple[int, ...] = (1, 5, 9)

    def __post_init__(self) -> None:
        bad = [i for i in self.capture_layers if not 0 <= i < self.layers]
        if bad or not self.capture_layers:
            raise ValueError(
                f"expected capture_layers in [0, {self.layers}), got {self.capture_layers}"
            )

    def build(self, dtype: torch.dtype = torch.float32) -> HybridTarget:
        return HybridTarget(self).to(dtype)


@dataclass(frozen=True)
class DrafterConfig:
    layers: int = 1
    heads: int = 8
    head_dim: int = 128
    mlp_ratio: float = 3.0
    block: int = 8  # tokens per block: the anchor and block - 1 predicted tokens
    decay: float = 0.8  # loss weight of predicted position i is decay ** (i - 1)

    def __post_init__(self) -> None:
        if self.block < 2:
            raise ValueError(f"expected block >= 2 (an anchor and a prediction), got {self.block}")


TINY_TARGET = TargetConfig(vocab=64, dim=32, layers=4, heads=2, head_dim=16, capture_layers=(1, 3))
TINY_DRAFTER = DrafterConfig(layers=1, heads=2, head_dim=16, block=4)


# --- shared pieces ----------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(dtype)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, ratio: float) -> None:
        super().__init__()
        hidden = int(dim * ratio)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of x [B, H, T, D] at integer `positions` [T]."""
    half = x.shape[-1] // 2
    freqs = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * freqs[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# --- target layers ----------------------------------------------------------------------------
class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear attention: q, k, v through a short causal depthwise conv and
    SiLU; beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the gated delta
    rule; a per-head RMSNorm gated by silu(z)."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        inner = cfg.heads * cfg.head_dim
        self.in_proj = nn.Linear(cfg.dim, 4 * inner + 2 * cfg.heads, bias=False)  # q k v z b a
        self.conv = nn.Conv1d(
            3 * inner,
            3 * inner,
            cfg.conv_size,
            groups=3 * inner,
            padding=cfg.conv_size - 1,
            bias=False,
        )
        # As flash-linear-attention's GatedDeltaNet: A in (0, 16], a step size dt in
        # [1e-3, 0.1] log-uniform at a = 0 (dt_bias is softplus^-1(dt)).
        self.A_log = nn.Parameter(torch.log(torch.empty(cfg.heads).uniform_(0, 16).clamp_min(1e-4)))
        dt = torch.exp(torch.empty(cfg.heads).uniform_(math.log(1e-3), math.log(0.1)))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.norm = RMSNorm(cfg.head_dim)
        self.out_proj = nn.Linear(inner, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        inner = self.heads * self.head_dim
        qkv, z, b, a = self.in_proj(x).split([3 * inner, inner, self.heads, self.heads], dim=-1)
        qkv = F.silu(self.conv(qkv.transpose(1, 2))[..., :length]).transpose(1, 2)
        q, k, v = (t.reshape(batch, length, self.heads, self.head_dim) for t in qkv.chunk(3, -1))
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        o = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
        z = z.reshape(batch, length, self.heads, self.head_dim)
        o = self.norm(o) * F.silu(z)
        return self.out_proj(o.reshape(batch, length, inner))


class GatedAttention(nn.Module):
    """Causal softmax attention with q/k RMSNorm, rotary positions and a sigmoid output
    gate (Qwen3-Next's attention layers)."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        inner = cfg.heads * cfg.head_dim
        self.qkv_gate = nn.Linear(cfg.dim, 4 * inner, bias=False)
        self.q_norm, self.k_norm = RMSNorm(cfg.head_dim), RMSNorm(cfg.head_dim)
        self.out_proj = nn.Linear(inner, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v, gate = (
            t.reshape(batch, length, self.heads, self.head_dim).transpose(1, 2)
            for t in self.qkv_gate(x).chunk(4, dim=-1)
        )
        positions = torch.arange(length, device=x.device)
        q, k = rope(self.q_norm(q), positions), rope(self.k_norm(k), positions)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True) * gate.sigmoid()
        return self.out_proj(o.transpose(1, 2).reshape(batch, length, -1))


class TargetLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, attention: bool) -> None:
        super().__init__()
        self.mixer_norm, self.mlp_norm = RMSNorm(cfg.dim), RMSNorm(cfg.dim)
        self.mixer = GatedAttention(cfg) if attention else GatedDeltaNet(cfg)
        self.mlp = SwiGLU(cfg.dim, cfg.mlp_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class HybridTarget(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(
            TargetLayer(cfg, attention=(i + 1) % cfg.attn_every == 0) for i in range(cfg.layers)
        )
        self.norm = RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    @property
    def feature_dim(self) -> int:
        return len(self.cfg.capture_layers) * self.cfg.dim

    # Named as in Hugging Face models, so the drafter takes either kind of target.
    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states of the capture layers, concatenated: [B, T, len(capture) * dim]."""
        x = self.embed(input_ids)
        captured = []
        last = max(self.cfg.capture_layers)
        for i, layer in enumerate(self.layers[: last + 1]):
            x = layer(x)
            if i in self.cfg.capture_layers:
                captured.append(x)
        return torch.cat(captured, dim=-1)


# --- the drafter ------------------------------------------------------------------------------
class BlockAttention(nn.Module):
    """Block tokens attend to context features (keys/values from the target's hidden
    states) and to their own block."""

    def __init__(self, dim: int, cfg: DrafterConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        inner = cfg.heads * cfg.head_dim
        self.q_proj = nn.Linear(dim, inner, bias=False)
        self.kv_proj = nn.Linear(dim, 2 * inner, bias=False)
        self.q_norm, self.k_norm = RMSNorm(cfg.head_dim), RMSNorm(cfg.head_dim)
        self.out_proj = nn.Linear(inner, dim, bias=False)

    def forward(self, x, context, x_positions, context_positions, mask):
        batch = x.shape[0]

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(batch, -1, self.heads, self.head_dim).transpose(1, 2)

        q = rope(self.q_norm(heads(self.q_proj(x))), x_positions)
        k, v = self.kv_proj(torch.cat([context, x], dim=1)).chunk(2, dim=-1)
        k = rope(self.k_norm(heads(k)), torch.cat([context_positions, x_positions]))
        o = F.scaled_dot_product_attention(q, k, heads(v), attn_mask=mask)
        return self.out_proj(o.transpose(1, 2).reshape(batch, x.shape[1], -1))


class DrafterLayer(nn.Module):
    def __init__(self, dim: int, cfg: DrafterConfig) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.attn = BlockAttention(dim, cfg)
        self.mlp = SwiGLU(dim, cfg.mlp_ratio)

    def forward(self, x, context, x_positions, context_positions, mask):
        x = x + self.attn(self.attn_norm(x), context, x_positions, context_positions, mask)
        return x + self.mlp(self.mlp_norm(x))


class BlockDrafter(nn.Module):
    """`target` is a HybridTarget or an examples.dflash.hf.HFTarget: its `feature_dim`
    is the width of the features it returns, its embeddings give the drafter's width."""

    def __init__(self, target: nn.Module, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        dim = embed.embedding_dim
        self.fc = nn.Linear(target.feature_dim, dim, bias=False)
        self.context_norm = RMSNorm(dim)
        self.mask_embedding = nn.Parameter(torch.randn(dim) * dim**-0.5)
        self.layers = nn.ModuleList(DrafterLayer(dim, cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(dim)
        # Shared with the target in DFlash: frozen copies here.
        self.embed = copy.deepcopy(embed).requires_grad_(False)
        self.lm_head = copy.deepcopy(lm_head).requires_grad_(False)

    def anchors(self, length: int, device: torch.device) -> torch.Tensor:
        """Anchor positions: every block-th position with a whole block after it."""
        return torch.arange(0, length - self.cfg.block + 1, self.cfg.block, device=device)

    def predict(self, features: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, anchors, block - 1, vocab] for x_(p+1) .. x_(p+block-1) at each anchor p."""
        batch, length = input_ids.shape
        block = self.cfg.block
        anchors = self.anchors(length, input_ids.device)
        n = anchors.numel()
        context = self.context_norm(self.fc(features))
        x = self.mask_embedding.to(context.dtype).expand(batch, n, block, -1).clone()
        x[:, :, 0] = self.embed(input_ids[:, anchors]).to(context.dtype)
        x = x.reshape(batch, n * block, -1)
        offsets = torch.arange(block, device=input_ids.device)
        x_positions = (anchors[:, None] + offsets[None, :]).reshape(-1)
        context_positions = torch.arange(length, device=input_ids.device)
        block_of = torch.arange(n, device=input_ids.device).repeat_interleave(block)
        sees_context = context_positions[None, :] <= anchors[block_of][:, None]
        same_block = block_of[:, None] == block_of[None, :]
        mask = torch.cat([sees_context, same_block], dim=1)
        for layer in self.layers:
            x = layer(x, context, x_positions, context_positions, mask)
        x = self.norm(x).reshape(batch, n, block, -1)[:, :, 1:]
        return self.lm_head(x.to(self.lm_head.weight.dtype))

    def forward(
        self, features: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The training loss (forward returns it, so DistributedDataParallel sees the call):
        cross entropy of the block predictions, position i weighted by decay ** (i - 1),
        averaged over the blocks. `lengths` [B] (a device tensor) gives each row's real
        length in a right-padded batch: only blocks that end within it count, and the
        average is over them, so padding changes nothing (pydflash's Note [Padding
        contract]). None: every position is real."""
        logits = self.predict(features, input_ids).float()
        anchors = self.anchors(input_ids.shape[1], input_ids.device)
        offsets = torch.arange(1, self.cfg.block, device=input_ids.device)
        labels = input_ids[:, anchors[:, None] + offsets[None, :]]
        losses = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none")
        weights = self.cfg.decay ** (offsets - 1).float()
        losses = losses.view(*labels.shape) * weights
        if lengths is None:
            return losses.sum() / (weights.sum() * labels.shape[0] * labels.shape[1])
        real = (anchors[None, :] + self.cfg.block <= lengths[:, None]).float()  # [B, blocks]
        return (losses * real[..., None]).sum() / (weights.sum() * real.sum())
