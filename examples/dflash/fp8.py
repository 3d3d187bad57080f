"""The frozen target's linear layers in FP8 (e4m3): `to_fp8(module)` swaps each
`nn.Linear` inside `module` for an `FP8Linear` (or torchao's float8 inference, with
`backend="torchao"`).

FP8Linear quantizes its weight once, one scale per output channel (row-wise), and each
input row on the fly in one fused Triton kernel (`quantize_rows`: read the row, its
absolute maximum, scale, write the fp8 row and its fp32 scale), then multiplies with
`torch._scaled_mm` (row-wise scales, bf16 out, fast accumulation). On a CPU it emulates
that product exactly as defined: fp8 values times their scales, accumulated in fp32.

torch._scaled_mm's row-wise path (Hopper): a [M, K] row-major and b [K, N] column-major
(our weight [N, K] row-major, transposed), both float8_e4m3fn; scale_a [M, 1] and
scale_b [1, N] fp32; K and N multiples of 16; bf16 out, bias bf16. Layers of other
shapes stay as they are.
"""

from __future__ import annotations

import torch
from torch import nn

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
AMAX_FLOOR = 1e-12  # an all-zero row gets this amax: a finite scale, zeros out
ALIGN = 16  # torch._scaled_mm takes K and N in multiples of 16
BACKENDS = ("triton", "torchao")
GRANULARITIES = ("row",)
MIN_CAPABILITY = (9, 0)  # row-wise scaled GEMMs: Hopper and later


# --- the activation's row-wise quantization ----------------------------------------------------
def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], fp32 scales [M, 1]) with x ~ fp8 * scale: each row scaled
    so that its absolute maximum maps to FP8_MAX, rounded to nearest even."""
    amax = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_FLOOR)
    # An IEEE division, as the kernel's: torch computes `448.0 / amax` as a reciprocal
    # times 448, which is one ulp off at times.
    inverse = torch.full_like(amax, FP8_MAX) / amax
    q = (x.float() * inverse).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, amax / torch.full_like(amax, FP8_MAX)  # IEEE too: not times 1/448 on a GPU


try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs no Triton
    triton = None


if triton is not None:
    # A plain @triton.jit kernel without autotuning: pydflash's 'triton' guard makes its
    # first compile single-flight like any other's (pydflash/guards/jit.py).
    @triton.jit
    def _quantize_rows_kernel(
        x_ptr,
        q_ptr,
        scale_ptr,
        K,
        stride_x,
        stride_q,
        FLOOR: tl.constexpr,
        QMAX: tl.constexpr,
        BLOCK: tl.constexpr,
        ROUND_TO_GRID: tl.constexpr,
    ):
        # One program per row: a pass for the row's amax, a pass (from L2) to scale and
        # store. The same arithmetic as quantize_rows_reference, IEEE-rounded divisions.
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        q_row = q_ptr + row * stride_q
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, K, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        amax_row = tl.maximum(tl.max(amax, axis=0), FLOOR)
        qmax = amax_row * 0.0 + QMAX  # as a tensor, for div_rn
        inverse = tl.math.div_rn(qmax, amax_row)
        for start in range(0, K, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(x * inverse, -QMAX), QMAX)
            if ROUND_TO_GRID:
                # Note [Interpreted fp8 casts]
                bits = q.to(tl.int32, bitcast=True)
                exponent = tl.maximum((bits >> 23) & 0xFF, 127 - 6)  # e4m3's subnormal floor
                ulp = ((exponent - 3) << 23).to(tl.float32, bitcast=True)
                steps = q / ulp  # exact: ulp is a power of two; |steps| < 16
                whole = tl.floor(steps)
                half = steps - whole  # exact
                odd = (whole.to(tl.int32) & 1) == 1
                up = (half > 0.5) | ((half == 0.5) & odd)  # to nearest, ties to even
                rounded = (whole + tl.where(up, 1.0, 0.0)) * ulp
                q = tl.where(rounded == 0.0, q * 0.0, rounded)  # keeps -0.0's sign
            tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)
        tl.store(scale_ptr + row, tl.math.div_rn(amax_row, qmax))


# Note [Interpreted fp8 casts]: Triton's interpreter (TRITON_INTERPRET=1, the CPU tests)
# converts fp32 to fp8 wrongly when rounding carries into the exponent (31.7 became 16,
# not 32, with Triton 3.9) and rounds ties away from zero. Interpreted, the kernel first
# rounds to the e4m3 grid itself (to nearest even, as the hardware's cvt.rn does), so the
# cast only meets exact values. On a GPU the hardware cast rounds, after the clamp.


def _interpreting() -> bool:
    from pydflash.guards.interpreter import interpreting

    return interpreting()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16, fp16 or fp32, rows contiguous) -> (fp8 [M, K], fp32 [M, 1]) as
    quantize_rows_reference, in one Triton kernel on a GPU or under TRITON_INTERPRET=1;
    torch's ops on a CPU otherwise."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"expected a 2-D tensor with contiguous rows, got {tuple(x.shape)}")
    interpreted = not x.is_cuda and _interpreting()
    if not x.is_cuda and not interpreted:
        return quantize_rows_reference(x)
    rows, k = x.shape
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = min(max(16, 1 << (k - 1).bit_length()), 4096)
        _quantize_rows_kernel[(rows,)](
            x,
            q,
            scale,
            k,
            x.stride(0),
            q.stride(0),
            FLOOR=AMAX_FLOOR,
            QMAX=FP8_MAX,
            BLOCK=block,
            ROUND_TO_GRID=interpreted,
            num_warps=8 if block >= 4096 else 4,
        )
    return q, scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (fp8 [N, K], fp32 [1, N]): one scale per output channel."""
    q, scale = quantize_rows_reference(weight)
    return q, scale.reshape(1, -1)


