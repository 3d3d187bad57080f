"""How far graph replays of the real target are from its eager forward, and why.

A TargetGraphs replay pads a batch to its bucket, runs a captured graph on a lane's
thread and stream, and cuts the outputs back. Each of those steps can change the bits
of a bf16 forward; this separates them, on one microbatch of a length that is not a
bucket (700 tokens, padded to 1024), every figure a relative error
‖a - b‖ / ‖b‖ of the features:

- eager vs eager, unpadded, twice: run-to-run determinism (0 when the kernels are);
- eager on the padded input, cut back, vs eager: padding alone, the noise floor a
  graph cannot go below (its inputs are padded);
- TargetGraphs on a lane vs eager: what a user gets (the graph row of real_target);
- TargetGraphs vs eager on the padded input: the capture and the lane, padding held equal;
- eager on a lane vs eager, both padded: the lane's thread and stream alone;
- a plain torch.cuda.graph capture on the main thread vs eager, both padded: capture
  alone, without pydflash;
- eager padded after the captures vs before: whether capturing changed what eager runs
  (an autotuner or a library choosing again).

With `diagnose`, the plain capture is repeated with every leaf module and the modeling
code's kernels (gated delta rule, short conv, SDPA) recorded, so the calls whose output
changes while their input is bit-equal are named, with the Triton autotuners' choices
before and after the capture, and then repeated under candidate remedies (cuDNN off, no
reduced-precision bf16 reductions, cuBLAS instead of cuBLASLt, the math SDPA backend)
to see which, if any, brings capture to the eager bits.

real_target reports the first rows for dense and MoE (bench/fidelity_report.py); the
probes are in bench/fidelity_probes.py. The diagnostic runs alone:

    python -m bench.fidelity [--configs dense,moe] [--size qwen3-next-small] [--seq 700]
        [--no-diagnose] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from bench import kernels
from bench.fidelity_probes import (
    REMEDIES,
    Call,
    Probes,
    autotuner_choices,
    compare_calls,
    rel_err,
)
from bench.fidelity_report import format_result

SEQ = 700  # not a bucket: TargetGraphs pads it to 1024
DATA_SEED = 11
CONFIGS = ("dense", "moe")


def features(out: Any) -> Any:
    """The target's outputs that hold hidden states (real_target's forward also passes
    its input ids back)."""
    if isinstance(out, dict) and "features" in out:
        return out["features"]
    return out


def cut_output(out: Any, t: int) -> Any:
    """A padded forward's outputs cut back to the first t positions (dim 1)."""
    return pytree.tree_map(
        lambda x: x[:, :t] if isinstance(x, torch.Tensor) and x.dim() >= 2 else x, out
    )


def bucket_of(t: int) -> int:
    """The TargetGraphs length bucket of t tokens (its default buckets: powers of two)."""
    return max(128, 1 << (t - 1).bit_length())


def padded(batch: dict, length: int) -> dict:
    return {
        k: torch.nn.functional.pad(v, (0, length - v.shape[1]), value=0) for k, v in batch.items()
    }


def flags() -> dict[str, Any]:
    """Precision settings that change which kernels run."""
    matmul = torch.backends.cuda.matmul
    return {
        "tf32_matmul": matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "bf16_reduced_precision_reduction": matmul.allow_bf16_reduced_precision_reduction,
        "blas": str(torch.backends.cuda.preferred_blas_library()),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }


