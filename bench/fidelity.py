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

real_target reports the first rows for dense and MoE; the diagnostic runs alone:

    python -m bench.fidelity [--configs dense,moe] [--size qwen3-next-small] [--seq 700]
        [--no-diagnose] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from bench import kernels

SEQ = 700  # not a bucket: TargetGraphs pads it to 1024
DATA_SEED = 11
CONFIGS = ("dense", "moe")


def rel_err(a: Any, b: Any) -> float:
    """‖a - b‖ / ‖b‖ over every tensor leaf, in float32; inf when the shapes differ."""
    xs = [x for x in pytree.tree_leaves(a) if isinstance(x, torch.Tensor)]
    ys = [y for y in pytree.tree_leaves(b) if isinstance(y, torch.Tensor)]
    if len(xs) != len(ys) or any(x.shape != y.shape for x, y in zip(xs, ys, strict=True)):
        return float("inf")
    num = sum(float((x.float() - y.float()).pow(2).sum()) for x, y in zip(xs, ys, strict=True))
    den = sum(float(y.float().pow(2).sum()) for y in ys)
    return (num / den) ** 0.5 if den else (0.0 if num == 0 else float("inf"))


def features(out: Any) -> Any:
    """The target's outputs that hold hidden states (real_target's forward also passes
    its input ids back)."""
    if isinstance(out, dict) and "features" in out:
        return out["features"]
    return out


def cut(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor | None:
    """`x` narrowed to `like`'s shape where one dimension is longer (the padding), else
    None when the shapes cannot be matched that way."""
    if x.shape == like.shape:
        return x
    if x.dim() != like.dim():
        return None
    longer = [d for d in range(x.dim()) if x.shape[d] != like.shape[d]]
    if len(longer) != 1 or x.shape[longer[0]] < like.shape[longer[0]]:
        return None
    return x.narrow(longer[0], 0, like.shape[longer[0]])


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


# --- probes ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Call:
    name: str  # where: a module's name, or the function's
    kind: str  # what: a module's class, or the function
    input: torch.Tensor | None
    output: torch.Tensor | None


class Probes:
    """Records the first tensor in and out of every leaf module and of the modeling
    code's kernel functions, as clones: inside a capture the clones are captured too,
    so after a replay they hold the replay's values."""

    FUNCTIONS = (
        "torch_chunk_gated_delta_rule",
        "causal_conv1d_fn",
    )

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[Call] = []
        self.on = False
        self._undo: list[Callable[[], None]] = []
        for name, module in model.named_modules():
            if name and not any(True for _ in module.children()):
                handle = module.register_forward_hook(self._hook(name, type(module).__name__))
                self._undo.append(handle.remove)
        modeling = kernels._modeling()
        for fn_name in self.FUNCTIONS:
            self._wrap(modeling, fn_name, fn_name)
        self._wrap(torch.nn.functional, "scaled_dot_product_attention", "sdpa")

    def _hook(self, name: str, kind: str) -> Callable:
        def hook(module: Any, args: Any, output: Any) -> None:
            self._keep(name, kind, args, output)

        return hook

    def _wrap(self, owner: Any, attr: str, kind: str) -> None:
        original = getattr(owner, attr, None)
        if original is None:
            return

        def probed(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            self._keep(kind, kind, args, out)
            return out

        setattr(owner, attr, probed)
        self._undo.append(lambda: setattr(owner, attr, original))

    def _keep(self, name: str, kind: str, args: Any, output: Any) -> None:
        if not self.on:
            return
        first = [x for x in pytree.tree_leaves((args, output)) if isinstance(x, torch.Tensor)]
        ins = [x for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor)]
        outs = [x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor)]
        if not first:
            return
        self.calls.append(
            Call(
                name,
                kind,
                ins[0].detach().clone() if ins else None,
                outs[0].detach().clone() if outs else None,
            )
        )

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[Call]]:
        self.calls = []
        self.on = True
        try:
            yield self.calls
        finally:
            self.on = False

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def compare_calls(reference: list[Call], other: list[Call]) -> dict[str, Any]:
    """Call by call (outputs of `other` cut to `reference`'s shapes where padded): the
    first call that differs, and per kind the calls whose output differs although their
    input is bit-equal (the kernels that change the bits)."""
    result: dict[str, Any] = {"calls": len(reference), "aligned": True, "first": None}
    if [c.name for c in reference] != [c.name for c in other]:
        result["aligned"] = False
        return result
    by_kind: dict[str, dict[str, Any]] = {}
    previous_equal = True
    for index, (a, b) in enumerate(zip(reference, other, strict=True)):
        kind = by_kind.setdefault(a.kind, {"calls": 0, "changed": 0, "max": 0.0})
        kind["calls"] += 1
        same_in = _equal(a.input, b.input)
        err = _err(a.output, b.output)
        if same_in and err != 0.0:
            kind["changed"] += 1
            kind["max"] = max(kind["max"], err)
        if result["first"] is None and (not same_in or err != 0.0):
            result["first"] = {
                "index": index,
                "name": a.name,
                "kind": a.kind,
                "input_equal": same_in,
                "output_error": err,
                # An input that differs after equal outputs: an unprobed op in between.
                "between_probes": not same_in and previous_equal,
            }
        previous_equal = err == 0.0
    result["by_kind"] = by_kind
    return result


