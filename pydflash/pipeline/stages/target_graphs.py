"""A frozen target's forward as CUDA graphs over (batch, length) buckets.

    target = pydflash.TargetGraphs(target_forward)            # fn(batch), as for EagerTarget
    pipe = pydflash.Pipeline(target_lanes, drafter_lanes, target=target, ...)

A target forward launches hundreds of small kernels with the GIL held; replayed as a
CUDA graph it is one launch. Real batches vary in length, so `TargetGraphs` pads each
batch on the right to a bucket (pydflash/graphs/buckets.py, Note [Bucket padding] and Note
[Bucket ladder]), replays the graph captured for that bucket on that lane (capturing it on
first use: pydflash/graphs/cache.py), and returns the outputs cut back to the real shape,
in a ring buffer (pydflash/graphs/output_ring.py, Note [Output ring]). The replay runs inside the
lane task, not as a native launch (Note [Where a replay runs] in pydflash/graphs/lane_graph.py).

Note [Shared graph pool]: a lane's graphs share one memory pool, so a later capture reuses
the scratch memory of earlier ones. torch calls pool sharing safe for graphs that never
run at once. Here every replay runs on the lane's one stream, and its outputs are copied
out on that stream before the next replay starts, so no graph's outputs are read after
another graph may have written over them. Captures of one bucket on several lanes take
turns in the compile queue for their warm-up: the first lane compiles and autotunes alone,
the others find warm caches. The capture itself pauses the device's other lanes (Note
[Capturing beside other lanes] in pydflash/graphs/lane_graph.py).

Note [When graphs pay]: a graph saves the host's launch time, nothing on the GPU. A
forward that keeps the GPU busy without it (a 25 B target at 512 to 2048 tokens: 190 ms of
kernels per microbatch) gains nothing, and padding costs it compute. So with policy
"auto" a bucket's second and third eager calls are timed where they run, on the GPU (CUDA
events, read once passed: no host sync) and on the host: where the host launched one in
less than `gpu_bound_ratio` of its GPU time, or its device was busy anyway (NVML), it is
never captured; otherwise its last warm-up call is judged the same way, then the graph's
first replays are timed, and a bucket whose graph takes at least `gpu_bound_ratio` of the
eager call's cost runs eagerly and unpadded from then on (`stats()["eager_buckets"]`;
Note [A policy for the whole step] in pydflash/graphs/policy.py).
`stats()["padding_waste"]` is the fraction of processed tokens that were padding.

Fallback: when no graph can serve (a length above the largest bucket, a capture that
fails, the device's other lanes not pausing in time, the pool's byte cap, outputs that
cannot be cut back: Note [Outputs cut back]), the batch runs
eagerly, unpadded, and a GraphFallbackWarning says why, once per kind; `stats()["fallbacks"]`
counts each kind and keeps its latest detail. Only an error that the eager forward raises
too reaches the caller. On CPU lanes there are no graphs: batches take the same padded
path, run eagerly.

Note [Outputs cut back]: a padded forward's outputs are cut back to the batch by their
shape (Note [Bucket padding] in pydflash/graphs/buckets.py): [Bb, Tb, ...] to [B, T, ...], [Bb, ...]
to [B, ...], and a 0-dim tensor or a value that is not a tensor is returned as it is. A
tensor of any other shape ([Tb, Bb] from a transpose, [Bb * Tb] from a flatten) has padding
in it that no cut can take out: its bucket runs eagerly and unpadded from then on, with a
GraphFallbackWarning ("uncut output"), rather than return padded outputs silently.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..._checks import counted
from ..._tree import flatten, unflatten
from ...graphs import cache as graph_cache
from ...graphs.bucketed import BucketedGraphs, GraphKey, NativeLaunch
from ...graphs.buckets import (
    WHOLE,
    Bucket,
    above_largest,
    batch_shape,
    copy_padded,
    cut,
    cut_kind,
    pad,
    pad_values,
    resize,
    signature,
)
from ...graphs.cache import Policy
from ...graphs.lane_graph import DEFAULT_QUIET_TIMEOUT, DEFAULT_WARMUP
from ...graphs.output_ring import OutputRing
from ...lanes._future import Future
from ...lanes._torch_state import match_intra_op_threads
from ...lanes.handoff import tensors, to_lane
from ...lanes.lane import Lane
from . import TargetStage

DEFAULT_RING = 4
ON_FULL = graph_cache.ON_FULL
POLICIES = graph_cache.POLICIES
UNCUT = "uncut output"  # the fallback of Note [Outputs cut back]


@dataclass
class _Static:
    """What a bucket's graph reads and how its outputs are cut back."""

    inputs: list[Any]  # the padded batch's leaves; tensors are the graph's inputs
    bucket: Bucket
    out_spec: Any = None
    out_leaves: list[Any] | None = None
    out_cuts: list[int] | None = None
    out_signature: tuple | None = None  # signature() of the outputs: the drafter's key


