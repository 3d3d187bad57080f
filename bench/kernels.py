"""Which kernels the real target's eager forward runs, and leaving the fast ones out.

transformers' Qwen3-Next binds each of its gated-delta-rule and short-convolution
functions, when its modeling module is imported, to the fast package's kernel where that
package imports (flash-linear-attention's `chunk_gated_delta_rule`, causal-conv1d's
`causal_conv1d_fn`) and otherwise to its own PyTorch reference, which it calls "correct
but much slower" (`use_kernel_func_from_hub_with_fallback`). A user training against
Qwen3-Next installs both, so the bench's eager baselines should run both; each row's
note names what ran, read from the functions transformers bound (`describe`).

`PYDFLASH_BENCH_FALLBACK=causal_conv1d` (or `fla`, or both, comma-separated; `bench.run
--fallback` sets it) makes the target take the PyTorch reference instead, in this
process and in the worker processes that inherit the variable, so that one device run
can measure the graph-vs-eager ratios both ways.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import inspect
import os
import warnings
from typing import Any

FALLBACK_ENV = "PYDFLASH_BENCH_FALLBACK"
# package -> (distribution, what it computes in Qwen3-Next, the modeling module's functions)
PACKAGES = {
    "fla": (
        "flash-linear-attention",
        "gated delta rule",
        ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    ),
    "causal_conv1d": ("causal-conv1d", "short conv", ("causal_conv1d_fn", "causal_conv1d_update")),
}
# The modeling module's function whose binding names each kernel in the rows.
NAMED_BY = {"fla": "torch_chunk_gated_delta_rule", "causal_conv1d": "causal_conv1d_fn"}
# aten's scaled-dot-product-attention backends, as the profiler names them.
SDPA_BACKENDS = (
    ("_scaled_dot_product_cudnn_attention", "SDPA cuDNN"),
    ("_scaled_dot_product_flash_attention", "SDPA flash"),
    ("_scaled_dot_product_efficient_attention", "SDPA memory-efficient"),
    ("_scaled_dot_product_fused_attention_overrideable", "SDPA fused (overridden)"),
    ("_scaled_dot_product_attention_math", "SDPA math"),
)


def parse_fallbacks(text: str | None) -> tuple[str, ...]:
    """ "causal_conv1d,fla" -> ("causal_conv1d", "fla"); "" or None -> (). ValueError
    names the valid choices."""
    names = tuple(n.strip() for n in (text or "").split(",") if n.strip())
    bad = [n for n in names if n not in PACKAGES]
    if bad:
        raise ValueError(
            f"expected fallbacks from {', '.join(PACKAGES)} (comma-separated), got {text!r}"
        )
    return names


def forced_fallbacks() -> tuple[str, ...]:
    return parse_fallbacks(os.environ.get(FALLBACK_ENV))


def _modeling() -> Any:
    from transformers.models.qwen3_next import modeling_qwen3_next

    return modeling_qwen3_next


def apply_fallbacks() -> tuple[str, ...]:
    """Rebinds the functions of the packages named in PYDFLASH_BENCH_FALLBACK to
    transformers' PyTorch references (the modeling code looks them up when it calls
    them, so models built before are affected too). Idempotent; returns the packages
    forced. Without the variable, imports nothing."""
    forced = forced_fallbacks()
    if not forced:
        return ()
    module = _modeling()
    for package in forced:
        for name in PACKAGES[package][2]:
            fn = getattr(module, name, None)
            if fn is None or getattr(fn, "bench_fallback", False):
                continue
            reference = _reference(fn)
            if reference is None:
                raise RuntimeError(
                    f"expected transformers' {name} to wrap a PyTorch reference "
                    f"(__wrapped__), got {fn!r}: {FALLBACK_ENV} cannot force it here"
                )
            setattr(module, name, _calls_reference(reference))
    return forced


def _calls_reference(reference: Any) -> Any:
    takes = inspect.signature(reference).parameters
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes.values())

    @functools.wraps(reference)
    def forced(*args: Any, **kwargs: Any) -> Any:
        if not open_kwargs:
            kwargs = {k: v for k, v in kwargs.items() if k in takes}
        return reference(*args, **kwargs)

    forced.bench_fallback = True
    return forced


def _reference(fn: Any) -> Any:
    """The PyTorch function at the bottom of transformers' (and examples/dflash/hf.py's)
    wrappers."""
    seen = set()
    while hasattr(fn, "__wrapped__") and id(fn) not in seen:
        seen.add(id(fn))
        fn = fn.__wrapped__
    return fn if seen else None


def bound_implementation(fn: Any) -> Any:
    """What a function of the modeling module calls: the `implementation` transformers'
    wrapper closed over, seen through our own wrappers; None when it cannot tell."""
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        if getattr(fn, "bench_fallback", False):
            return _reference(fn)
        try:
            nonlocals = inspect.getclosurevars(fn).nonlocals
        except (TypeError, ValueError):
            nonlocals = {}
        if "implementation" in nonlocals:
            return nonlocals["implementation"]
        # A release that names it otherwise: a callable from one of the fast packages.
        for value in nonlocals.values():
            if callable(value) and _package_of(value) in PACKAGES:
                return value
        fn = getattr(fn, "__wrapped__", None)
    return None


def _package_of(fn: Any) -> str:
    return (getattr(fn, "__module__", "") or "").split(".")[0]


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def kernel_name(package: str, implementation: Any) -> str:
    """'FLA 0.6.0', 'causal-conv1d 1.7.0', or 'torch fallback (...)' with the reason."""
    distribution = PACKAGES[package][0]
    module = getattr(implementation, "__module__", "") or ""
    if _package_of(implementation) == package:
        short = "FLA" if package == "fla" else distribution
        return f"{short} {_version(distribution)}"
    if implementation is None:
        if importlib.util.find_spec(package) is None:  # nothing else it could have bound
            return f"torch fallback ({distribution} not installed)"
        return "unknown (transformers' binding not recognised)"
    if module.startswith("transformers") or getattr(implementation, "bench_fallback", False):
        if package in forced_fallbacks():
            why = f"forced by {FALLBACK_ENV}"
        elif importlib.util.find_spec(package) is None:
            why = f"{distribution} not installed"
        else:
            why = f"{distribution} installed but not imported by transformers"
        return f"torch fallback ({why})"
    return f"{module}.{getattr(implementation, '__qualname__', '?')}"


def describe(model: Any = None, forward: Any = None, batch: Any = None) -> dict[str, str]:
    """{"gated delta rule": ..., "short conv": ..., "attention": ...}: the kernels the
    target's eager forward runs. The attention backend is read from one profiled forward
    when `forward` and `batch` are given (aten names the SDPA backend it dispatched to)."""
    module = _modeling()
    kernels = {}
    layer = _gated_delta_layer(model)
    for package, (_, what, _) in PACKAGES.items():
        fn = getattr(module, NAMED_BY[package], None)
        attribute = {"fla": "chunk_gated_delta_rule", "causal_conv1d": "causal_conv1d_fn"}
        # Releases that bind the kernel on the layer instead (None: the fallback).
        if layer is not None and hasattr(layer, attribute[package]):
            bound = getattr(layer, attribute[package])
            kernels[what] = kernel_name(package, bound) if bound is not None else "torch fallback"
        else:
            kernels[what] = kernel_name(package, bound_implementation(fn))
    if forward is not None:
        kernels["attention"] = attention_backend(forward, batch, model)
    return kernels


def _gated_delta_layer(model: Any) -> Any:
    if model is None:
        return None
    for sub in model.modules():
        if type(sub).__name__.endswith("GatedDeltaNet"):
            return sub
    return None


def attention_backend(forward: Any, batch: Any, model: Any = None) -> str:
    import torch
    from torch.profiler import ProfilerActivity

    from bench.limits import profile

    implementation = None
    if model is not None:
        config = getattr(getattr(model, "model", model), "config", None)
        implementation = getattr(config, "_attn_implementation", None)
    try:
        # The profiler's own warnings (CUPTI, Kineto) say nothing about the target.
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            with profile([ProfilerActivity.CPU]) as prof:
                forward(batch)
        names = {event.key for event in prof.key_averages()}
    except Exception as exc:  # noqa: BLE001 - a name for a note, never a failure
        return f"{implementation or 'unknown'} (profiler failed: {type(exc).__name__})"
    for op, label in SDPA_BACKENDS:
        if any(name.startswith(f"aten::{op}") for name in names):
            return label
    return f"{implementation or 'unknown'} attention (no SDPA call seen)"


def note(kernels: dict[str, str]) -> str:
    return "kernels: " + ", ".join(f"{what} {name}" for what, name in kernels.items())