def _equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    b = cut(b, a)
    return b is not None and bool(torch.equal(a, b))


def _err(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    b = cut(b, a)
    if b is None:
        return float("inf")
    return rel_err(a, b)


def autotuner_choices() -> dict[str, str]:
    """Every Triton autotuner's cache: "kernel key" -> the config chosen."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return {}
    out = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads obj.__class__, and some objects warn
        # on any attribute read (torch.distributed's deprecated reduce_op).
        if issubclass(type(obj), Autotuner):
            name = getattr(getattr(obj, "fn", None), "__name__", type(obj).__name__)
            for key, config in dict(getattr(obj, "cache", {}) or {}).items():
                out[f"{name} {key}"] = str(config)
    return out


# --- remedies --------------------------------------------------------------------------------
@contextlib.contextmanager
def _matmul_flag(name: str, value: Any) -> Iterator[None]:
    before = getattr(torch.backends.cuda.matmul, name)
    setattr(torch.backends.cuda.matmul, name, value)
    try:
        yield
    finally:
        setattr(torch.backends.cuda.matmul, name, before)


@contextlib.contextmanager
def _blas(name: str) -> Iterator[None]:
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def _sdpa_math() -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


REMEDIES: dict[str, Callable[[], Any]] = {
    "as is": contextlib.nullcontext,
    "cuDNN off": lambda: torch.backends.cudnn.flags(enabled=False),
    "no reduced-precision bf16 reductions": lambda: _matmul_flag(
        "allow_bf16_reduced_precision_reduction", False
    ),
    "cuBLAS, not cuBLASLt": lambda: _blas("cublas"),
    "SDPA math backend": _sdpa_math,
}


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
        graphs = TargetGraphs(forward)
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


# --- rows (real_target) ----------------------------------------------------------------------
def row(section: str, result: dict[str, Any]) -> Any:
    from bench.common import compare

    e = result["errors"]
    note = (
        f"relative error of the features; capture alone (graph vs eager "
        f"on the same padded input) {pct(e['graph_vs_padded'])}, plain torch.cuda.graph "
        f"{pct(e['plain_capture'])}, the lane's thread and stream {pct(e['lane'])}, eager "
        f"run twice {pct(e['eager_repeat'])}; {kernels.note(result['kernels'])}"
    )
    if result["autotune"]["changed"] or result["autotune"]["new"]:
        note += (
            f"; autotuner keys chosen while graphs were captured: "
            f"{len(result['autotune']['new'])} new, {len(result['autotune']['changed'])} changed"
        )
    return compare(
        section,
        f"{result['label']}: graph output vs eager, relative error",
        e["graph"],
        "fraction",
        "noise floor: eager padded vs eager",
        e["padding"],
        note=note,
        errors=e,
        kernels=result["kernels"],
        flags=result["flags"],
        autotune=result["autotune"],
    )


# --- the diagnostic's report -----------------------------------------------------------------
def pct(x: Any) -> str:
    if isinstance(x, str):
        return x
    return "n/a" if x is None else "shapes differ" if x == float("inf") else f"{x * 100:.3f} %"


LINES = (
    ("eager_repeat", "eager vs eager, unpadded, run twice", "determinism"),
    ("padding", "eager padded, cut back  vs  eager", "padding alone: the noise floor"),
    ("graph", "TargetGraphs on a lane  vs  eager", "what a user gets"),
    ("graph_vs_padded", "TargetGraphs on a lane  vs  eager padded", "capture + lane, same input"),
    ("lane", "eager padded on a lane  vs  eager padded", "the lane's thread and stream"),
    ("plain_capture", "torch.cuda.graph  vs  eager padded", "capture alone, no pydflash"),
    ("eager_after_capture", "eager padded after captures  vs  before", "state the captures left"),
)


def format_result(result: dict[str, Any]) -> str:
    e = result["errors"]
    out = [
        f"== {result['label']} ==",
        kernels.note(result["kernels"]),
        "flags: " + ", ".join(f"{k} {v}" for k, v in result["flags"].items()),
        "relative error ‖a - b‖ / ‖b‖ of the features:",
    ]
    for key, what, isolates in LINES:
        out.append(f"  {what:44s} {isolates:32s} {pct(e[key])}")
    a = result["autotune"]
    out.append(
        f"Triton autotuner keys: {a['keys']}; first chosen during TargetGraphs/plain capture: "
        f"{len(a['new'])}; changed: {len(a['changed'])}"
        + (f" ({', '.join((a['new'] + a['changed'])[:4])})" if a["new"] or a["changed"] else "")
    )
    if "diagnosis_failed" in result:
        out.append(f"the call-by-call diagnosis failed: {result['diagnosis_failed']}")
    d = result.get("diagnosis")
    if d:
        out.append("where the bits change, call by call (probed leaf modules and kernels):")
        for title, comparison in (
            ("capture (plain capture vs eager, same padded input)", d["capture"]),
            ("padding (eager padded vs eager unpadded)", d["padding"]),
        ):
            out.append(f"  {title}:")
            out += [f"    {line}" for line in explain_calls(comparison)]
        a = d["autotune_during_capture"]
        out.append(
            f"  autotuner keys first chosen inside the capture: {len(a['new'])}, changed: "
            f"{len(a['changed'])}"
        )
        out.append("plain capture vs eager padded, both under each setting:")
        for name, err in d["remedies"].items():
            out.append(f"  {name:40s} {pct(err)}")
    out.append("reading: " + reading(result))
    return "\n".join(out)


def explain_calls(comparison: dict[str, Any]) -> list[str]:
    if not comparison["aligned"]:
        return ["the two runs made different calls: cannot compare call by call"]
    first = comparison["first"]
    if first is None:
        return [f"all {comparison['calls']} calls bit-identical"]
    where = (
        "its input already differs, after equal outputs: an unprobed op before it"
        if first["between_probes"]
        else "input equal, output differs"
        if first["input_equal"]
        else "input differs"
    )
    lines = [
        f"first difference at call {first['index']} of {comparison['calls']}: "
        f"{first['name']} ({first['kind']}): {where}; output {pct(first['output_error'])}"
    ]
    changed = {k: v for k, v in comparison["by_kind"].items() if v["changed"]}
    same = [f"{k} {v['calls']}" for k, v in comparison["by_kind"].items() if not v["changed"]]
    if changed:
        lines.append(
            "outputs that change with equal inputs: "
            + ", ".join(
                f"{k} {v['changed']} of {v['calls']} (max {pct(v['max'])})"
                for k, v in changed.items()
            )
        )
    lines.append("bit-identical whenever their inputs were: " + (", ".join(same) or "none"))
    return lines


def reading(result: dict[str, Any]) -> str:
    """One sentence on what the figures say, for whoever reads the output alone."""
    e = result["errors"]
    tiny = 1e-6
    parts = []
    if e["eager_repeat"] > tiny:
        parts.append("eager itself is not deterministic here, so every figure has that noise")
    if e["graph"] <= max(e["padding"], tiny) * 1.05:
        parts.append("the graph is within the padding floor: nothing beyond padding to remove")
    else:
        if e["lane"] > tiny:
            parts.append("running on a lane changes the bits (thread or stream)")
        if e["plain_capture"] > tiny and abs(e["plain_capture"] - e["graph_vs_padded"]) <= max(
            0.25 * e["graph_vs_padded"], tiny
        ):
            parts.append(
                "a plain torch.cuda.graph capture differs as much as TargetGraphs: the capture "
                "itself changes kernels, not pydflash's padding or lanes"
            )
        elif e["graph_vs_padded"] > e["plain_capture"] + tiny:
            parts.append(
                "TargetGraphs differs more than a plain capture: look at what it does beyond "
                "capturing (lane, warm-up calls, pool)"
            )
        if e["eager_after_capture"] > tiny:
            parts.append("capturing changed what eager runs afterwards (a choice made again)")
    d = result.get("diagnosis")
    if d:
        fixed = [
            name
            for name, err in d["remedies"].items()
            if name != "as is" and isinstance(err, float) and err <= tiny < e["plain_capture"]
        ]
        if fixed:
            parts.append(f"capture matches eager bit for bit with: {', '.join(fixed)}")
        changed = [
            k for k, v in d["capture"].get("by_kind", {}).items() if v["changed"]
        ]  # the kernels whose bits capture changes
        if changed:
            parts.append(f"under capture these change their output: {', '.join(changed)}")
    return "; ".join(parts) + "." if parts else "no difference anywhere."


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
