"""What makes the frozen target cheaper: the 23 B Qwen3-Next-style hybrid
(`qwen3-next-large` in examples/dflash/hf.py, random weights, built on the GPU) at
2 x 4,787 tokens, the long workload's mean microbatch, one forward per variant:

- bf16 with every layer's output kept (`output_hidden_states=True`, the old forward);
- bf16 keeping only the capture layers' outputs (Note [Capture layers only]);
- FP8 linear layers: ours (examples/dflash/fp8.py: a fused row-wise quantization
  kernel and torch._scaled_mm), and torchao's float8 inference when it imports;
- fused elementwise work (examples/dflash/fused.py): FLA's norms, swiglu and causal
  conv together, in bf16 and with FP8; each alone with --singles, and each decoder
  layer torch.compile'd with --compile (Inductor takes minutes);
- the noise floor: bf16 with each embedding value moved one bf16 ulp up or down.

Per variant: GPU time of a forward by CUDA events (median of --reps after warm-up; the
first call's time, which includes Triton's autotuning or Inductor's compile, is
reported apart), the speed against both bf16 rows of this run, the relative error of
each capture layer's output against bf16 on the same input, and peak memory.

Fidelity (Note [Random weights amplify]): besides those per-layer errors, the error of
each FP8 GEMM on the real activations of the first decoder layers, and the DFlash
drafter's losses over the same steps, from the same initial drafter and data, trained
on the bf16 target's features, on the FP8 target's and on the noise floor's.

    python -m bench.target_speed [--out DIR] [--only fp8,fp8+fla] [--singles] [--compile]

Writes target_speed.json (after every row: a run cut short keeps its rows) and
target_speed.txt to --out (default: $OUT, else out/target_speed) and prints the table
last. Needs a GPU with FP8 (compute capability 9.0+), about 100 GB of GPU memory and
transformers; FLA for the fused rows. It stops starting new variants after --budget
seconds (default 120) and says which it skipped; the default run takes about 3 minutes.
The variants and their device are in target_speed_variants.py, the fidelity measures in
target_speed_fidelity.py; this module times the forwards and writes the table.
"""

from __future__ import annotations

import argparse
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

from bench import target_speed_variants as variants
from bench.target_speed_fidelity import fidelity, gemm_errors, layer_errors, relative_error
from bench.target_speed_variants import (
    BASELINE,
    CAPTURE_ONLY,
    VARIANTS,
    Variant,
    allocated,
    build,
    features_fn,
    free,
    importable,
    on_gpu,
    peak,
    synchronize,
)

CONFIG = "qwen3-next-large"
SEQ, BATCH = 4787, 2  # the long workload's mean microbatch (issue 33)
DRAFTER_LAYERS = 5

# Note [Random weights amplify]: the 23 B target here has random weights, and the last
# capture layer is 61 layers deep. Any perturbation of its input, FP8's rounding or a
# different but equivalent bf16 kernel alike, grows layer after layer: the concatenated
# features' error says more about the random model than about FP8. So fidelity is shown
# three ways: the error of each capture layer apart, against the same errors of the noise
# floor (bf16 with one-ulp-perturbed embeddings, and bf16+fla: equivalent kernels, no
# FP8), where amplification alone shows; the FP8 GEMMs' own error on real activations of
# the first layers; and the drafter's losses trained on each target's features. A trained
# checkpoint would be the real test; none is available offline.


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/target_speed")))
    p.add_argument("--config", default=CONFIG, help="a name in examples/dflash/hf.py's CONFIGS")
    p.add_argument("--seq", type=int, default=SEQ)
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--reps", type=int, default=3, help="timed forwards per variant")
    p.add_argument("--warmup", type=int, default=1, help="untimed forwards after the first")
    p.add_argument("--only", help="comma-separated variant names (default: the default run's)")
    p.add_argument("--singles", action="store_true", help="each FLA fusion alone too")
    p.add_argument("--compile", action="store_true", help="the torch.compile rows too (minutes)")
    p.add_argument(
        "--budget", type=float, default=120.0, help="seconds after which no variant starts"
    )
    p.add_argument("--fidelity-steps", type=int, default=6, help="0: no drafter-loss fidelity")
    p.add_argument("--fidelity-lr", type=float, default=3e-4, help="the fidelity drafter's lr")
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
    row["layer_rel_errors"] = layer_errors(features, reference["features"], len(target.layers))
    row["features_shape"] = list(features.shape)
    del features
    if variant.name == CAPTURE_ONLY and not variant.fp8:  # the FP8 GEMMs' own error
        row["gemm_errors"] = gemm_errors(target, ids)
    del target, forward
    free()
    return row


def _errors(values: list[float]) -> str:
    return "/".join(f"{x:.3g}" for x in values)


