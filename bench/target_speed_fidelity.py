"""The fidelity bench/target_speed.py measures beside the speed (Note [Random weights
amplify] there): each capture layer's error against bf16, each FP8 GEMM's error on the
real activations of the first decoder layers, and the DFlash drafter's losses trained on
each target's features."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import statistics
from typing import Any

import torch

from bench import target_speed_variants as variants
from bench.target_speed_variants import FIDELITY, build, free, on_gpu

GEMM_LAYERS = 4  # the first decoder layers whose linear layers' FP8 error is measured


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def layer_errors(got: torch.Tensor, want: torch.Tensor, layers: int) -> list[float]:
    """The relative error of each capture layer's output: the features are the layers'
    outputs concatenated on the last dimension."""
    pairs = zip(got.chunk(layers, dim=-1), want.chunk(layers, dim=-1), strict=True)
    return [relative_error(g, w) for g, w in pairs]


class _Enough(Exception):
    """Raised after the layers gemm_errors measures: the rest of the forward is not needed."""


def gemm_errors(target: Any, ids: torch.Tensor, layers: int = GEMM_LAYERS) -> list[dict]:
    """Each linear layer of the first `layers` decoder layers of a bf16 target on the
    activations it gets in a forward of `ids`: the relative error of FP8Linear's output
    and of the bf16 output, each against the product in fp32 (fp32 inputs and weight)."""
    from examples.dflash.fp8 import FP8Linear, fits

    decoder = target.decoder_layers()
    out: list[dict] = []

    def compare(name: str, module: torch.nn.Module, args: Any, got: torch.Tensor) -> None:
        x = args[0]
        exact = torch.nn.functional.linear(
            x.float(), module.weight.float(), None if module.bias is None else module.bias.float()
        )
        fp8 = FP8Linear(module)(x)
        out.append(
            {
                "layer": name,
                "shape": [x.numel() // x.shape[-1], module.in_features, module.out_features],
                "fp8_rel_error": relative_error(fp8, exact),
                "bf16_rel_error": relative_error(got, exact),
                "fp8_vs_bf16": relative_error(fp8, got),
            }
        )
        del exact, fp8

    def stop(*_: Any) -> None:
        raise _Enough

    handles = [decoder[min(layers, len(decoder)) - 1].register_forward_hook(stop)]
    for i, layer in enumerate(decoder[:layers]):
        for name, module in layer.named_modules():
            if fits(module):
                hook = functools.partial(compare, f"{i}.{name}")
                handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            target(ids)
    except _Enough:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return out


def fidelity(config: Any, args: argparse.Namespace) -> dict:
    """The drafter's losses over the same steps, from the same initial drafter and data
    (AdamW, a microbatch a step), trained on the features of each of FIDELITY's targets,
    and those features' per-layer errors against the first's."""
    from examples.dflash.data import MarkovTokens
    from examples.dflash.loops import drafter_loss
    from examples.dflash.models import DRAFTERS, BlockDrafter

    block = 8  # the 27 B recipe's drafter: block 8, 512 anchors (fewer in a short smoke run)
    anchors = min(512, args.seq - block + 1)
    cfg = dataclasses.replace(DRAFTERS[args.drafter], block=block, anchors=anchors)
    data = MarkovTokens(
        config.vocab, args.seq, args.batch, seed=5, anchors=cfg.anchors, block=block
    )
    batches = [
        {k: t.to(variants.DEVICE) for k, t in data.batch(i).items()}
        for i in range(args.fidelity_steps)
    ]
    reference: list[torch.Tensor] = []
    initial = None
    losses: dict[str, list[float]] = {}
    errors: dict[str, list[list[float]]] = {}
    failed: dict[str, str] = {}
    for variant in FIDELITY:
        target = drafter = optimizer = None
        try:
            target = build(config, variant)
            if initial is None:  # built from the bf16 target: its embedding and head copied
                torch.manual_seed(1)
                with variants.DEVICE:
                    initial = BlockDrafter(target, cfg)
                if on_gpu():  # as the example's drafter: frozen copies in the target's dtype
                    initial.embed.to(torch.bfloat16)
                    initial.lm_head.to(torch.bfloat16)
            drafter = copy.deepcopy(initial)
            trained = [p for p in drafter.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(
                trained, lr=args.fidelity_lr, weight_decay=0.0, fused=on_gpu()
            )
            curve, by_step = [], []
            for i, batch in enumerate(batches):
                with torch.no_grad():
                    features = target(batch["input_ids"])
                if len(reference) < len(batches):
                    reference.append(features)
                by_step.append(layer_errors(features, reference[i], len(target.layers)))
                loss = drafter_loss(drafter, {**batch, "features": features})
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                curve.append(loss.item())
                del features, loss
            losses[variant.name], errors[variant.name] = curve, by_step
        except Exception as exc:  # costs this target's curve, not the others'
            if variant is FIDELITY[0]:  # the reference: nothing to compare with
                raise
            failed[variant.name] = f"{type(exc).__name__}: {exc}"[:300]
        del target, drafter, optimizer
        free()
    del reference, initial
    free()
    base = losses[FIDELITY[0].name]
    last = {name: curve[-1] for name, curve in losses.items()}
    return {
        "drafter": dataclasses.asdict(cfg),
        "steps": args.fidelity_steps,
        "lr": args.fidelity_lr,
        "losses": losses,
        "last_loss": last,
        "last_loss_relative_difference": {
            name: (value - base[-1]) / abs(base[-1]) for name, value in last.items()
        },
        "mean_loss_relative_difference": {
            name: statistics.mean((a - b) / abs(b) for a, b in zip(curve, base, strict=True))
            for name, curve in losses.items()
        },
        "layer_rel_errors_by_step": errors,
        "failed": failed,
    }
