"""Gated delta rule linear attention (Yang et al., "Gated Delta Networks"), the token
mixer of Qwen3-Next's linear-attention layers.

Per head, with a state h of shape [K, V], for each position t:
    h   <- exp(g_t) * h                          (g_t <= 0: the forget gate, in log space)
    u_t  = beta_t * (v_t - h^T k_t)              (the delta rule's corrected value)
    h   <- h + k_t u_t^T
    o_t  = h^T (scale * q_t)

On CUDA with flash-linear-attention installed this calls its Triton kernel
`chunk_gated_delta_rule`; elsewhere `torch_gated_delta_rule` computes the same thing
in chunks with plain torch ops.
"""

from __future__ import annotations

import functools

import torch

L2NORM_EPS = 1e-6  # as flash-linear-attention's in-kernel l2norm


@functools.cache
def fla_kernel():
    """flash-linear-attention's chunk_gated_delta_rule, or None when it is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """o [B, T, H, V] from q, k [B, T, H, K], v [B, T, H, V], g and beta [B, T, H]."""
    # Only CUDA half-precision inputs need the package: importing it costs seconds.
    kernel = fla_kernel() if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) else None
    if kernel is not None:
        o, _ = kernel(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm)
        return o
    return torch_gated_delta_rule(q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def torch_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The recurrence in chunks of `chunk_size` positions, computed in float32 (or
    float64 for float64 inputs) and returned in v's dtype.

    Within a chunk starting from state S, with G the running sum of g (inclusive) and
    D[i, j] = exp(G_i - G_j) for j <= i, the corrected values solve the unit lower
    triangular system (I + diag(beta) (K K^T * D)_strict) U' = diag(beta) (V - exp(G) * K S),
    so U' = U - W S with U, W independent of S (the WY form, batched over all chunks);
    only the chunk-to-chunk state update is sequential:
        O      = scale * (exp(G) * Q S + (Q K^T * D) U')
        S_next = exp(G_last) S + (K * exp(G_last - G))^T U'
    """
    if not (q.shape == k.shape and q.shape[:3] == v.shape[:3] == g.shape == beta.shape):
        raise ValueError(
            "expected q, k [B, T, H, K], v [B, T, H, V], g and beta [B, T, H], got "
            + ", ".join(str(tuple(x.shape)) for x in (q, k, v, g, beta))
        )
    out_dtype = v.dtype
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    batch, length, heads, dk = q.shape
    dv = v.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    c = chunk_size
    pad = -length % c
    if pad:
        # Zero keys add nothing to the state, and g = 0 leaves it undecayed.
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (length + pad) // c

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = x.reshape(batch, n, c, heads, *x.shape[3:])
        return x.permute(0, 3, 1, 2, *range(4, x.dim()))

    q, k, v, g, beta = map(chunked, (q, k, v, g, beta))
    G = g.cumsum(-1)
    inclusive = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    strict = inclusive.tril(-1)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~inclusive, float("-inf")).exp()
    kk = (k @ k.transpose(-1, -2)) * decay
    system = torch.eye(c, dtype=dtype, device=q.device) + beta[..., None] * kk.masked_fill(
        ~strict, 0
    )
    b = beta[..., None]
    solve = functools.partial(
        torch.linalg.solve_triangular, system, upper=False, unitriangular=True
    )
    W = solve(b * G.exp()[..., None] * k)
    U = solve(b * v)
    qk = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]
    last = G[..., -1].exp()[..., None, None]

    state = q.new_zeros(batch, heads, dk, dv)
    outputs = []
    for i in range(n):
        u = U[:, :, i] - W[:, :, i] @ state
        outputs.append(scale * (q_decayed[:, :, i] @ state + qk[:, :, i] @ u))
        state = last[:, :, i] * state + k_to_end[:, :, i].transpose(-1, -2) @ u
    o = torch.stack(outputs, dim=2)  # [B, H, N, C, V]
    o = o.permute(0, 2, 3, 1, 4).reshape(batch, n * c, heads, dv)[:, :length]
    return o.to(out_dtype)
