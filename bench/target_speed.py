"""What makes the frozen target cheaper: the 23 B Qwen3-Next-style hybrid
(`qwen3-next-large` in examples/dflash/hf.py, random weights, built on the GPU) at
2 x 4,787 tokens, the long workload's mean microbatch, one forward per variant:

- bf16 with every layer's output kept (`output_hidden_states=True`, the old forward);
- bf16 keeping only the capture layers' outputs (Note [Capture layers only]);
- FP8 linear layers: ours (examples/dflash/fp8.py: a fused row-wise quantization
  kernel and torch._scaled_mm), and torchao's float8 inference when it imports;
- fused elementwise work (examples/dflash/fused.py): each of FLA's norms, swiglu and
  causal conv alone, all three, with FP8, and each decoder layer torch.compile'd.

Per variant: GPU time of a forward by CUDA events (median of --reps after warm-up; the
first call's time, which includes Triton's autotuning or Inductor's compile, is
reported apart), the speed against both bf16 rows of this run, the features' relative
error against the bf16 features on the same input, and peak memory. Then a fidelity
row: the DFlash drafter's losses over the same few steps on the bf16 target's features
and on the FP8 target's.

    python -m bench.target_speed [--out DIR] [--only fp8,fp8+fla] [--no-compile]

Writes target_speed.json and target_speed.txt to --out (default: $OUT, else
out/target_speed) and prints the table last. Needs a GPU with FP8 (compute capability
9.0+), about 100 GB of GPU memory and transformers; FLA for the fused rows. It stops
starting new variants after --budget seconds (default 150) and says which it skipped.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CONFIG = "qwen3-next-large"
SEQ, BATCH = 4787, 2  # the long workload's mean microbatch (issue 33)
DRAFTER_LAYERS = 5
DEVICE = torch.device("cuda:0")  # --device


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    fp8: bool = False
    fp8_backend: str = "triton"
    fused: tuple[str, ...] = ()
    all_hidden: bool = False  # the old forward: every layer's output kept
    needs: str = ""  # "fla", "torchao" or "" (what must import)


VARIANTS = (
    Variant("bf16 all hidden states", all_hidden=True),
    Variant("bf16"),
    Variant("fp8", fp8=True),
    Variant("fp8 torchao", fp8=True, fp8_backend="torchao", needs="torchao"),
    Variant("bf16+norms", fused=("norms",), needs="fla"),
    Variant("bf16+swiglu", fused=("swiglu",), needs="fla"),
    Variant("bf16+conv", fused=("conv",), needs="fla"),
    Variant("bf16+fla", fused=("norms", "swiglu", "conv"), needs="fla"),
    Variant("fp8+fla", fp8=True, fused=("norms", "swiglu", "conv"), needs="fla"),
    # Last: Inductor's compile takes a minute or two (the budget may skip them).
    Variant("fp8+fla+compile", fp8=True, fused=("norms", "swiglu", "conv", "compile")),
    Variant("bf16+compile", fused=("compile",)),
)
BASELINE, CAPTURE_ONLY = VARIANTS[0].name, VARIANTS[1].name


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/target_speed")))
    p.add_argument("--config", default=CONFIG, help="a name in examples/dflash/hf.py's CONFIGS")
    p.add_argument("--seq", type=int, default=SEQ)
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--reps", type=int, default=3, help="timed forwards per variant")
    p.add_argument("--warmup", type=int, default=1, help="untimed forwards after the first")
    p.add_argument("--only", help="comma-separated variant names (default: all)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    p.add_argument(
        "--budget", type=float, default=150.0, help="seconds after which no variant starts"
    )
    p.add_argument("--fidelity-steps", type=int, default=3, help="0: no fidelity row")
    p.add_argument("--device", default="cuda:0", help="cpu: a smoke run (FP8 emulated)")
    p.add_argument(
        "--drafter",
        default="dflash-b16",
        help="the fidelity row's drafter (examples/dflash/models.py's DRAFTERS), at block 8 "
        "with 512 anchors as the 27 B recipe's",
    )
    args = p.parse_args(argv)
    names = [v.name for v in VARIANTS]
    if args.only:
        args.only = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in args.only if n not in names]
        if unknown:
            p.error(f"--only: expected names from {names}, got {unknown}")
    return args


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


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def gpu_ms(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(milliseconds of GPU time between events around fn(), its result)."""
    if not on_gpu():  # a smoke run: wall time
        t0 = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t0) * 1e3, out
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end), out