# --- the linear layer --------------------------------------------------------------------------
def _fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] @ dequantized(weight [N, K]).T + bias, in x's dtype."""
    q, scale = quantize_rows(x)
    if x.is_cuda:
        return torch._scaled_mm(
            q,
            weight.t(),
            scale_a=scale,
            scale_b=weight_scale,
            bias=bias,
            out_dtype=x.dtype,
            use_fast_accum=True,
        )
    # The same product, emulated: fp8 values accumulated in fp32, then both scales.
    out = (q.float() @ weight.float().t()) * scale * weight_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


# An opaque operator for torch.compile (the decoder layers compile around it, fused.py).
# Named after this module: the example imports it as `dflash.fp8` when run as a script.
@torch.library.custom_op(f"{__name__.replace('.', '_')}::linear", mutates_args=())
def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return _fp8_linear(x, weight, weight_scale, bias)


@fp8_linear.register_fake
def _(x, weight, weight_scale, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


class FP8Linear(nn.Module):
    """A frozen nn.Linear in FP8 e4m3 with row-wise scales (see the module's text).

    The fp8 weight and its fp32 scales are kept as integer views (uint8, int32), so a
    later `module.to(dtype)` moves them without converting them."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            q, scale = quantize_weight(linear.weight)
        self.register_buffer("weight_bits", q.view(torch.uint8))
        self.register_buffer("scale_bits", scale.contiguous().view(torch.int32))
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @property
    def weight_fp8(self) -> torch.Tensor:
        return self.weight_bits.view(torch.float8_e4m3fn)

    @property
    def weight_scale(self) -> torch.Tensor:
        return self.scale_bits.view(torch.float32)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as the GEMM sees it, [N, K] fp32."""
        return self.weight_fp8.float() * self.weight_scale.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) != self.in_features):
            rows = rows.contiguous()
        bias = None if self.bias is None else self.bias.to(x.dtype)
        out = fp8_linear(rows, self.weight_fp8, self.weight_scale, bias)
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, e4m3, row-wise scales"
        )


def fits(linear: nn.Module) -> bool:
    """An nn.Linear whose K and N torch._scaled_mm takes."""
    return (
        type(linear) is nn.Linear
        and linear.in_features % ALIGN == 0
        and linear.out_features % ALIGN == 0
    )


def _check_device(module: nn.Module, backend: str) -> torch.device:
    tensors = [*module.parameters(), *module.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            raise ValueError(
                f"expected a GPU with row-wise FP8 GEMMs (compute capability "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later), got "
                f"{torch.cuda.get_device_name(device)} ({capability[0]}.{capability[1]})"
            )
    elif backend == "torchao":
        raise ValueError(f"expected a CUDA device for torchao's float8, got {device}")
    return device


def torchao_available() -> bool:
    try:
        from torchao.quantization import (  # noqa: F401
            Float8DynamicActivationFloat8WeightConfig,
            PerRow,
            quantize_,
        )
    except ImportError:
        return False
    return True


def to_fp8(
    module: nn.Module | None, *, granularity: str = "row", backend: str = "triton"
) -> nn.Module | None:
    """Swaps every nn.Linear inside `module` whose shapes fit (`fits`) for its FP8
    version, in place, and returns `module`: a whole target (HFTarget, HybridTarget)
    or its decoder layers. The LM head (`module.get_output_embeddings()`), which the
    drafter copies, stays as it is; the embedding is not a linear layer. `backend`
    "torchao" uses torchao's float8 inference (Float8DynamicActivationFloat8WeightConfig,
    PerRow) instead of FP8Linear."""
    if module is None:
        raise ValueError("expected a module with linear layers, got None")
    if granularity not in GRANULARITIES:
        raise ValueError(f"expected granularity in {GRANULARITIES}, got {granularity!r}")
    if backend not in BACKENDS:
        raise ValueError(f"expected backend in {BACKENDS}, got {backend!r}")
    _check_device(module, backend)
    if backend == "torchao":
        if not torchao_available():
            raise ValueError("expected torchao to be importable for backend 'torchao'")
        from torchao.quantization import (
            Float8DynamicActivationFloat8WeightConfig,
            PerRow,
            quantize_,
        )

        config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
        kept = _output_head(module)
        quantize_(module, config, filter_fn=lambda m, _name: fits(m) and m is not kept)
        return module
    kept = _output_head(module)
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if fits(child) and child is not kept:
                setattr(parent, name, FP8Linear(child))
    return module


def _output_head(module: nn.Module) -> nn.Module | None:
    """The LM head of a target (HFTarget, HybridTarget, a transformers model), if any:
    left as it is, since drafters copy it (and the target's forward never runs it)."""
    get = getattr(module, "get_output_embeddings", None)
    try:
        return get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        return None
