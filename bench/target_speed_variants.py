"""The target variants bench/target_speed.py times: their switches, the device they run
on (--device), building each with the same random weights, the noise floor's one-ulp
input, and the forward each runs."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import Any

import torch

DEVICE = torch.device("cuda:0")  # --device


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    fp8: bool = False
    fp8_backend: str = "triton"
    fused: tuple[str, ...] = ()
    all_hidden: bool = False  # the old forward: every layer's output kept
    perturbed: bool = False  # the noise floor: embeddings moved one ulp (perturb_embeddings)
    needs: str = ""  # "fla", "torchao" or "" (what must import)
    group: str = ""  # "": the default run's; "singles" / "compile": behind those flags


FLA = ("norms", "swiglu", "conv")
VARIANTS = (
    Variant("bf16 all hidden states", all_hidden=True),
    Variant("bf16"),
    Variant("bf16 1-ulp input", perturbed=True),
    Variant("fp8", fp8=True),
    Variant("fp8 torchao", fp8=True, fp8_backend="torchao", needs="torchao"),
    Variant("bf16+fla", fused=FLA, needs="fla"),
    Variant("fp8+fla", fp8=True, fused=FLA, needs="fla"),
    Variant("bf16+norms", fused=("norms",), needs="fla", group="singles"),
    Variant("bf16+swiglu", fused=("swiglu",), needs="fla", group="singles"),
    Variant("bf16+conv", fused=("conv",), needs="fla", group="singles"),
    # Last: Inductor's compile takes a minute or two each.
    Variant("fp8+fla+compile", fp8=True, fused=(*FLA, "compile"), group="compile"),
    Variant("bf16+compile", fused=("compile",), group="compile"),
)
BASELINE, CAPTURE_ONLY = VARIANTS[0].name, VARIANTS[1].name
# The fidelity steps' targets: the reference, FP8, and the noise floor.
FIDELITY = (VARIANTS[1], VARIANTS[3], VARIANTS[2])


def use_device(device: str) -> None:
    """Run every variant on `device` (the command's --device)."""
    global DEVICE
    DEVICE = torch.device(device)


def importable(needs: str) -> bool:
    if needs == "fla":
        from examples.dflash.fused import fla_available

        return fla_available()
    if needs == "torchao":
        from examples.dflash.fp8 import torchao_available

        return torchao_available()
    return True


def on_gpu() -> bool:
    return DEVICE.type == "cuda"


def free() -> None:
    gc.collect()
    if on_gpu():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def synchronize() -> None:
    if on_gpu():
        torch.cuda.synchronize()


def allocated() -> int:
    return torch.cuda.memory_allocated() if on_gpu() else 0


def peak() -> int:
    return torch.cuda.max_memory_allocated() if on_gpu() else 0


# The integer views that step a float's bit pattern by one ulp.
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def one_ulp(x: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """x with each value's magnitude one ulp larger where `up`, one smaller elsewhere (zeros
    stay zero there): the bit pattern plus or minus one, which moves the magnitude for
    either sign (sign and magnitude are apart in IEEE formats)."""
    bits = x.view(_BITS[x.dtype])
    magnitude = bits & torch.iinfo(bits.dtype).max
    step = torch.where(up, 1, torch.where(magnitude > 0, -1, 0)).to(bits.dtype)
    return (bits + step).view(x.dtype)


def perturb_embeddings(target: Any) -> None:
    """The noise floor's input: each embedding value moved one ulp (of its dtype) up or
    down in magnitude, the direction drawn from a fixed seed; far below FP8's rounding."""

    def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator(out.device).manual_seed(7)
        return one_ulp(out, torch.rand(out.shape, generator=generator, device=out.device) < 0.5)

    target.get_input_embeddings().register_forward_hook(hook)


def build(config: Any, variant: Variant) -> Any:
    """The target with the variant's switches, the same random weights every time."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(config, fp8=variant.fp8, fp8_backend=variant.fp8_backend)
    dtype = torch.bfloat16 if on_gpu() else torch.float32  # as the example's loops
    target = cfg.build(dtype, str(DEVICE), fused=variant.fused)
    if variant.perturbed:
        perturb_embeddings(target)
    return target


def features_fn(target: Any, variant: Variant, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    if not variant.all_hidden:
        return lambda: target(ids)

    def all_hidden() -> torch.Tensor:
        out = target.model.base_model(input_ids=ids, use_cache=False, output_hidden_states=True)
        return torch.cat([out.hidden_states[i + 1] for i in target.layers], dim=-1)

    return all_hidden