def build(config: Any, variant: Variant) -> Any:
    """The target with the variant's switches, the same random weights every time."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(config, fp8=variant.fp8, fp8_backend=variant.fp8_backend)
    dtype = torch.bfloat16 if on_gpu() else torch.float32  # as the example's loops
    return cfg.build(dtype, str(DEVICE), fused=variant.fused)


def features_fn(target: Any, variant: Variant, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    if not variant.all_hidden:
        return lambda: target(ids)

    def all_hidden() -> torch.Tensor:
        out = target.model.base_model(input_ids=ids, use_cache=False, output_hidden_states=True)
        return torch.cat([out.hidden_states[i + 1] for i in target.layers], dim=-1)

    return all_hidden


def measure(config: Any, variant: Variant, ids: torch.Tensor, args, reference) -> dict:
    row: dict[str, Any] = {"variant": variant.name}
    t0 = time.perf_counter()
    target = build(config, variant)
    synchronize()
    row["build_s"] = time.perf_counter() - t0
    row["weights_bytes"] = allocated()
    forward = features_fn(target, variant, ids)
    with torch.no_grad():
        t0 = time.perf_counter()
        forward()
        synchronize()
        row["first_call_s"] = time.perf_counter() - t0  # autotuning, compiles
        for _ in range(args.warmup):
            forward()
        free()
        # The peak of the timed calls (autotuning's and compiles' buffers are gone by then),
        # each output freed before the next call, as in a loop.
        if on_gpu():
            torch.cuda.reset_peak_memory_stats()
        before = allocated()
        times, features = [], None
        for _ in range(args.reps):
            features = None
            ms, features = gpu_ms(forward)
            times.append(ms)
        row["peak_bytes"] = peak()
        row["forward_peak_bytes"] = row["peak_bytes"] - before
    row["gpu_ms_median"] = statistics.median(times)
    row["gpu_ms_all"] = times
    if reference.get("features") is None:
        reference["features"] = features.detach()
    row["features_rel_error"] = relative_error(features, reference["features"])
    row["features_shape"] = list(features.shape)
    del target, forward, features
    free()
    return row


def fidelity(config: Any, args: argparse.Namespace) -> dict:
    """The drafter's losses over the same steps on a bf16 target's features and on the
    FP8 target's: the same initial drafter, the same data, AdamW, a microbatch a step."""
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
        {k: t.to(DEVICE) for k, t in data.batch(i).items()} for i in range(args.fidelity_steps)
    ]
    features: dict[str, list[torch.Tensor]] = {}
    initial = None
    for name, fp8 in (("bf16", False), ("fp8", True)):
        target = build(config, Variant(name, fp8=fp8))
        with torch.no_grad():
            features[name] = [target(b["input_ids"]) for b in batches]
        if initial is None:  # built from the bf16 target: its embedding and head copied
            torch.manual_seed(1)
            with DEVICE:
                initial = BlockDrafter(target, cfg)
            if on_gpu():  # as the example's drafter: frozen copies in the target's dtype
                initial.embed.to(torch.bfloat16)
                initial.lm_head.to(torch.bfloat16)
        del target
        free()
    losses: dict[str, list[float]] = {}
    for name in ("bf16", "fp8"):
        drafter = copy.deepcopy(initial)
        params = [p for p in drafter.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=on_gpu())
        losses[name] = []
        for batch, feats in zip(batches, features[name], strict=True):
            loss = drafter_loss(drafter, {**batch, "features": feats})
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
        del drafter, optimizer, params
        free()
    feature_errors = [
        relative_error(f, b) for f, b in zip(features["fp8"], features["bf16"], strict=True)
    ]
    del features, initial
    free()
    gap = [abs(a - b) / abs(a) for a, b in zip(losses["bf16"], losses["fp8"], strict=True)]
    return {
        "drafter": dataclasses.asdict(cfg),
        "steps": args.fidelity_steps,
        "loss_bf16_target": losses["bf16"],
        "loss_fp8_target": losses["fp8"],
        "loss_relative_gap": gap,
        "features_rel_error": feature_errors,
    }


