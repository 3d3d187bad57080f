"""The probes of bench/fidelity.py's diagnostic: every leaf module's and the modeling
code's kernels' first tensor in and out, recorded as clones (inside a capture the clones
are captured too); the call-by-call comparison of two recordings; the Triton
autotuners' choices; and the candidate remedies the plain capture is repeated under."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from bench import kernels


def rel_err(a: Any, b: Any) -> float:
    """‖a - b‖ / ‖b‖ over every tensor leaf, in float32; inf when the shapes differ."""
    xs = [x for x in pytree.tree_leaves(a) if isinstance(x, torch.Tensor)]
    ys = [y for y in pytree.tree_leaves(b) if isinstance(y, torch.Tensor)]
    if len(xs) != len(ys) or any(x.shape != y.shape for x, y in zip(xs, ys, strict=True)):
        return float("inf")
    num = sum(float((x.float() - y.float()).pow(2).sum()) for x, y in zip(xs, ys, strict=True))
    den = sum(float(y.float().pow(2).sum()) for y in ys)
    return (num / den) ** 0.5 if den else (0.0 if num == 0 else float("inf"))


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
