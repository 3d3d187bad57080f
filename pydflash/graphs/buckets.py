"""Buckets: the padded (batch, length) shapes a target's graphs are captured for, and the
padding of a batch to its bucket and the cutting of outputs back.

Note [Bucket padding]: every tensor in the batch is [B, T, ...] (or [B]); it is padded on
the right to [Bb, Tb, ...], the bucket, with `pad_value`. In a causal model no real
position attends to a later one, so the real positions' outputs do not depend on the
padding (kernels may tile a longer sequence differently: equal within the dtype's
rounding, not bit for bit). Outputs shaped [Bb, Tb, ...] are cut to [B, T, ...], those
shaped [Bb, ...] to [B, ...]; others are returned whole. Everything that is not a tensor
is part of the bucket's key: a graph replays what was captured, constants included.

Note [Bucket ladder]: padding is compute thrown away. Powers of two waste a quarter of it
on lengths spread evenly, which a launch-bound forward hides and a GPU-bound one pays in
full. The default ladder splits each doubling of length into `granularity` equal steps
(128, 160, 192, 224, 256, 320, ... with 4): a length pads by less than one step, so at
most 1 / (granularity + 1) of a bucket is padding, and about 1 / (2 granularity + 1) on
average for lengths spread evenly (8 % at 4). More buckets cost more captures, but only
buckets that batches reach are captured, and a lane's graphs share one memory pool.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .._checks import counted

DEFAULT_GRANULARITY = 4
DEFAULT_MIN_LENGTH = 128
DEFAULT_MAX_LENGTH = 8192

# How an output leaf is cut back (Note [Bucket padding]).
WHOLE, CUT_BATCH, CUT_BOTH = 0, 1, 2


@dataclass(frozen=True)
class Bucket:
    """A padded batch shape: `batch` sequences of `length` tokens."""

    batch: int
    length: int


def ladder(
    granularity: int = DEFAULT_GRANULARITY,
    min_length: int = DEFAULT_MIN_LENGTH,
    max_length: int = DEFAULT_MAX_LENGTH,
) -> tuple[int, ...]:
    """Bucket lengths from `min_length` to `max_length`: each doubling split into
    `granularity` equal steps (Note [Bucket ladder]); 1 gives powers of two."""
    lengths = [min_length]
    while lengths[-1] < max_length:
        octave = 1 << (lengths[-1].bit_length() - 1)  # the power of two at or below
        step = max(1, octave // granularity)
        lengths.append(min(max_length, lengths[-1] + step))
    return tuple(lengths)


def choose_bucket(
    batch: int, length: int, lengths: Sequence[int], batch_sizes: Sequence[int] | None
) -> Bucket | None:
    """The smallest bucket holding a [batch, length] batch; None when none does.
    `lengths` and `batch_sizes` are sorted; batch_sizes None buckets each batch size alone."""
    i = bisect.bisect_left(lengths, length)
    if i == len(lengths):
        return None
    if batch_sizes is None:
        return Bucket(batch, lengths[i])
    j = bisect.bisect_left(batch_sizes, batch)
    if j == len(batch_sizes):
        return None
    return Bucket(batch_sizes[j], lengths[i])


def batch_shape(leaves: Sequence[Any]) -> tuple[int, int]:
    """(B, T) shared by a batch's tensors: [B, T, ...] ones give both, [B] ones B."""
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    long = [x for x in tensors if x.dim() >= 2]
    if not long:
        raise ValueError(
            "expected a batch with at least one [batch, length, ...] tensor, got "
            + (f"tensors of shapes {[tuple(x.shape) for x in tensors]}" if tensors else "no tensor")
        )
    b, t = long[0].shape[:2]
    for x in tensors:
        if x.dim() == 0 or x.shape[0] != b or (x.dim() >= 2 and x.shape[1] != t):
            raise ValueError(
                f"expected every tensor of the batch as [{b}, {t}, ...] or [{b}], "
                f"got one of shape {tuple(x.shape)}"
            )
    return int(b), int(t)


def signature(leaves: Sequence[Any]) -> tuple:
    """What besides the bucket a graph is specific to: dtypes and trailing dims of the
    tensors, and the values of everything else."""
    return tuple(
        (x.dtype, tuple(x.shape[2:]), x.dim()) if isinstance(x, torch.Tensor) else ("const", x)
        for x in leaves
    )


def pad(x: Any, bucket: Bucket, value: float) -> Any:
    """x padded on the right to the bucket's shape (a new tensor unless it already fits)."""
    if not isinstance(x, torch.Tensor):
        return x
    shape = (bucket.batch, bucket.length, *x.shape[2:]) if x.dim() >= 2 else (bucket.batch,)
    if tuple(x.shape) == shape:
        return x
    out = x.new_full(shape, value)
    copy_padded(out, x, value)
    return out