def table(rows: list[dict], fidelity_row: dict | None) -> str:
    by_name = {r["variant"]: r for r in rows if "gpu_ms_median" in r}
    base = by_name.get(BASELINE, {}).get("gpu_ms_median")
    capture = by_name.get(CAPTURE_ONLY, {}).get("gpu_ms_median")
    head = (
        f"{'variant':<24} {'GPU ms':>8} {'x all-hid':>9} {'x bf16':>7} {'rel err':>8} "
        f"{'peak GB':>8} {'fwd GB':>7} {'1st s':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if "gpu_ms_median" not in r:
            lines.append(f"{r['variant']:<24} {r.get('skipped') or 'failed: ' + r['error']}")
            continue
        ms = r["gpu_ms_median"]
        lines.append(
            f"{r['variant']:<24} {ms:8.1f} {base / ms if base else float('nan'):9.2f} "
            f"{capture / ms if capture else float('nan'):7.2f} "
            f"{r['features_rel_error']:8.4f} {r['peak_bytes'] / 1e9:8.1f} "
            f"{r['forward_peak_bytes'] / 1e9:7.1f} {r['first_call_s']:7.1f}"
        )
    if fidelity_row is not None:
        if "error" in fidelity_row:
            lines.append(f"fidelity: failed: {fidelity_row['error']}")
        else:
            fmt = ", ".join
            lines.append(
                f"fidelity ({fidelity_row['steps']} steps): drafter loss on bf16 features "
                f"[{fmt(f'{x:.4f}' for x in fidelity_row['loss_bf16_target'])}], on FP8 "
                f"[{fmt(f'{x:.4f}' for x in fidelity_row['loss_fp8_target'])}]; relative gap "
                f"max {max(fidelity_row['loss_relative_gap']):.2e}; FP8 features' error "
                f"{max(fidelity_row['features_rel_error']):.4f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    if on_gpu() and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    from examples.dflash.hf import HFTargetConfig, dflash_layers
    from pydflash.guards import install_guards

    # Held to the end: our Triton kernel's first compile and torch.compile's go through
    # pydflash's guards, as they do on the pipeline's lanes.
    guards = install_guards(missing_ok=True)
    started = time.perf_counter()
    n = HFTargetConfig.load(args.config).config.num_hidden_layers
    config = HFTargetConfig.load(args.config, dflash_layers(n, DRAFTER_LAYERS))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab, (args.batch, args.seq), generator=generator).to(DEVICE)
    rows: list[dict] = []
    reference: dict[str, Any] = {}
    wanted = [v for v in VARIANTS if args.only is None or v.name in args.only]
    if args.only and BASELINE not in args.only:  # the reference features and speed
        wanted.insert(0, VARIANTS[0])
    for variant in wanted:
        elapsed = time.perf_counter() - started
        if args.no_compile and "compile" in variant.fused:
            rows.append({"variant": variant.name, "skipped": "skipped: --no-compile"})
        elif not importable(variant.needs):
            rows.append({"variant": variant.name, "skipped": f"skipped: {variant.needs} absent"})
        elif elapsed > args.budget and variant.name != BASELINE:
            rows.append(
                {"variant": variant.name, "skipped": f"skipped: over budget ({elapsed:.0f} s)"}
            )
        else:
            try:
                rows.append(measure(config, variant, ids, args, reference))
            except Exception as exc:  # noqa: BLE001 - one failure must not lose the other rows
                rows.append(
                    {
                        "variant": variant.name,
                        "error": f"{type(exc).__name__}: {exc}"[:300],
                        "traceback": traceback.format_exc()[-4000:],
                    }
                )
            free()  # here, not in the handler: the traceback's frames hold the model
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "traceback"}), flush=True)
    reference.clear()
    free()
    fidelity_row = None
    if args.fidelity_steps > 0:
        try:
            fidelity_row = fidelity(config, args)
        except Exception as exc:  # noqa: BLE001 - the failure is what the row reports
            fidelity_row = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            fidelity_row["traceback"] = traceback.format_exc()[-4000:]
    total = time.perf_counter() - started
    text = table(rows, fidelity_row)
    summary = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(DEVICE) if on_gpu() else platform.processor(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config": args.config,
        "capture_layers": list(config.capture_layers),
        "tokens": [args.batch, args.seq],
        "reps": args.reps,
        "total_s": total,
        "rows": rows,
        "fidelity": fidelity_row,
    }
    for name in ("triton", "fla", "torchao", "transformers"):
        try:
            module = __import__(name)
            summary[name] = getattr(module, "__version__", "?")
        except ImportError:
            summary[name] = None
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "target_speed.json").write_text(json.dumps(summary, indent=1))
    header = (
        f"{summary['device']}, torch {summary['torch']}, {args.config} at "
        f"{args.batch} x {args.seq} tokens, capture layers {list(config.capture_layers)}, "
        f"median of {args.reps}; {total:.0f} s in all\n"
        "x all-hid / x bf16: speed against the bf16 forward keeping every layer's output / "
        "keeping the capture layers' only; rel err: features against the first row's; "
        "fwd GB: the forward's peak above the weights; 1st s: the first call, with "
        "autotuning and compiles\n"
    )
    (args.out / "target_speed.txt").write_text(header + text + "\n")
    print(header + text, flush=True)
    if guards is not None:
        guards.uninstall()
    return 0


if __name__ == "__main__":
    sys.exit(main())
