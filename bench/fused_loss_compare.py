"""The fused LM head + cross entropy at DFlash's shapes: the example's chunked kernel
(examples/dflash/fused_loss.py) against liger-kernel's LigerFusedLinearCrossEntropyLoss.

For each shape (rows = predicted block positions per microbatch, 4,096 and 8,192;
hidden 4,096 and 5,120; Qwen's 151,936-token vocabulary; bf16 hidden states and head)
it times forward + backward (the head frozen, as the drafter's is: only the hidden
states get a gradient), reads the allocator's peak above the inputs, and compares the
loss and the gradient with an fp64 reference computed in row chunks. The rows carry
DFlash's per-position weights (Note [DFlash objective]: about a third of the rows
weigh 0, the rest decay along the block), so liger runs with reduction="none" and the
weights applied to its per-row losses: its weighted path, whose backward recomputes
the logits. liger's unweighted reduction="mean" (its fast path, gradient computed in
the forward) is timed too, as a bound on what it could do if it took weights.

    python -m bench.fused_loss_compare [--quick] [--json FILE]

Needs a GPU for the measurement; without liger-kernel (`pip install liger-kernel`,
0.8.5 is pure Python: it needs torch and triton only) it measures the chunked kernel
alone and says so. On a CPU it runs a small smoke of the same code and says the numbers
mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from examples.dflash.fused_loss import liger_linear_cross_entropy, linear_cross_entropy
from examples.dflash.objective import position_weights

VOCAB = 151_936
SHAPES = [(4096, 4096), (8192, 4096), (4096, 5120), (8192, 5120)]  # (rows, hidden)
QUICK_SHAPES = [(4096, 4096)]
CPU_SHAPES = [(256, 64)]  # a smoke of the code path; vocab 1,000 on the CPU
BLOCK, GAMMA = 16, 7.0


def liger_version() -> str | None:
    try:
        return importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return None


def inputs(rows: int, hidden: int, vocab: int, device: str, seed: int = 0) -> dict[str, Any]:
    """Hidden states, the frozen head, labels and DFlash-like row weights."""
    g = torch.Generator(device=device).manual_seed(seed)  # drawn where they live: fast
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    # A normed hidden state and a head that give logits of standard deviation 2.
    h = randn(rows, hidden, scale=1.0)
    w = randn(vocab, hidden, scale=2 * hidden**-0.5)
    labels = torch.randint(0, vocab, (rows,), generator=g, device=device)
    slots = position_weights(BLOCK, GAMMA, device).repeat(math.ceil(rows / (BLOCK - 1)))[:rows]
    supervised = torch.rand(rows, generator=g, device=device) > 1 / 3
    weights = slots * supervised
    return {"hidden": h, "weight": w, "labels": labels, "weights": weights / weights.sum()}


def reference(x: dict[str, Any], chunk: int = 1024) -> tuple[float, torch.Tensor]:
    """The weighted loss and its gradient with respect to the hidden states, in fp64."""
    w = x["weight"].double()
    total, grads = 0.0, []
    for lo in range(0, x["hidden"].shape[0], chunk):
        h = x["hidden"][lo : lo + chunk].double().requires_grad_(True)
        y, r = x["labels"][lo : lo + chunk], x["weights"][lo : lo + chunk].double()
        loss = (torch.nn.functional.cross_entropy(h @ w.t(), y, reduction="none") * r).sum()
        (grad,) = torch.autograd.grad(loss, h)
        total += loss.item()
        grads.append(grad)
    return total, torch.cat(grads)


def liger_mean(x: dict[str, Any]) -> torch.Tensor:
    """liger's unweighted fast path (not DFlash's objective: a bound, not a candidate)."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(reduction="mean")(x["weight"], x["hidden"], x["labels"])


KERNELS: dict[str, Callable[[dict[str, Any]], torch.Tensor]] = {
    "chunked (example), chunk 1024": lambda x: linear_cross_entropy(
        x["hidden"], x["weight"], x["labels"], x["weights"], chunk=1024
    ),
    "chunked (example), chunk 4096": lambda x: linear_cross_entropy(
        x["hidden"], x["weight"], x["labels"], x["weights"], chunk=4096
    ),
    "liger, weighted (reduction none)": lambda x: liger_linear_cross_entropy(
        x["hidden"], x["weight"], x["labels"], x["weights"]
    ),
    "liger, unweighted mean (bound)": liger_mean,
}


