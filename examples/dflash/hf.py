"""A Hugging Face causal LM as the frozen target: a local checkpoint (`from_pretrained`,
never a download) or a Qwen3-Next or dense Qwen3 (Qwen3-8B's shapes) built from a config
with random weights.

Its features are the outputs of chosen decoder layers, concatenated, as EAGLE-3 and
DFlash drafters take them: layer i's output is what `hidden_states[i + 1]` of the
model's `output_hidden_states` holds (entry 0 is the embedding); the last layer's comes
after the final norm, as Hugging Face returns it. Only those outputs are kept, and the
layers after the last one chosen do not run (Note [Capture layers only]).

`HFTargetConfig(..., fp8=True)` runs the decoder layers' linear layers in FP8 (fp8.py);
`fused=("norms", ...)` swaps in fused elementwise modules (fused.py). Both are opt-in.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .fp8 import to_fp8
from .fused import fuse, parse_fusions


def _scaled(hidden: int, layers: int) -> dict[str, int]:
    """One 128-wide head per 128 of width, the configuration of the measurements in the
    project's facts. Qwen3NextConfig's fixed defaults (16 attention heads of 256, 32
    value heads of 128) are sized for a 2048-wide model: at width 1024 they make the
    attention four times the width, and the GPU time of a forward larger."""
    return dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=3 * hidden,
        num_attention_heads=hidden // 128,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_value_heads=hidden // 128,
        linear_num_key_heads=hidden // 256,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=hidden // 2,
    )


# Qwen3NextConfig's defaults but for these: the layer count and width named in the
# bench's facts, and a dense MLP (num_experts=0) unless MoE is asked for. The vocabulary
# is 32,000, the size of EAGLE-3's draft vocabulary: the drafter's head is over it, so a
# 152k-way head does not outweigh the target in the pipeline's step.
QWEN3_NEXT = {
    "qwen3-next-tiny": dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "qwen3-next-small": dict(vocab_size=32000, **_scaled(hidden=1024, layers=8)),
    "qwen3-next-medium": dict(vocab_size=32000, **_scaled(hidden=2048, layers=16)),
    # The scale users train at: about 23 B parameters, the 80 B model's attention (24
    # heads of 256, 4 KV heads: SDPA takes cuDNN's attention) and linear-attention heads,
    # a dense MLP. Build it on the GPU (`with torch.device("cuda")`, bf16), not on a CPU.
    "qwen3-next-large": dict(
        vocab_size=151936,
        hidden_size=5120,
        num_hidden_layers=64,
        intermediate_size=17408,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_value_heads=32,
        linear_num_key_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
    ),
}
# Qwen3-Next routes each token to 10 of 512 experts; at 16 experts, 2 keeps it sparse.
MOE = dict(num_experts=16, num_experts_per_tok=2)

# Dense Qwen3 targets (transformers' Qwen3Config): Qwen3-8B's published shapes, 7.57 B
# parameters with its untied 151,936-token head, and a tiny one of the same kind for CPUs.
QWEN3 = {
    "qwen3-8b": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    "qwen3-tiny": dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
    ),
}
CONFIGS = (*QWEN3_NEXT, *QWEN3)


def dflash_layers(n: int, drafter_layers: int) -> tuple[int, ...]:
    """DFlash's choice of feature layers in an n-layer target: one per drafter layer,
    evenly spaced from layer 1 to layer n - 3 (Qwen3-8B, 5 layers: 1, 9, 17, 25, 33)."""
    if drafter_layers == 1:
        return (n // 2,)
    span = n - 4
    return tuple(
        sorted({round(1 + i * span / (drafter_layers - 1)) for i in range(drafter_layers)})
    )


def default_layers(n: int) -> tuple[int, ...]:
    """EAGLE-3's choice of feature layers (low, middle, high) in an n-layer model."""
    return tuple(sorted({min(max(i, 0), n - 1) for i in (1, n // 2 - 1, n - 4)}))


def parse_layers(text: str) -> tuple[int, ...]:
    """'1,3,5' -> (1, 3, 5); ValueError on anything else."""
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(
            f"expected comma-separated layer indices like 1,3,5, got {text!r}"
        ) from None
    if len(set(layers)) != len(layers):
        raise ValueError(f"expected distinct layer indices, got {text!r}")
    return tuple(sorted(layers))


@dataclasses.dataclass(frozen=True)
class HFTargetConfig:
    """What builds a Hugging Face target: `source` is a local checkpoint directory or a
    name in QWEN3_NEXT; `capture_layers` the decoder layers whose outputs are the
    features. Make one with `load`, which reads the model's config."""

    source: str  # a checkpoint directory or a name in CONFIGS
    capture_layers: tuple[int, ...]
    config: Any = dataclasses.field(compare=False, repr=False)  # transformers' config
    fp8: bool = False  # the decoder layers' linear layers in FP8 (fp8.to_fp8)
    fp8_backend: str = "triton"  # fp8.BACKENDS: our fused quantization, or torchao's
    fused: tuple[str, ...] = ()  # fused.FUSIONS to apply (fused.fuse)

    @classmethod
    def load(
        cls, source: str | Path, layers: tuple[int, ...] | None = None, moe: bool = False
    ) -> HFTargetConfig:
        from transformers import AutoConfig, Qwen3Config, Qwen3NextConfig

        source = str(source)
        if source in QWEN3_NEXT:
            config = Qwen3NextConfig(**QWEN3_NEXT[source], **(MOE if moe else dict(num_experts=0)))
        elif source in QWEN3:
            if moe:
                raise ValueError(f"expected --moe only with a Qwen3-Next config, got {source}")
            config = Qwen3Config(**QWEN3[source])
        elif Path(source).is_dir():
            if moe:
                raise ValueError(
                    "expected --moe only with a Qwen3-Next config name, got a checkpoint"
                )
            config = AutoConfig.from_pretrained(source, local_files_only=True)
        else:
            raise ValueError(
                f"expected a local checkpoint directory or one of {', '.join(CONFIGS)}, "
                f"got {source!r}"
            )
        n = config.get_text_config().num_hidden_layers
        layers = default_layers(n) if layers is None else tuple(layers)
        bad = [i for i in layers if not 0 <= i < n]
        if bad or not layers:
            raise ValueError(f"expected target layers in [0, {n}), got {layers}")
        return cls(source, layers, config)

    @property
    def vocab(self) -> int:
        return self.config.get_text_config().vocab_size

    @property
    def dim(self) -> int:
        return self.config.get_text_config().hidden_size

    def build(
        self,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        *,
        fp8: bool | None = None,
        fused: tuple[str, ...] | None = None,
    ) -> HFTarget:
        """The model on `device` in eval mode with frozen weights: loaded from the
        checkpoint, or with random weights drawn from torch's generator (seed it first)
        on `device` itself, in `dtype`, with no pass on the host. `fp8` (default: the
        config's) quantizes the decoder layers' linear layers once, after the weights
        are drawn (fp8.to_fp8); the embedding and the LM head, which the drafter
        copies, stay in `dtype`. `fused` (default: the config's) swaps in fused
        elementwise modules (fused.fuse); layers compile after the FP8 swap."""
        from transformers import AutoModelForCausalLM

        _cpu_tensors_take_torch_kernels()
        if self.source in CONFIGS:
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(self.config, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                self.source, local_files_only=True, dtype=dtype
            ).to(device)
        target = HFTarget(model, self.capture_layers).eval().requires_grad_(False)
        fusions = parse_fusions(self.fused if fused is None else fused)
        fuse(target, [f for f in fusions if f != "compile"])
        if self.fp8 if fp8 is None else fp8:
            to_fp8(target.decoder_layers(), backend=self.fp8_backend)
        if "compile" in fusions:
            fuse(target, ["compile"])
        return target.requires_grad_(False)


def _cpu_tensors_take_torch_kernels() -> None:
    """transformers' Qwen3-Next takes flash-linear-attention's gated-delta-rule kernels
    whenever FLA is installed, whatever device the tensors are on; they are Triton
    kernels, for GPUs only. Routes CPU tensors (the tests, `--devices cpu`) to
    transformers' own PyTorch implementation, the one it uses without FLA. Idempotent."""
    if importlib.util.find_spec("fla") is None:
        return
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        chosen = getattr(qwen3_next, name, None)
        reference = getattr(chosen, "__wrapped__", None)  # under transformers' kernel wrapper
        if reference is None or getattr(chosen, "routes_cpu_tensors", False):
            continue
        takes = inspect.signature(reference).parameters

        @functools.wraps(chosen)
        def routed(query, *args, _chosen=chosen, _reference=reference, _takes=takes, **kwargs):
            if query.device.type != "cpu":
                return _chosen(query, *args, **kwargs)
            return _reference(query, *args, **{k: v for k, v in kwargs.items() if k in _takes})

        routed.routes_cpu_tensors = True
        setattr(qwen3_next, name, routed)


# Note [Capture layers only]: transformers' `output_hidden_states=True` keeps every
# layer's output until the forward returns (65 of them at 64 layers, about 0.34 GB each
# per 32k tokens at width 5120), and every layer runs, then the final norm. The drafter
# needs the capture layers' outputs only. So a forward hook on each capture layer keeps
# its output, and the last one's hook stops the forward by raising `_CapturedAll`, which
# HFTarget.forward catches: the layers after it do not run and nothing else is kept.
# The exception passes through transformers' forward, whose output capture resets its
# ContextVar in a `finally`. When the model's last layer is a capture layer, the forward
# runs to the end and that layer's feature is `last_hidden_state` (after the final norm,
# as `hidden_states[-1]` is). The hooks' collector is per thread: lanes may run one
# model's forward at once. The features equal `output_hidden_states`' bit for bit.
class _CapturedAll(Exception):
    """Raised by the last capture layer's hook: the rest of the forward is not needed."""


# (the HFTarget whose forward runs on this thread, its kept outputs); module-level, so
# that an HFTarget deep-copies (the example copies the target to each target device).
_collector = threading.local()


class HFTarget(nn.Module):
    """forward(input_ids) -> the capture layers' outputs, concatenated:
    [B, T, len(layers) * hidden]. The base model runs without its LM head and stops after
    the last capture layer (Note [Capture layers only])."""

    def __init__(self, model: nn.Module, layers: tuple[int, ...]) -> None:
        super().__init__()
        self.model = model
        self.layers = tuple(layers)
        text_config = model.config.get_text_config()
        self.feature_dim = len(self.layers) * text_config.hidden_size
        self._hooks: list[Any] = []
        decoder = self.decoder_layers()
        # Unless the last layer is a capture layer (its feature is last_hidden_state).
        self._stop_early = decoder is not None and len(decoder) - 1 not in self.layers
        self.hook_capture_layers()

    def hook_capture_layers(self) -> None:
        """(Re)registers the capture hooks on the decoder layers now in place: call it
        after replacing one (fused.py's compiled layers do)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        decoder = self.decoder_layers()
        if decoder is None:
            return
        for i in self.layers:
            if i == len(decoder) - 1:  # its feature is last_hidden_state
                continue
            last = self._stop_early and i == max(self.layers)
            hook = functools.partial(self._keep, i, last)
            self._hooks.append(decoder[i].register_forward_hook(hook))

    def decoder_layers(self) -> nn.ModuleList | None:
        """The base model's decoder layers (`base_model.layers`), or None."""
        layers = getattr(self.model.base_model, "layers", None)
        return layers if isinstance(layers, nn.ModuleList) else None

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def _keep(self, index: int, last: bool, module: nn.Module, args: Any, output: Any) -> None:
        owner, kept = getattr(_collector, "state", (None, None))
        if owner is not self:  # the model called directly, not through this forward
            return
        kept[index] = output[0] if isinstance(output, tuple) else output
        if last:
            raise _CapturedAll

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        base = self.model.base_model
        if self.decoder_layers() is None:
            out = base(input_ids=input_ids, use_cache=False, output_hidden_states=True)
            return torch.cat([out.hidden_states[i + 1] for i in self.layers], dim=-1)
        kept: dict[int, torch.Tensor] = {}
        _collector.state = (self, kept)
        try:
            out = base(input_ids=input_ids, use_cache=False)
            if self._stop_early:
                raise RuntimeError(
                    f"the forward returned before capture layer {max(self.layers)} ran"
                )
            kept[len(self.decoder_layers()) - 1] = out.last_hidden_state
        except _CapturedAll:
            pass
        finally:
            _collector.state = (None, None)
        return torch.cat([kept[i] for i in self.layers], dim=-1)
