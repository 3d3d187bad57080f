"""Fused elementwise work for transformers' Qwen3-Next as the frozen target, opt-in:
`fuse(target, fusions)` with fusions from FUSIONS.

A bf16 forward of the 23 B hybrid spends about 31 % of its GPU time in elementwise and
other unfused ops and 5 % in torch's fallback causal convolution (the project's facts).
Each fusion here is separately switchable, so a run can measure what each saves:

- "norms": Qwen3NextRMSNorm (zero-centred: x * rstd * (1 + w), in fp32) and the linear
  attention's gated RMSNorm (rmsnorm(x) * w * silu(z)) each as one of
  flash-linear-attention's fused Triton kernels (`fla.modules.norm.layernorm.rms_norm`,
  `fla.modules.norm.fused_norm_gate.rms_norm_gated`), in place of about seven torch kernels
  each. The (1 + w) goes in as an fp32 weight, which FLA's kernel reads in fp32.
- "swiglu": the MLP's gate and up projections as one GEMM (the input read, and with
  FP8 quantized, once) and silu(gate) * up in one kernel (`fla.modules.activations.swiglu`).
- "conv": the linear attention's short causal convolution through FLA's Triton kernel
  (`fla.modules.causal_conv1d.causal_conv1d`), not torch's fallback conv1d + silu.
- "compile": each decoder layer `torch.compile`d (Inductor fuses what is left: rotary,
  the gates, residual adds), through pydflash's 'torch_compile' guard (the compiled
  layer is an OptimizedModule); FLA's kernels and FP8Linear's operator stay opaque.

FLA's kernels need CUDA tensors: on a CPU, and without FLA, each fused module runs the
same math in torch (what the CPU tests check against transformers' modules). The
numbers differ from transformers' bf16 path by rounding only: FLA computes each fused
expression in fp32 and rounds once.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FUSIONS = ("norms", "swiglu", "conv", "compile")
KERNELS = ("norms", "swiglu", "conv")  # "fla": the fusions through FLA's kernels


def parse_fusions(text: str | Iterable[str] | None) -> tuple[str, ...]:
    """ "norms,conv" / ["norms"] / "fla" (all of KERNELS) / "all" / "" -> a sorted tuple."""
    if text is None:
        return ()
    parts = [p.strip() for p in text.split(",")] if isinstance(text, str) else list(text)
    chosen: set[str] = set()
    for part in filter(None, parts):
        if part == "all":
            chosen.update(FUSIONS)
        elif part == "fla":
            chosen.update(KERNELS)
        elif part in FUSIONS:
            chosen.add(part)
        else:
            raise ValueError(f"expected fusions from {FUSIONS}, 'fla' or 'all', got {part!r}")
    return tuple(f for f in FUSIONS if f in chosen)


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def _on_fla(x: torch.Tensor) -> bool:
    return x.is_cuda and fla_available()


def _takes_fla(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether a fused module runs FLA's kernel on x: FLA was found when the module was
    made (looked up once: a lookup in a compiled layer would break its graph)."""
    return module.use_fla and x.is_cuda


# Note [Opaque to torch.compile]: FLA's ops are autograd Functions around autotuned
# Triton kernels (FLA's own autotuner subclass, pydflash's guard on it); Dynamo must not
# trace into them. Each call from here is `torch.compiler.disable`d (a graph break in a
# compiled layer, a plain call in eager), as are transformers' module-level functions
# that dispatch to FLA when the layers compile; FP8Linear is a custom operator.
@torch.compiler.disable
def _fla_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from fla.modules.norm.layernorm import rms_norm

    return rms_norm(x, weight, None, eps=eps)


@torch.compiler.disable
def _fla_rms_norm_gated(x, gate, weight, eps: float) -> torch.Tensor:
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    return rms_norm_gated(x, gate, weight, None, activation="swish", eps=eps)


@torch.compiler.disable
def _fla_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    from fla.modules.activations import swiglu

    return swiglu(gate, up)


@torch.compiler.disable
def _fla_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias, activation) -> torch.Tensor:
    """x [B, D, T] (a transposed [B, T, D]) -> [B, D, T], as transformers' function."""
    from fla.modules.causal_conv1d import causal_conv1d

    y, _ = causal_conv1d(x.transpose(1, 2), weight, bias, activation=activation)
    return y.transpose(1, 2)


# --- "norms" -----------------------------------------------------------------------------------
class ZeroCentredRMSNorm(nn.Module):
    """Qwen3NextRMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + weight), in fp32, in x's dtype."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self.use_fla = fla_available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.weight.float()
        if _takes_fla(self, x):
            return _fla_rms_norm(x, scale, self.eps)
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * scale).type_as(x)


class GatedRMSNorm(nn.Module):
    """Qwen3NextRMSNormGated: rmsnorm(x) * weight * silu(gate)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.variance_epsilon
        self.use_fla = fla_available()

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if _takes_fla(self, x):
            return _fla_rms_norm_gated(x, gate, self.weight, self.eps)
        dtype = x.dtype
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * normed.to(dtype)
        return (out * F.silu(gate.float())).to(dtype)