class TargetGraphs(TargetStage):
    """fn(batch), a frozen target's forward, replayed as CUDA graphs per (batch, length)
    bucket on each lane that runs it. See the module's notes.

    Args:
        fn: the target forward, called as fn(batch) under torch.no_grad().
        lengths: the bucket lengths; a longer batch runs eagerly. Default: 128 to 8192,
            each doubling split into `granularity` steps (Note [Bucket ladder]).
        granularity: steps per doubling of the default lengths (default 4: at most a
            fifth of a bucket is padding, about 8 % on average); 1 gives powers of two.
            Only with the default lengths.
        batch_sizes: the bucket batch sizes; None (default) gives each batch size its
            own buckets.
        pad_value: what padding holds, or a dict of it per key of a dict batch (default 0).
        warmup: eager calls before a capture (lazy initialisation, autotuning).
        ring: output buffers per lane (Note [Output ring]); at least a pipeline's depth,
            so no microbatch waits for a fresh allocation; 0 allocates every output afresh.
        max_pool_bytes: the most a lane's graph pool may hold.
        on_full: what happens to a capture past max_pool_bytes: "eager" (run that bucket
            eagerly, warn) or "raise" (GraphMemoryError).
        max_graphs: graphs kept per lane; beyond it the least recently used is dropped.
        policy: a `pydflash.Policy` or its string. "auto" (default) runs a bucket eagerly
            and unpadded when its graph does not pay (Note [When graphs pay], and Note [A
            policy for the whole step] in pydflash/graphs/policy.py); "graphs" keeps every
            graph; "eager" captures nothing and runs every batch unpadded.
        gpu_bound_ratio: with "auto", a bucket whose eager launch takes the host less
            than this fraction of its GPU time is not captured, and a graph taking at
            least this fraction of the eager call's cost is dropped (default 0.9).
        capture_after: with "auto", a bucket is captured at its capture_after-th batch
            (default 1); `warmup()` captures at once.
        capture_budget: with "auto", the most seconds a lane spends capturing (None: no
            limit).
        quiet_timeout: seconds a capture waits for the device's other lanes to pause
            before the bucket runs eagerly ("device busy"); a later batch tries again.
    """

    def __init__(
        self,
        fn: Callable[[Any], Any],
        *,
        lengths: Iterable[int] | None = None,
        granularity: int | None = None,
        batch_sizes: Iterable[int] | None = None,
        pad_value: float | dict[str, float] = 0,
        warmup: int = DEFAULT_WARMUP,
        ring: int = DEFAULT_RING,
        max_pool_bytes: int | None = None,
        on_full: str = "eager",
        max_graphs: int | None = None,
        policy: Policy | str = Policy.AUTO,
        gpu_bound_ratio: float = graph_cache.DEFAULT_GPU_BOUND_RATIO,
        capture_after: int = 1,
        capture_budget: float | None = None,
        quiet_timeout: float = DEFAULT_QUIET_TIMEOUT,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"expected a callable target, got {type(fn).__name__}")
        self.fn = fn
        self.ring_slots = counted(ring, "ring", minimum=0)
        self._graphs = BucketedGraphs(
            f"pydflash.TargetGraphs {id(self):x}",
            lengths=lengths,
            granularity=granularity,
            batch_sizes=batch_sizes,
            pad_value=pad_value,
            warmup=warmup,
            max_graphs=max_graphs,
            max_pool_bytes=max_pool_bytes,
            on_full=on_full,
            policy=policy,
            gpu_bound_ratio=gpu_bound_ratio,
            capture_after=capture_after,
            capture_budget=capture_budget,
            quiet_timeout=quiet_timeout,
        )
        self.lengths, self.batch_sizes = self._graphs.lengths, self._graphs.batch_sizes
        self.pad_value = self._graphs.pad_value
        self._lock = threading.Lock()
        self._rings: dict[Lane, OutputRing] = {}

    @property
    def warmup_calls(self) -> int:
        return self._graphs.cache.warmup

    @property
    def max_graphs(self) -> int | None:
        return self._graphs.cache.max_graphs

    @property
    def max_pool_bytes(self) -> int | None:
        return self._graphs.cache.max_pool_bytes

    @property
    def on_full(self) -> str:
        return self._graphs.cache.on_full

    @property
    def policy(self) -> Policy:
        return self._graphs.policy

    @property
    def launches_natively(self) -> bool:  # type: ignore[override]
        return self._graphs.zero_padded

    # --- TargetStage ----------------------------------------------------------------------
    def submit(self, lane: Lane, batch: Any) -> Future:
        """Runs the forward of `batch` on `lane`; the future's result is fn's output cut
        back to the batch's shape (in a ring buffer: give it back with `release`)."""
        return lane.submit(self._run, lane, batch, torch.get_num_threads())

    def _submit_ahead(self, lane: Lane, batch: Any) -> Future:
        return lane.submit(self._run, lane, batch, torch.get_num_threads(), True)

    @property
    def recycles(self) -> bool:  # type: ignore[override]
        return self.ring_slots > 0

    def release(self, result: Any, event: Any = None) -> None:
        """Gives `result`'s ring buffer back once `event` (a torch.cuda.Event; default:
        one recorded now on the current stream) has passed on the GPU. Results that are
        not in a ring buffer are left alone."""
        first = next(iter(tensors(result)), None)
        if first is None or not first.is_cuda:
            return
        if event is None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(first.device))
        with self._lock:
            rings = list(self._rings.values())
        for ring in rings:
            if ring.give_back(first, event):
                return

    def warmup(
        self,
        lanes: Sequence[Lane] | Lane,
        example: Any,
        shapes: Iterable[tuple[int, int]] | None = None,
    ) -> dict[str, Any]:
        """Captures ahead: on every lane, the bucket of each (batch, length) in `shapes`
        (default: every length bucket at the example's batch size), from `example` padded
        or cut to that shape. Lanes capture at once; returns stats()."""
        lanes = [lanes] if isinstance(lanes, Lane) else list(lanes)
        leaves, spec = pytree.tree_flatten(example)
        b, _ = batch_shape(leaves)
        if shapes is None:
            shapes = [(b, length) for length in self.lengths]
        pads = pad_values(self.pad_value, example, leaves)
        batches = [
            pytree.tree_unflatten(
                [resize(x, Bucket(batch, length), p) for x, p in zip(leaves, pads, strict=True)],
                spec,
            )
            for batch, length in shapes
        ]
        futures = [self._submit_ahead(lane, batch) for lane in lanes for batch in batches]
        for future in futures:
            self.release(future.wait_stream() if future.event else future.result())
        return self.stats()

    def stats(self) -> dict[str, Any]:
        """Per lane label: the buckets captured (batch, length), captures, capture attempts
        and failures, capture seconds, replays, eager runs, evictions, graphs dropped
        (memory cap, policy), the bytes its graph pool reserves, pools given back and
        released bytes, the policy's choices, and ring misses. "fallbacks": per kind, the
        eager runs it caused and the latest detail. "eager_buckets": buckets the policy
        runs eagerly, with the reason and both GPU timings in ms. "padding_waste": padded
        tokens over all tokens processed. "policy": the Policy."""
        with self._lock:
            rings = {lane.label: ring for lane, ring in self._rings.items()}

        def ring_misses(label: str, _: dict[str, Any]) -> dict[str, Any]:
            ring = rings.get(label)
            return {"ring_misses": 0 if ring is None else ring.misses}

        return self._graphs.stats(ring_misses)

    def native_launch(
        self, lane: Lane, b: int, t: int, spec: Any, sig: tuple
    ) -> NativeLaunch | None:
        """What a stream program launches in place of this stage's task for a [b, t]
        batch of tree `spec` and signature `sig` on `lane` (pydflash.graphs.bucketed,
        Note [Native microbatch] in pydflash/pipeline/native_microbatch.py), or None. Any thread."""
        return self._graphs.native_launch(lane, b, t, spec, sig, _launch_parts)

    # --- on the lane's worker ----------------------------------------------------------------
    def _run(self, lane: Lane, batch: Any, threads: int, ahead: bool = False) -> Any:
        match_intra_op_threads(threads)
        with torch.no_grad():
            batch = to_lane(batch, lane)
            leaves, spec = flatten(batch)
            if any(isinstance(x, torch.Tensor) and x.is_nested for x in leaves):
                raise TypeError(
                    "expected a batch of dense [batch, length, ...] tensors, got a nested "
                    "tensor (torch.nested): pad it first, e.g. "
                    "torch.nested.to_padded_tensor(x, pad_value)"
                )
            b, t = batch_shape(leaves)
            cache = self._graphs.lane(lane)
            bucket = self._graphs.bucket(b, t)
            if bucket is None:
                detail = above_largest("a batch", b, t, self.lengths, self.batch_sizes)
                cache.fall_back("too long", detail)
                return self._eager(batch, b, t)
            pads = pad_values(self.pad_value, batch, leaves)
            key = GraphKey.of(bucket, leaves, spec)
            if not lane.is_gpu and self.policy is not Policy.EAGER:
                return self._padded_eager(batch, leaves, spec, pads, bucket, key, lane)
            entry = cache.get_or_capture(
                key, lambda: self._prepare(leaves, spec, pads, bucket), label=bucket, ahead=ahead
            )
            if entry is None:
                return cache.run_eagerly(key, partial(self._eager, batch, b, t))
            static: _Static = entry.data
            if static.out_cuts is None:  # captured just now: the inputs are this batch's
                out_leaves, static.out_spec = flatten(entry.outputs)
                uncut = _uncut(out_leaves, bucket)
                if uncut is not None:
                    del entry, static
                    cache.refuse(key, UNCUT, uncut)
                    return self._eager(batch, b, t)
                static.out_leaves = out_leaves
                static.out_cuts = [cut_kind(x, bucket) for x in out_leaves]
                static.out_signature = signature(out_leaves)
            else:
                for buffer, x, p in zip(static.inputs, leaves, pads, strict=True):
                    if isinstance(x, torch.Tensor):
                        copy_padded(buffer, x, p)
            cache.replay(entry)
            self._graphs.padded(b, t, bucket)
            return self._copy_out(lane, static, b, t)

    def _prepare(
        self, leaves: list[Any], spec: Any, pads: list[float], bucket: Bucket
    ) -> tuple[Callable[[], Any], _Static]:
        # Static inputs live outside the pool: a padded copy of the batch, on this lane.
        inputs = [
            x.clone() if isinstance(x, torch.Tensor) else x
            for x in self._padded(leaves, pads, bucket)
        ]
        batch = pytree.tree_unflatten(inputs, spec)
        return (lambda: self.fn(batch)), _Static(inputs, bucket)

    def _padded_eager(
        self,
        batch: Any,
        leaves: list[Any],
        spec: Any,
        pads: list[float],
        bucket: Bucket,
        key: GraphKey,
        lane: Lane,
    ) -> Any:
        """A CPU lane's call: the padded path a graph takes, run eagerly."""
        b, t = batch_shape(leaves)
        cache = self._graphs.lane(lane)
        if cache.recorded(key):
            return self._eager(batch, b, t)
        out = self.fn(pytree.tree_unflatten(self._padded(leaves, pads, bucket), spec))
        out_leaves, out_spec = pytree.tree_flatten(out)
        uncut = _uncut(out_leaves, bucket)
        if uncut is not None:
            cache.refuse(key, UNCUT, uncut)
            return self._eager(batch, b, t)
        self._graphs.padded(b, t, bucket)
        cuts = [cut(x, cut_kind(x, bucket), b, t) for x in out_leaves]
        return pytree.tree_unflatten(
            [x.clone() if isinstance(x, torch.Tensor) else x for x in cuts], out_spec
        )

    def _eager(self, batch: Any, b: int, t: int) -> Any:
        out = self.fn(batch)
        self._graphs.padded(b, t)
        return out

    @staticmethod
    def _padded(leaves: list[Any], pads: list[float], bucket: Bucket) -> list[Any]:
        # A replay copies straight into the graph's static inputs: only the CPU path and
        # a capture need a padded copy of their own.
        return [pad(x, bucket, p) for x, p in zip(leaves, pads, strict=True)]

    def _copy_out(self, lane: Lane, static: _Static, b: int, t: int) -> Any:
        outputs = zip(static.out_leaves, static.out_cuts, strict=True)
        cuts = [cut(x, kind, b, t) for x, kind in outputs]
        ring = self._ring(lane)
        copies = iter(ring.take([x for x in cuts if isinstance(x, torch.Tensor)], lane.stream))
        out = []
        for x in cuts:
            if isinstance(x, torch.Tensor):
                copy = next(copies)
                copy.copy_(x)
                out.append(copy)
            else:
                out.append(x)
        return unflatten(out, static.out_spec)

    def _ring(self, lane: Lane) -> OutputRing:
        ring = self._rings.get(lane)
        if ring is None:
            with self._lock:
                ring = self._rings.setdefault(lane, OutputRing(self.ring_slots))
        return ring

    def __repr__(self) -> str:
        return f"<pydflash.TargetGraphs of {getattr(self.fn, '__qualname__', self.fn)!s}>"


def _uncut(out_leaves: list[Any], bucket: Bucket) -> str | None:
    """Why a bucket's outputs cannot be cut back to a [b, t] batch (Note [Outputs cut
    back]), or None. Decided per bucket, whatever padding the batch at hand has."""
    for i, x in enumerate(out_leaves):
        if isinstance(x, torch.Tensor) and x.dim() > 0 and cut_kind(x, bucket) == WHOLE:
            return (
                f"output {i} of the {bucket.batch} x {bucket.length} bucket has shape "
                f"{tuple(x.shape)}, neither [{bucket.batch}, {bucket.length}, ...] nor "
                f"[{bucket.batch}, ...]: its padding cannot be cut out, so the bucket runs "
                "eagerly and unpadded"
            )
    return None


def _launch_parts(entry: Any) -> tuple | None:
    """TargetGraphs' part of a NativeLaunch (pydflash.graphs.bucketed.Describe)."""
    static: _Static = entry.data
    if static.out_signature is None:
        return None  # not replayed in Python yet: the outputs' layout is unknown
    return (
        static.inputs,
        None,
        static.out_leaves,
        static.out_spec,
        static.out_cuts,
        static.out_signature,
    )