# --- capture ---------------------------------------------------------------------------------
def plain_capture(forward: Callable, batch: dict, record: Callable[[bool], Any] | None = None):
    """(graph, outputs): torch's own recipe (warm-up on a side stream, then
    torch.cuda.graph), replayed once. `record(on)` brackets the capture only."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(2):
            forward(batch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        if record is not None:
            record(True)
        try:
            # As TargetGraphs captures: other threads' CUDA calls are not refused meanwhile.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = forward(batch)
        finally:
            if record is not None:
                record(False)
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def eager(forward: Callable, batch: dict) -> Any:
    with torch.no_grad():
        out = forward(batch)
    torch.cuda.synchronize()
    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, out)


# --- one config ------------------------------------------------------------------------------
@dataclasses.dataclass
class Target:
    """A built real target, its forward, and the microbatch the figures are on."""

    label: str
    model: torch.nn.Module
    forward: Callable
    batch: dict  # 1 x SEQ, on the GPU
    kernels: dict[str, str]


def build(size: str, moe: bool, seq: int = SEQ, device: str = "cuda:0") -> Target:
    from examples.dflash.data import MarkovTokens
    from examples.dflash.hf import HFTargetConfig
    from examples.dflash.loops import target_forward

    kernels.apply_fallbacks()
    torch.manual_seed(0)
    config = HFTargetConfig.load(size, moe=moe)
    model = config.build(torch.bfloat16).to(device)
    forward = target_forward(model)
    (batch,) = MarkovTokens(config.vocab, seq, 1, seed=DATA_SEED).batches(0, 1)
    batch = {k: v.to(device) for k, v in batch.items()}
    eager(forward, batch)  # compiles and autotunes before anything is compared
    label = f"{size}{', MoE' if moe else ''}, 1x{seq} padded to {bucket_of(seq)}"
    return Target(label, model, forward, batch, kernels.describe(model.model, forward, batch))


def measure(target: Target, lanes: list | None = None, diagnose: bool = False) -> dict[str, Any]:
    """The comparisons of the module's docstring for one target; `lanes` (two or more
    GPU lanes of the target's device) run TargetGraphs, else a Dispatcher is made."""
    from pydflash import Dispatcher, TargetGraphs
    from pydflash.pipeline.stages import EagerTarget

    forward, batch = target.forward, target.batch
    t = batch["input_ids"].shape[1]
    big = padded(batch, bucket_of(t))
    device = batch["input_ids"].device
    own = None
    if lanes is None:
        own = Dispatcher([device])
        lanes = own.lanes
    errors: dict[str, float] = {}
    try:
        reference = features(eager(forward, batch))
        errors["eager_repeat"] = rel_err(features(eager(forward, batch)), reference)
        eager_padded = features(cut_output(eager(forward, big), t))
        errors["padding"] = rel_err(eager_padded, reference)
        stage = EagerTarget(forward)
        on_lane = stage.submit(lanes[0], big).result()
        torch.cuda.synchronize()
        errors["lane"] = rel_err(features(cut_output(on_lane, t)), eager_padded)
        choices_before = autotuner_choices()
        graphs = TargetGraphs(forward, policy="graphs")  # its graph's error, however fast
        replayed = graphs.submit(lanes[0], batch).result()
        torch.cuda.synchronize()
        graph_out = features(replayed)
        errors["graph"] = rel_err(graph_out, reference)
        errors["graph_vs_padded"] = rel_err(graph_out, eager_padded)
        graphs.release(replayed)
        _, plain = plain_capture(forward, big)
        errors["plain_capture"] = rel_err(features(cut_output(plain, t)), eager_padded)
        errors["eager_after_capture"] = rel_err(
            features(cut_output(eager(forward, big), t)), eager_padded
        )
        choices_after = autotuner_choices()
        result: dict[str, Any] = {
            "label": target.label,
            "kernels": target.kernels,
            "flags": flags(),
            "errors": errors,
            "graph_stats": graphs.stats(),
            "autotune": autotune_diff(choices_before, choices_after),
        }
        del graphs, plain, replayed
        if diagnose:
            try:
                result["diagnosis"] = diagnosis(target, big, t)
            except Exception as exc:  # noqa: BLE001 - the end-to-end figures still stand
                traceback.print_exc()
                frames = traceback.extract_tb(exc.__traceback__)[-3:]
                where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in frames)
                result["diagnosis_failed"] = f"{type(exc).__name__}: {_first_line(exc)} at {where}"
    finally:
        if own is not None:
            own.shutdown()
    return result


