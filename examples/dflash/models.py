"""A small Qwen3-Next-style hybrid target and a DFlash-style block drafter.

Target: token embedding, then layers that are gated-delta-rule linear attention except
every `attn_every`-th, which is gated softmax attention; each layer is pre-norm with a
SwiGLU MLP. Its forward returns the hidden states of `capture_layers`, concatenated:
what the drafter is conditioned on.

Drafter (after DFlash, block diffusion drafting): for each anchor position p it
predicts the `block - 1` tokens after x_p in one parallel pass. A block's input is
[embed(x_p), mask, ..., mask]; each drafter layer attends from the block to the
target's context features at positions < p and, bidirectionally, to its own block.
Embedding and LM head are frozen copies of the target's. The anchors are every
block-th position, or a fixed number per sequence drawn by the data (`anchors`); the
loss is DFlash's (`objective`: supervised anchors and labels, slot weights
exp(-(k-1)/gamma)), over the full vocabulary in chunks (`fused_loss`). `DFLASH_B16` is the
published DFlash recipe for Qwen3-8B. The context stops just before p, as DFlash's: when
drafting, x_p is the token the target has just produced, and no hidden state of it exists
yet (Note [Context before the anchor]).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import objective
from .fused_loss import KERNELS
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

    def build(self, dtype: torch.dtype = torch.float32, device: str = "cpu") -> HybridTarget:
        with torch.device(device):
            return HybridTarget(self).to(dtype)


@dataclass(frozen=True)
class DrafterConfig:
    layers: int = 1
    heads: int = 8
    head_dim: int = 128
    mlp_ratio: float = 3.0
    block: int = 8  # tokens per block: the anchor and block - 1 predicted tokens
    gamma: float | None = None  # slot k's loss weight is exp(-(k - 1) / gamma); None: DFlash's
    kv_heads: int | None = None  # key/value heads (grouped-query attention); None: heads
    anchors: int | None = None  # anchors per sequence, given by the data; None: every block
    group: int = 32  # blocks per attention query group (Note [Grouped block attention])
    # The grouped layout copies the context's keys once per group: at most this many times
    # the blocks' own rows, else fewer, larger groups (Note [Grouped block attention]).
    context_copies: float = 2.0
    loss_chunk: int = 1024  # rows per chunk of the fused head + cross entropy
    loss_kernel: str = "chunked"  # the fused head + cross entropy: fused_loss.KERNELS

    def __post_init__(self) -> None:
        if self.block < 2:
            raise ValueError(f"expected block >= 2 (an anchor and a prediction), got {self.block}")
        if self.heads % self.kv_heads_:
            raise ValueError(f"expected kv_heads dividing heads {self.heads}, got {self.kv_heads_}")
        for name in ("layers", "group", "loss_chunk", "context_copies"):
            if getattr(self, name) < 1:
                raise ValueError(f"expected {name} >= 1, got {getattr(self, name)}")
        if self.anchors is not None and self.anchors < 1:
            raise ValueError(f"expected anchors >= 1 or None, got {self.anchors}")
        if self.loss_kernel not in KERNELS:
            raise ValueError(f"expected loss_kernel in {sorted(KERNELS)}, got {self.loss_kernel!r}")
        if self.gamma is not None and not self.gamma > 0:
            raise ValueError(f"expected gamma > 0 or None, got {self.gamma}")

    @property
    def gamma_(self) -> float:
        """The loss decay in use: `gamma`, or DFlash's default for the block size."""
        return objective.default_gamma(self.block) if self.gamma is None else self.gamma

    @property
    def kv_heads_(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads


TINY_TARGET = TargetConfig(vocab=64, dim=32, layers=4, heads=2, head_dim=16, capture_layers=(1, 3))
TINY_DRAFTER = DrafterConfig(layers=1, heads=2, head_dim=16, block=4)
# The published DFlash recipe for Qwen3-8B (SpecForge's "Domino disaggregated performance
# findings"): 5 layers of Qwen3-8B's width (32 query heads and 8 key/value heads of 128,
# MLP 3x), blocks of 16, 256 anchors per sequence; with Qwen3-8B's five capture layers,
# 1.05 B trainable parameters besides the frozen 151,936-token embedding and head.
DFLASH_B16 = DrafterConfig(
    layers=5, heads=32, kv_heads=8, head_dim=128, mlp_ratio=3.0, block=16, anchors=256
)
DRAFTERS = {"default": DrafterConfig(), "tiny": TINY_DRAFTER, "dflash-b16": DFLASH_B16}


# --- shared pieces ----------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm: one fused kernel each way where torch has one (CUDA), in x's
        # dtype with fp32 accumulation. Autocast would run it in fp32 (two more passes
        # over x and an fp32 copy kept for the backward): here it runs in x's dtype.
        if x.is_cuda and torch.is_autocast_enabled("cuda"):
            with torch.autocast("cuda", enabled=False):
                return F.rms_norm(x, x.shape[-1:], self.weight.to(x.dtype), self.eps)
        return F.rms_norm(x, x.shape[-1:], self.weight.to(x.dtype), self.eps)


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
def rotary(positions: torch.Tensor, head_dim: int, dtype: torch.dtype, base: float = 10000.0):
    """cos and sin [B, L, 1, head_dim / 2] of integer `positions` [B, L], for `apply_rotary`."""
    half = head_dim // 2
    freqs = base ** (-torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    angles = positions.float()[..., None, None] * freqs
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rope` for x [B, L, H, D] with precomputed cos and sin."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@dataclass
class BlockLayout:
    """What every drafter layer of one forward shares: the blocks' rotary tables, the
    context's, and the additive attention mask of each query group (Note [Grouped block
    attention])."""

    groups: int  # query groups per sequence
    x_rotary: tuple[torch.Tensor, torch.Tensor]
    context_rotary: tuple[torch.Tensor, torch.Tensor]
    mask: torch.Tensor  # [B * groups, 1, group queries, context + group queries], 0 or -inf


# Note [Context before the anchor]: a block's queries see the target's features at
# positions before its anchor p, never at p: when drafting, x_p is the token the target
# has just sampled, and its hidden state is computed only when the target verifies the
# block. Training on the feature at p would teach the drafter to lean on an input it
# never has.
#
# Note [Grouped block attention]: a block's queries see the context before the block's
# anchor and the block itself. Attending from all n blocks to [context; all n blocks] with
# a mask (the plain layout) spends most of the attention on keys every query masks out:
# at 256 blocks of 16 after 768 tokens, 4096 + 768 keys per query of which at most 784
# count. Here the queries go in groups, each attending to [context; its own blocks] only:
# 768 + 512 keys at 32 blocks a group, 3.8x less attention work and memory, for a copy of
# the context's keys and values per group. The result is the plain layout's (the keys a
# query sees are the same).
#
# Memory stays linear in the context: the copies are of the key/value heads only (SDPA's
# grouped-query path, where a fused kernel takes it with a mask), and a long context gets
# fewer groups, so that the copies are at most `context_copies` times the blocks' own rows
# (one group, the plain layout, from a context of 2 x blocks' rows on). Grouping each of
# 512 blocks of 8 after 32 k tokens 32 a group copied the context's keys and values 16
# times at all 32 query heads: 8 GiB per tensor per layer, where the plain layout needs
# 0.15 GiB. The mask is additive, in the queries' dtype, built once per forward and
# shared by the layers (SDPA would convert a boolean one in every layer, and every
# layer's backward would keep its copy), its rows padded to the 16 elements the fused
# kernel's bias needs (else SDPA pads a copy per call). Its shapes follow the
# configuration and the batch's shape: nothing syncs with the host.
def query_groups(cfg: DrafterConfig, anchors: int, length: int) -> int:
    """Query groups per sequence for `anchors` blocks after a `length`-token context: the
    most that divide the blocks into groups of a multiple of gcd(anchors, cfg.group)
    blocks while copying the context at most cfg.context_copies times the blocks' rows."""
    most = anchors // math.gcd(anchors, cfg.group)
    allowed = cfg.context_copies * anchors * cfg.block / length
    return max(g for g in range(1, most + 1) if most % g == 0 and (g == 1 or g <= allowed))


def block_mask(
    anchors: torch.Tensor, block: int, length: int, groups: int, dtype: torch.dtype
) -> torch.Tensor:
    """The additive mask [B * groups, 1, group queries, length + group queries] of
    Note [Grouped block attention]: query j of a group sees context key i when i < its
    block's anchor (Note [Context before the anchor]), and the keys of its own block."""
    batch, n = anchors.shape
    device = anchors.device
    per_group = n // groups * block
    keys = length + per_group
    padded = -(-keys // 16) * 16
    mask = torch.full((batch, groups, per_group, padded), float("-inf"), dtype=dtype, device=device)
    query_anchor = anchors.repeat_interleave(block, dim=1).view(batch, groups, per_group, 1)
    mask[..., :length].masked_fill_(torch.arange(length, device=device) < query_anchor, 0.0)
    block_of = torch.arange(per_group, device=device) // block
    mask[..., length:keys].masked_fill_(block_of[:, None] == block_of[None, :], 0.0)
    return mask.view(batch * groups, 1, per_group, padded)[..., :keys]


def fused_grouped_query(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether SDPA runs grouped key/value heads with this mask without repeating them:
    on the CPU always (its kernels index the shared heads), on CUDA where the
    memory-efficient kernel admits them (torch's sdp_utils decides per version)."""
    if not q.is_cuda or q.shape[1] == k.shape[1]:
        return True
    params = torch.backends.cuda.SDPAParams(q, k, k, mask, 0.0, False, True)
    return torch.backends.cuda.can_use_efficient_attention(params)


class BlockAttention(nn.Module):
    """Block tokens attend to context features (keys/values from the target's hidden
    states) and to their own block. `kv_heads` < `heads` shares each key/value head
    between heads / kv_heads query heads (grouped-query attention)."""

    def __init__(self, dim: int, cfg: DrafterConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads_, cfg.head_dim
        self.q_proj = nn.Linear(dim, cfg.heads * cfg.head_dim, bias=False)
        self.kv_proj = nn.Linear(dim, 2 * self.kv_heads * cfg.head_dim, bias=False)
        self.q_norm, self.k_norm = RMSNorm(cfg.head_dim), RMSNorm(cfg.head_dim)
        self.out_proj = nn.Linear(cfg.heads * cfg.head_dim, dim, bias=False)

    def _keys_values(self, t: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor]):
        batch, length = t.shape[:2]
        k, v = self.kv_proj(t).view(batch, length, 2, self.kv_heads, self.head_dim).unbind(2)
        return apply_rotary(self.k_norm(k), *rot), v

    def forward(self, x: torch.Tensor, context: torch.Tensor, layout: BlockLayout):
        batch, queries = x.shape[:2]
        g = layout.groups
        per_group = queries // g
        q = self.q_proj(x).view(batch, queries, self.heads, self.head_dim)
        q = apply_rotary(self.q_norm(q), *layout.x_rotary)
        q = q.view(batch * g, per_group, self.heads, self.head_dim).transpose(1, 2)
        k_ctx, v_ctx = self._keys_values(context, layout.context_rotary)
        k_x, v_x = self._keys_values(x, layout.x_rotary)

        def grouped(ctx_part: torch.Tensor, x_part: torch.Tensor) -> torch.Tensor:
            # [B, T, kv, D] and [B, n * block, kv, D] -> [B * g, kv, T + per_group, D]
            if g == 1:
                return torch.cat([ctx_part, x_part], dim=1).transpose(1, 2)
            ctx_part = ctx_part[:, None].expand(batch, g, -1, self.kv_heads, self.head_dim)
            x_part = x_part.view(batch, g, per_group, self.kv_heads, self.head_dim)
            both = torch.cat([ctx_part, x_part], dim=2)
            return both.view(batch * g, -1, self.kv_heads, self.head_dim).transpose(1, 2)

        k, v = grouped(k_ctx, k_x), grouped(v_ctx, v_x)
        gqa = self.heads != self.kv_heads
        if gqa and not fused_grouped_query(q, k, layout.mask):
            # Older kernels: repeat the heads rather than fall to the math path (scores).
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            gqa = False
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask, enable_gqa=gqa)
        o = o.transpose(1, 2).reshape(batch, queries, self.heads * self.head_dim)
        return self.out_proj(o)


class DrafterLayer(nn.Module):
    def __init__(self, dim: int, cfg: DrafterConfig) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.attn = BlockAttention(dim, cfg)
        self.mlp = SwiGLU(dim, cfg.mlp_ratio)

    def forward(self, x: torch.Tensor, context: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), context, layout)
        return x + self.mlp(self.mlp_norm(x))


class BlockDrafter(nn.Module):
    """`target` is a HybridTarget or an examples.dflash.hf.HFTarget: its `feature_dim`
    is the width of the features it returns, its embeddings give the drafter's width.

    With `cfg.anchors` set, each sequence's anchors come with the data (`anchors` below,
    made by `data.MarkovTokens`); without, every block-th position is an anchor."""

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
        """Anchor positions without data-given anchors: every block-th position with a
        whole block after it."""
        return torch.arange(0, length - self.cfg.block + 1, self.cfg.block, device=device)

    def _anchors(self, input_ids: torch.Tensor, anchors: torch.Tensor | None) -> torch.Tensor:
        """[B, n]: the data's first cfg.anchors entries, or every block-th position."""
        batch, length = input_ids.shape
        if self.cfg.anchors is None:
            return self.anchors(length, input_ids.device).expand(batch, -1)
        if anchors is None:
            raise ValueError(
                f"expected anchors with the batch: the drafter takes {self.cfg.anchors} "
                "per sequence (data.MarkovTokens(..., anchors=n, block=b) makes them)"
            )
        return anchors[:, : self.cfg.anchors]

    def hidden(
        self, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor
    ) -> torch.Tensor:
        """The final hidden states of the predicted positions, [B, n, block - 1, dim]."""
        batch, length = input_ids.shape
        block, n = self.cfg.block, anchors.shape[1]
        device = input_ids.device
        context = self.context_norm(self.fc(features))
        x = self.mask_embedding.to(context.dtype).expand(batch, n, block, -1).clone()
        x[:, :, 0] = self.embed(input_ids.gather(1, anchors)).to(context.dtype)
        x = x.reshape(batch, n * block, -1)
        head_dim = self.cfg.head_dim
        x_positions = (anchors[:, :, None] + torch.arange(block, device=device)).view(batch, -1)
        context_positions = torch.arange(length, device=device).expand(batch, -1)
        groups = query_groups(self.cfg, n, length)  # Note [Grouped block attention]
        layout = BlockLayout(
            groups=groups,
            x_rotary=rotary(x_positions, head_dim, context.dtype),
            context_rotary=rotary(context_positions, head_dim, context.dtype),
            mask=block_mask(anchors, block, length, groups, context.dtype),
        )
        for layer in self.layers:
            x = layer(x, context, layout)
        return self.norm(x).reshape(batch, n, block, -1)[:, :, 1:]

    def predict(
        self, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [B, anchors, block - 1, vocab] for x_(p+1) .. x_(p+block-1) at each anchor p."""
        anchors = self._anchors(input_ids, anchors)
        x = self.hidden(features, input_ids, anchors)
        return self.lm_head(x.to(self.lm_head.weight.dtype))

    def forward(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        anchors: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        anchor_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The training loss (forward returns it, so DistributedDataParallel sees the call):
        DFlash's objective (Note [DFlash objective] in objective.py): the cross entropy of
        the block predictions over the full vocabulary (cfg.loss_kernel, one of
        fused_loss.KERNELS), slot k weighted by exp(-(k - 1) / gamma), counting only
        anchors whose token and next are supervised, and only supervised labels.

        Args:
            features, input_ids, anchors: as for `predict`.
            lengths: [B] (a device tensor), each row's real length in a right-padded
                batch: positions at or past it count for nothing, and the normalisation
                is counted on the device, so padding changes nothing (pydflash's Note
                [Padding contract]). None: every position is real.
            loss_mask: [B, T], nonzero where a token is supervised; None: every token.
            anchor_mask: [B, T], nonzero in the first entries that are real anchors (the
                data's, aligned with `anchors`); None: every anchor is real.
        """
        anchors = self._anchors(input_ids, anchors)
        if anchor_mask is not None:
            anchor_mask = anchor_mask[:, : anchors.shape[1]]
        x = self.hidden(features, input_ids, anchors)
        batch = anchors.shape[0]
        offsets = torch.arange(1, self.cfg.block, device=input_ids.device)
        positions = (anchors[:, :, None] + offsets).clamp_max(input_ids.shape[1] - 1)
        labels = input_ids.gather(1, positions.view(batch, -1))
        weights = objective.block_weights(
            input_ids,
            anchors,
            self.cfg.block,
            self.cfg.gamma_,
            loss_mask=loss_mask,
            anchor_mask=anchor_mask,
            lengths=lengths,
        )
        return KERNELS[self.cfg.loss_kernel](
            x.reshape(-1, x.shape[-1]),
            self.lm_head.weight,
            labels.flatten(),
            weights.flatten(),
            chunk=self.cfg.loss_chunk,
        )


class TargetShapes(nn.Module):
    """A stand-in target with only the shapes a drafter takes from one."""

    def __init__(self, dim: int, feature_dim: int, vocab: int) -> None:
        super().__init__()
        self.feature_dim = feature_dim
        self.embed = nn.Embedding(vocab, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head


def drafter_parameters(cfg: DrafterConfig, dim: int, feature_dim: int, vocab: int) -> dict:
    """Parameter counts of a drafter for a target of width `dim`, features `feature_dim`
    wide and a `vocab`-token head, built on the meta device (no memory, no time):
    {"trainable", "frozen" (the embedding and head copies), "total"}."""
    with torch.device("meta"):
        drafter = BlockDrafter(TargetShapes(dim, feature_dim, vocab), cfg)
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in drafter.parameters() if not p.requires_grad)
    return {"trainable": trainable, "frozen": frozen, "total": trainable + frozen}