def measure(
    name: str, fn: Callable, x: dict[str, Any], want: tuple[float, torch.Tensor], reps: int
) -> dict[str, Any]:
    """Median forward + backward time, allocator peak above the inputs, and errors."""
    on_gpu = x["hidden"].is_cuda
    hidden = x["hidden"].detach().requires_grad_(True)
    run = {**x, "hidden": hidden}

    def step() -> torch.Tensor:
        hidden.grad = None
        loss = fn(run)
        loss.backward()
        return loss

    loss = step()  # warm-up: compiles, autotunes
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            loss = step()
    peak = torch.cuda.max_memory_allocated() - base if on_gpu else None
    ref_loss, ref_grad = want
    row: dict[str, Any] = {
        "kernel": name,
        "ms": statistics.median(times) if times else None,
        "peak_extra_bytes": peak,
        "loss_rel_err": abs(loss.item() - ref_loss) / abs(ref_loss),
    }
    if "mean" not in name:  # the unweighted loss has another gradient
        grad = hidden.grad.double()
        row["grad_rel_err"] = ((grad - ref_grad).norm() / ref_grad.norm()).item()
    else:
        row["loss_rel_err"] = None
    return row


def run(quick: bool = False, reps: int = 10) -> dict[str, Any]:
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    version = liger_version()
    notes = []
    if not on_gpu:
        notes.append("no GPU: a CPU smoke of the code path at toy shapes; the numbers mean nothing")
    if version is None:
        notes.append(
            "liger-kernel is not installed: only the chunked kernel is measured "
            "(pip install liger-kernel==0.8.5)"
        )
    elif not on_gpu:
        notes.append("liger-kernel's kernels are Triton on CUDA: not run on the CPU")
    shapes = QUICK_SHAPES if quick else SHAPES
    vocab = VOCAB if on_gpu else 1000
    if not on_gpu:
        shapes, reps = CPU_SHAPES, 1
    results = []
    for rows, hidden in shapes:
        x = inputs(rows, hidden, vocab, device)
        want = reference(x)
        for name, fn in KERNELS.items():
            if name.startswith("liger") and (version is None or not on_gpu):
                continue
            try:
                row = measure(name, fn, x, want, reps)
            except Exception as exc:  # noqa: BLE001 - a kernel that fails is a row saying why
                row = {"kernel": name, "error": f"{type(exc).__name__}: {exc}"}
            row.update(rows=rows, hidden=hidden, vocab=vocab)
            results.append(row)
            del row
        del x, want
        if on_gpu:
            torch.cuda.empty_cache()
    return {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "torch": torch.__version__,
        "liger_kernel": version,
        "dtype": "bfloat16" if on_gpu else "float32",
        "notes": notes,
        "rows": results,
    }


def table(report: dict[str, Any]) -> str:
    lines = [
        f"fused head + cross entropy, {report['device']}, torch {report['torch']}, "
        f"liger-kernel {report['liger_kernel']}, {report['dtype']}",
        *[f"note: {n}" for n in report["notes"]],
        f"{'rows x hidden':>14}  {'kernel':<34} {'ms':>8} {'peak extra':>12} "
        f"{'loss err':>9} {'grad err':>9}",
    ]

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in report["rows"]:
        if "error" in r:
            lines.append(f"{r['rows']:>6} x {r['hidden']:<5}  {r['kernel']:<34} {r['error']}")
            continue
        peak = None if r["peak_extra_bytes"] is None else r["peak_extra_bytes"] / 2**30
        lines.append(
            f"{r['rows']:>6} x {r['hidden']:<5}  {r['kernel']:<34} {fmt(r['ms'], '8.2f')} "
            f"{fmt(peak, '9.2f') + ' GiB' if peak is not None else '-':>12} "
            f"{fmt(r['loss_rel_err'], '9.1e')} {fmt(r.get('grad_rel_err'), '9.1e')}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one shape (4,096 x 4,096)")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per kernel")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    report = run(quick=args.quick, reps=args.reps)
    print(table(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