# --- "swiglu" ----------------------------------------------------------------------------------
class FusedMLP(nn.Module):
    """Qwen3NextMLP: down(silu(gate(x)) * up(x)), the two input projections as one."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        gate, up = mlp.gate_proj, mlp.up_proj
        self.hidden = gate.out_features
        self.gate_up = nn.Linear(
            gate.in_features,
            2 * self.hidden,
            bias=False,
            device=gate.weight.device,
            dtype=gate.weight.dtype,
        )
        with torch.no_grad():
            self.gate_up.weight.copy_(torch.cat([gate.weight, up.weight]))
        self.gate_up.requires_grad_(gate.weight.requires_grad)
        self.down_proj = mlp.down_proj
        self.use_fla = fla_available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        gate, up = gate_up[..., : self.hidden], gate_up[..., self.hidden :]
        hidden = _fla_swiglu(gate, up) if _takes_fla(self, x) else F.silu(gate) * up
        return self.down_proj(hidden)


def _mergeable(mlp: nn.Module) -> bool:
    parts = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return (
        all(type(p) is nn.Linear and p.bias is None for p in parts[:2])
        and parts[2] is not None
        and getattr(getattr(mlp, "act_fn", None), "__class__", type(None)).__name__
        in ("SiLUActivation", "SiLU")
    )


# --- "conv" ------------------------------------------------------------------------------------
# Note [FLA causal conv]: transformers' Qwen3-Next calls the module-level function
# `causal_conv1d_fn(x [B, D, T], self.conv1d.weight.squeeze(1), bias, activation=...)` (a
# hub kernel when one is installed, else its torch fallback). fuse() routes that name
# through `_route_conv`, which takes FLA's kernel only for a convolution whose weight
# parameter fuse() marked (`fla_conv`; the weight passed is a view of it): other models
# in the process keep their path. A deep copy of the target (the example copies it to
# further target devices) loses the mark and takes transformers' path: slower, the same
# results. FLA's kernel takes x as [B, T, D]; transformers' x is the transpose of a
# contiguous [B, T, D] tensor, so both transposes are views.
@torch.compiler.disable
def _route_conv(x: torch.Tensor, weight: torch.Tensor, bias=None, activation=None, **kwargs):
    parameter = weight if weight._base is None else weight._base
    if getattr(parameter, "fla_conv", False) and _on_fla(x) and not kwargs.get("seq_idx"):
        return _fla_causal_conv1d(x, weight, bias, activation)
    return _route_conv.original(x, weight, bias, activation=activation, **kwargs)


def _route_conv_in(module: Any) -> bool:
    original = getattr(module, "causal_conv1d_fn", None)
    if original is None:
        return False
    if original is not _route_conv:
        _route_conv.original = original
        module.causal_conv1d_fn = _route_conv
    return True


# --- "compile" ---------------------------------------------------------------------------------
# transformers' Qwen3-Next functions that dispatch to FLA (or a hub kernel).
_DISPATCHING = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


def _opaque_dispatch(module: Any) -> None:
    """Note [Opaque to torch.compile], for transformers' module-level functions."""
    for name in _DISPATCHING:
        fn = getattr(module, name, None)
        if fn is not None and not getattr(fn, "opaque_to_compile", False):
            opaque = torch.compiler.disable(fn)
            opaque.opaque_to_compile = True
            setattr(module, name, opaque)


def _compile_layers(decoder: nn.ModuleList) -> None:
    import torch._dynamo

    # 64 layers of two kinds share their compiled code; the guards of each kind's
    # instances must not exhaust the default limit of 8 recompiles (then eager, silently).
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
    for i, layer in enumerate(decoder):
        if not isinstance(layer, torch._dynamo.eval_frame.OptimizedModule):
            decoder[i] = torch.compile(layer)


# --- the swap ----------------------------------------------------------------------------------
def fuse(target: Any, fusions: Iterable[str]) -> Any:
    """Applies `fusions` (FUSIONS) to an HFTarget's Qwen3-Next decoder layers in place,
    and returns it. Norms and MLPs of other kinds are left as they are; call before
    fp8.to_fp8, so that the merged gate/up projection is quantized too."""
    fusions = parse_fusions(fusions)
    decoder = target.decoder_layers()
    if not fusions or decoder is None:
        return target
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    for parent in list(target.model.base_model.modules()):
        for name, child in list(parent.named_children()):
            kind = type(child)
            if "norms" in fusions and kind is qwen3_next.Qwen3NextRMSNorm:
                setattr(parent, name, ZeroCentredRMSNorm(child))
            elif "norms" in fusions and kind is qwen3_next.Qwen3NextRMSNormGated:
                setattr(parent, name, GatedRMSNorm(child))
            elif "swiglu" in fusions and kind is qwen3_next.Qwen3NextMLP and _mergeable(child):
                setattr(parent, name, FusedMLP(child))
    if "conv" in fusions and _route_conv_in(qwen3_next):
        for layer in decoder:
            conv = getattr(getattr(layer, "linear_attn", None), "conv1d", None)
            if conv is not None:
                conv.weight.fla_conv = True  # Note [FLA causal conv]
    if "compile" in fusions:
        _opaque_dispatch(qwen3_next)
        _compile_layers(decoder)
        target.hook_capture_layers()
    return target