def table(rows: list[dict], fidelity_row: dict | None, layers: list[int]) -> str:
    by_name = {r["variant"]: r for r in rows if "gpu_ms_median" in r}
    base = by_name.get(BASELINE, {}).get("gpu_ms_median")
    capture = by_name.get(CAPTURE_ONLY, {}).get("gpu_ms_median")
    by_layer = f"rel err at layers {'/'.join(map(str, layers))}"
    head = (
        f"{'variant':<24} {'GPU ms':>8} {'x all-hid':>9} {'x bf16':>7} {'peak GB':>8} "
        f"{'fwd GB':>7} {'1st s':>7}  {by_layer}"
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
            f"{r['peak_bytes'] / 1e9:8.1f} {r['forward_peak_bytes'] / 1e9:7.1f} "
            f"{r['first_call_s']:7.1f}  {_errors(r['layer_rel_errors'])}"
        )
    gemms = by_name.get(CAPTURE_ONLY, {}).get("gemm_errors")
    if gemms:
        fp8 = sorted(g["fp8_rel_error"] for g in gemms)
        bf16 = sorted(g["bf16_rel_error"] for g in gemms)
        seen = 1 + max(int(g["layer"].split(".")[0]) for g in gemms)
        lines.append(
            f"FP8 GEMMs alone, {len(gemms)} linear layers of decoder layers 0-{seen - 1} "
            f"on their real activations, error against fp32: median {statistics.median(fp8):.4f}"
            f" (max {fp8[-1]:.4f}); bf16's own: median {statistics.median(bf16):.4f}"
        )
    if fidelity_row is not None:
        if "error" in fidelity_row:
            lines.append(f"fidelity: failed: {fidelity_row['error']}")
        else:
            lines.append(
                f"drafter loss after {fidelity_row['steps']} steps (same init and data, lr "
                f"{fidelity_row['lr']:g}):"
            )
            diffs = fidelity_row["last_loss_relative_difference"]
            means = fidelity_row["mean_loss_relative_difference"]
            for name, why in fidelity_row.get("failed", {}).items():
                lines.append(f"  on {name + ' features':<26} failed: {why}")
            for name, curve in fidelity_row["losses"].items():
                errs = fidelity_row["layer_rel_errors_by_step"][name][-1]
                lines.append(
                    f"  on {name + ' features':<26} first {curve[0]:.4f}, last {curve[-1]:.4f}"
                    f"; vs bf16: last {diffs[name]:+.2e}, mean over steps {means[name]:+.2e}"
                    f"; features' {by_layer}: {_errors(errs)}"
                )
    lines.append(
        "Random weights amplify any perturbation layer after layer (the 1-ulp and bf16+fla "
        "rows show how much alone); a trained checkpoint would be the real test, none is "
        "available offline."
    )
    return "\n".join(lines)


def chosen(args: argparse.Namespace) -> list[Variant]:
    """The variants to run: --only's, else the default run's and the flags' groups; the
    reference row first in any case."""
    if args.only:
        wanted = [v for v in VARIANTS if v.name in args.only]
    else:
        groups = {
            "",
            *(["singles"] if args.singles else []),
            *(["compile"] if args.compile else []),
        }
        wanted = [v for v in VARIANTS if v.group in groups]
    if VARIANTS[0] not in wanted:  # the reference features and speed
        wanted.insert(0, VARIANTS[0])
    return wanted


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    variants.use_device(args.device)
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
    ids = torch.randint(0, config.vocab, (args.batch, args.seq), generator=generator).to(
        variants.DEVICE
    )
    summary: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(variants.DEVICE) if on_gpu() else platform.processor(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config": args.config,
        "capture_layers": list(config.capture_layers),
        "tokens": [args.batch, args.seq],
        "reps": args.reps,
        "complete": False,
        "rows": [],
        "fidelity": None,
        "note": "Note [Random weights amplify] in bench/target_speed.py",
    }
    for name in ("triton", "fla", "torchao", "transformers"):
        try:
            module = __import__(name)
            summary[name] = getattr(module, "__version__", "?")
        except ImportError:
            summary[name] = None
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = summary["rows"]
    reference: dict[str, Any] = {}
    for variant in chosen(args):
        elapsed = time.perf_counter() - started
        if not importable(variant.needs):
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
        write(args.out, summary, started)
    reference.clear()
    free()
    if args.fidelity_steps > 0:
        try:
            summary["fidelity"] = fidelity(config, args)
        except Exception as exc:  # noqa: BLE001 - the failure is what the row reports
            summary["fidelity"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            summary["fidelity"]["traceback"] = traceback.format_exc()[-4000:]
            free()
    summary["complete"] = True
    write(args.out, summary, started)
    text = table(rows, summary["fidelity"], summary["capture_layers"])
    header = (
        f"{summary['device']}, torch {summary['torch']}, {args.config} at "
        f"{args.batch} x {args.seq} tokens, capture layers {summary['capture_layers']}, "
        f"median of {args.reps}; {summary['total_s']:.0f} s in all\n"
        "x all-hid / x bf16: speed against the bf16 forward keeping every layer's output / "
        "keeping the capture layers' only; rel err: each capture layer's output against the "
        "first row's; fwd GB: the forward's peak above the weights; 1st s: the first call, "
        "with autotuning and compiles\n"
    )
    (args.out / "target_speed.txt").write_text(header + text + "\n")
    print(header + text, flush=True)
    if guards is not None:
        guards.uninstall()
    return 0


def write(out: Path, summary: dict, started: float) -> None:
    """target_speed.json as it stands: after every row, so that a run cut short keeps its
    rows (written whole to a temporary name, then renamed)."""
    summary["total_s"] = time.perf_counter() - started
    path = out / "target_speed.json"
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(summary, indent=1))
    partial.replace(path)


if __name__ == "__main__":
    sys.exit(main())