def autotune_diff(before: dict[str, str], after: dict[str, str]) -> dict[str, Any]:
    changed = sorted(k for k in before if k in after and after[k] != before[k])
    new = sorted(k for k in after if k not in before)
    return {"keys": len(after), "changed": changed, "new": new}


def diagnosis(target: Target, big: dict, t: int) -> dict[str, Any]:
    """Probed calls: capture vs eager (same padded input), padding vs none (eager); and
    the plain capture's error under each remedy."""
    forward = target.forward
    probes = Probes(target.model)
    try:
        with probes.recording() as eager_calls:
            eager(forward, big)
        eager_calls = list(eager_calls)
        before = autotuner_choices()
        recorded: list[Call] = []

        def record(on: bool) -> None:
            nonlocal recorded
            if on:
                probes.calls = recorded
            probes.on = on

        graph, _ = plain_capture(forward, big, record)
        during = autotuner_choices()
        capture = compare_calls(eager_calls, recorded)
        del graph, recorded
        with probes.recording() as unpadded_calls:
            eager(forward, target.batch)
        padding = compare_calls(list(unpadded_calls), eager_calls)
        del eager_calls, unpadded_calls
    finally:
        probes.remove()
    torch.cuda.empty_cache()
    remedies = {}
    for name, setting in REMEDIES.items():
        try:
            with setting():
                reference = features(cut_output(eager(forward, big), t))
                graph, out = plain_capture(forward, big)
                remedies[name] = rel_err(features(cut_output(out, t)), reference)
                del graph, out
        except Exception as exc:  # noqa: BLE001 - a remedy that cannot run is reported
            remedies[name] = f"{type(exc).__name__}: {_first_line(exc)}"
    return {
        "capture": capture,
        "padding": padding,
        "autotune_during_capture": autotune_diff(before, during),
        "remedies": remedies,
    }


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:160] if lines else ""


# --- command line ----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.fidelity", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--configs", default="dense,moe", help="dense, moe or both (default both)")
    p.add_argument("--size", default="qwen3-next-small", help="a config of examples/dflash/hf.py")
    p.add_argument("--seq", type=int, default=SEQ, help=f"tokens (default {SEQ}, bucket 1024)")
    p.add_argument("--no-diagnose", action="store_true", help="only the end-to-end figures")
    p.add_argument(
        "--fallback",
        help="fast kernels to leave out, e.g. causal_conv1d (as PYDFLASH_BENCH_FALLBACK)",
    )
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not configs or any(c not in CONFIGS for c in configs):
        p.error(f"expected --configs from {', '.join(CONFIGS)}, got {args.configs!r}")
    if args.fallback is not None:
        try:
            os.environ[kernels.FALLBACK_ENV] = ",".join(kernels.parse_fallbacks(args.fallback))
        except ValueError as exc:
            p.error(str(exc))
    if not torch.cuda.is_available():
        print("bench.fidelity needs a GPU: it compares CUDA graph replays", file=sys.stderr)
        return 2
    results = []
    print(
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; every figure is "
        f"‖a - b‖ / ‖b‖ over the {args.seq} real tokens' features (0 = bit-identical)",
        flush=True,
    )
    failed = False
    for config in configs:
        try:
            target = build(args.size, config == "moe", args.seq)
            result = measure(target, diagnose=not args.no_diagnose)
        except Exception:  # noqa: BLE001 - report it and go on to the next config
            traceback.print_exc()
            print(f"== {config}: failed, see the traceback above ==", flush=True)
            failed = True
            continue
        results.append(result)
        print(format_result(result), flush=True)
        del target
        gc.collect()
        torch.cuda.empty_cache()
    if args.json:
        from bench.report import write_json

        write_json({"fidelity": results}, args.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