def resize(x: Any, bucket: Bucket, value: float) -> Any:
    """x cut or padded to exactly the bucket's shape."""
    if not isinstance(x, torch.Tensor):
        return x
    x = x[: bucket.batch, : bucket.length] if x.dim() >= 2 else x[: bucket.batch]
    return pad(x, bucket, value)


def copy_padded(static: torch.Tensor, x: torch.Tensor, value: float) -> None:
    """Writes x into the top-left corner of `static` and `value` everywhere else."""
    b = x.shape[0]
    if x.dim() >= 2:
        t = x.shape[1]
        static[:b, :t].copy_(x, non_blocking=True)
        if t < static.shape[1]:
            static[:b, t:].fill_(value)
    else:
        static[:b].copy_(x, non_blocking=True)
    if b < static.shape[0]:
        static[b:].fill_(value)


def cut_kind(out: Any, bucket: Bucket) -> int:
    """How an output leaf of a bucket's forward is cut back (Note [Bucket padding])."""
    if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[0] != bucket.batch:
        return WHOLE
    if out.dim() >= 2 and out.shape[1] == bucket.length:
        return CUT_BOTH
    return CUT_BATCH


def cut(out: Any, kind: int, b: int, t: int) -> Any:
    if kind == CUT_BOTH:
        return out[:b, :t]
    if kind == CUT_BATCH:
        return out[:b]
    return out


def sorted_sizes(values: Iterable[int], name: str) -> tuple[int, ...]:
    """`values` as sorted distinct positive ints, or a TypeError/ValueError naming `name`."""
    try:
        sizes = tuple(sorted(set(values)))
    except TypeError:
        raise TypeError(f"expected {name} as an iterable of ints, got {values!r}") from None
    if not sizes or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in sizes):
        raise ValueError(f"expected {name} as positive ints, got {values!r}")
    return sizes


def pad_values(pad_value: Any, inputs: Any, leaves: list[Any]) -> list[float]:
    """One pad value per leaf of `inputs`: `pad_value` for every leaf, or, for a dict
    `pad_value`, its value for the key each leaf sits under (0 for a key it does not name)."""
    if not isinstance(pad_value, dict):
        return [pad_value] * len(leaves)
    if not isinstance(inputs, dict):
        raise TypeError(f"expected dict inputs for a dict pad_value, got {type(inputs).__name__}")
    pads = []
    for key, value in inputs.items():
        pads += [pad_value.get(key, 0)] * len(pytree.tree_leaves(value))
    return pads


def above_largest(
    what: str, batch: int, length: int, lengths: Sequence[int], batch_sizes: Sequence[int] | None
) -> str:
    """Why choose_bucket found none: the "too long" fallback's detail for a `what`."""
    limit = f"{lengths[-1]}" + ("" if batch_sizes is None else f" x batch {batch_sizes[-1]}")
    return f"{what} of {batch} x {length} is above the largest bucket ({limit})"


def as_pair(label: Any) -> Any:
    """A graph cache label as stats() report it: (batch, length) for a Bucket."""
    return (label.batch, label.length) if isinstance(label, Bucket) else label


class PaddingTally:
    """The tokens a stage processed, real and padded, counted from any lane's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._real = self._processed = 0

    def add(self, real: int, processed: int) -> None:
        with self._lock:
            self._real += real
            self._processed += processed

    def waste(self) -> float:
        """Padded tokens over all tokens processed (0 before any)."""
        with self._lock:
            real, processed = self._real, self._processed
        return 0.0 if processed == 0 else (processed - real) / processed


def bucket_options(
    lengths: Iterable[int] | None,
    granularity: int | None,
    batch_sizes: Iterable[int] | None,
    pad_value: Any,
) -> tuple[tuple[int, ...], tuple[int, ...] | None, Any]:
    """A graph stage's bucket arguments, checked: (lengths, batch_sizes, pad_value).
    Without `lengths`, the ladder of `granularity` steps per doubling (Note [Bucket ladder])."""
    if lengths is not None and granularity is not None:
        raise ValueError("expected lengths or granularity, got both")
    if lengths is None:
        lengths = ladder(
            counted(DEFAULT_GRANULARITY if granularity is None else granularity, "granularity")
        )
    if not isinstance(pad_value, (int, float, dict)) or isinstance(pad_value, bool):
        raise TypeError(f"expected pad_value as a number or a dict, got {type(pad_value).__name__}")
    sizes = None if batch_sizes is None else sorted_sizes(batch_sizes, "batch_sizes")
    return sorted_sizes(lengths, "lengths"), sizes, pad_value
