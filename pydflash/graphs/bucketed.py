"""The one helper under both graph stages (`pydflash.TargetGraphs`,
`pydflash.DrafterGraphs`): their buckets, their graph cache, the key of a graph, what a
stream program launches in place of a stage's task, and their stats.

    graphs = BucketedGraphs("pydflash.TargetGraphs ...", lengths=..., policy="auto", ...)

`BucketedGraphs`' docstring gives the workflow of a graph stage's call, step by step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

from .buckets import Bucket, PaddingTally, as_pair, bucket_options, choose_bucket, signature
from .cache import DEFAULT_GPU_BOUND_RATIO, GraphCache, LaneGraphCache, Policy
from .lane_graph import DEFAULT_QUIET_TIMEOUT, DEFAULT_WARMUP


@dataclass(frozen=True)
class GraphKey:
    """What a graph of a bucketed stage is specific to (step 2 of BucketedGraphs' workflow)."""

    bucket: Bucket
    spec: Any  # the inputs' tree (a torch.utils._pytree.TreeSpec)
    signature: tuple  # buckets.signature() of the inputs' leaves

    @classmethod
    def of(cls, bucket: Bucket, leaves: list[Any], spec: Any) -> GraphKey:
        return cls(bucket, spec, signature(leaves))


@dataclass
class NativeLaunch:
    """What a stream program launches for one microbatch in place of a graph stage's task
    (Note [Native microbatch] in pydflash/pipeline/native_microbatch.py).

    - `exec_handle`: the graph's cudaGraphExec_t;
    - `inputs`: its static input leaves, [Bb, Tb, ...] or [Bb]: the microbatch is copied
      into their top-left corner, and the rest is padding, filled with zeros (a byte
      fill: only a stage padding with 0 launches natively);
    - `lengths`: a [Bb] int64 tensor to hold each row's real length (T for the first B
      rows, 0 after: Note [Padding contract] in pydflash/pipeline/stages/drafter_graphs.py), or
      None;
    - `outputs`, `out_spec`, `out_cuts`, `out_signature`: what a replay writes, as
      leaves, their tree, how each is cut back to the microbatch (buckets.CUT_*), and
      their signature (the next stage's key);
    - `keep`: what must stay alive until the GPU has run the launch;
    - `count()`: counts the replay and its padding, once submitted."""

    exec_handle: int
    inputs: list[Any]
    lengths: Any
    outputs: list[Any]
    out_spec: Any
    out_cuts: list[int]
    out_signature: tuple
    keep: Any
    count: Callable[[], None]


#: A stage's part of a NativeLaunch, read from a graph's entry: (inputs, lengths, outputs,
#: out_spec, out_cuts, out_signature), or None while the entry cannot launch yet.
Describe = Callable[[Any], "tuple[list, Any, list, Any, list, tuple] | None"]


class BucketedGraphs:
    """A graph stage's buckets and graphs on every lane.

    A graph stage's call on a lane, in order:

    1. `graphs.bucket(b, t)`: the smallest bucket holding a [b, t] batch (Note [Bucket
       padding] and Note [Bucket ladder] in pydflash/graphs/buckets.py); None: no bucket
       holds it, the call runs eagerly (`graphs.lane(lane).fall_back("too long", ...)`).
    2. `GraphKey.of(bucket, leaves, spec)`: what a graph is specific to, built here only:
       the bucket, the tree of the inputs and their signature (dtypes, trailing dims, the
       values of constants).
    3. `graphs.lane(lane).get_or_capture(key, make, label=bucket)`: the lane's graph for
       the key, captured on a miss; None runs the call eagerly and unpadded (the graph
       cache, pydflash/graphs/cache.py: failures, the memory cap, `Policy`).
    4. The stage copies the batch into the graph's static inputs, replays it, and counts
       the padding with `graphs.padded(b, t, bucket)`.
    5. `graphs.native_launch(lane, b, t, spec, signature, describe)`: what a stream
       program launches instead of steps 1-4 (`NativeLaunch`, Note [Native microbatch] in
       pydflash/pipeline/native_microbatch.py), once the graph is captured, kept by the
       policy and replayed once in Python.
    6. `graphs.stats(extra)`: the stats both stages report, with the stage's own per lane.

    Args: as the graph stages document them (lengths, granularity, batch_sizes,
    pad_value, warmup, max_pool_bytes, on_full, max_graphs, policy, gpu_bound_ratio,
    capture_after, capture_budget, quiet_timeout); `name` names the stage in warnings.
    """

    def __init__(
        self,
        name: str,
        *,
        lengths: Iterable[int] | None = None,
        granularity: int | None = None,
        batch_sizes: Iterable[int] | None = None,
        pad_value: float | dict[str, float] = 0,
        warmup: int = DEFAULT_WARMUP,
        max_pool_bytes: int | None = None,
        on_full: str = "eager",
        max_graphs: int | None = None,
        policy: Policy | str = Policy.AUTO,
        gpu_bound_ratio: float = DEFAULT_GPU_BOUND_RATIO,
        capture_after: int = 1,
        capture_budget: float | None = None,
        quiet_timeout: float = DEFAULT_QUIET_TIMEOUT,
    ) -> None:
        self.lengths, self.batch_sizes, self.pad_value = bucket_options(
            lengths, granularity, batch_sizes, pad_value
        )
        self.cache = GraphCache(
            name,
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
        self._padding = PaddingTally()

    @property
    def policy(self) -> Policy:
        return self.cache.policy

    @property
    def zero_padded(self) -> bool:
        """Whether padding holds 0 everywhere: what a native launch's byte fill writes."""
        values = self.pad_value.values() if isinstance(self.pad_value, dict) else (self.pad_value,)
        return all(v == 0 for v in values)

    def bucket(self, b: int, t: int) -> Bucket | None:
        return choose_bucket(b, t, self.lengths, self.batch_sizes)

    def lane(self, lane: Any) -> LaneGraphCache:
        return self.cache.lane(lane)

    def padded(self, b: int, t: int, bucket: Bucket | None = None) -> None:
        """Counts a call of [b, t] tokens, padded to `bucket` (None: run unpadded)."""
        processed = b * t if bucket is None else bucket.batch * bucket.length
        self._padding.add(b * t, processed)

    def native_launch(
        self, lane: Any, b: int, t: int, spec: Any, sig: tuple, describe: Describe
    ) -> NativeLaunch | None:
        """Step 5 of the class's workflow: the launch that replays the graph of a [b, t]
        call with inputs of tree `spec` and signature `sig` on `lane`, or None when that
        graph is not ready (not captured, not judged by the policy, not replayed once in
        Python yet) or the stage does not pad with zeros. Raises GraphCaptureError where
        torch exposes no raw graph handle. Any thread."""
        if not (lane.is_gpu and self.zero_padded):
            return None
        bucket = self.bucket(b, t)
        if bucket is None:
            return None
        cache = self.cache.lane(lane)
        entry = cache.ready(GraphKey(bucket, spec, sig))
        if entry is None:
            return None
        parts = describe(entry)
        if parts is None:
            return None
        handle = cache.exec_handle(entry)
        count = partial(self._count_native, cache, b, t, bucket)
        return NativeLaunch(handle, *parts, keep=entry, count=count)

    def _count_native(self, cache: LaneGraphCache, b: int, t: int, bucket: Bucket) -> None:
        cache.replayed()
        self.padded(b, t, bucket)

    def stats(self, extra: Callable[[str, dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
        """Per lane label: "buckets" (the (batch, length) of each bucket graph held), the
        graph cache's counters (pydflash/graphs/cache.py) and what `extra(label, counters)`
        adds; "fallbacks"; "eager_buckets" (with both GPU timings in ms); "padding_waste"
        (padded tokens over all tokens processed); "policy"."""
        cached = self.cache.stats()
        lanes = {}
        for label, s in cached["lanes"].items():
            held = s.pop("graphs")
            lanes[label] = {
                "buckets": [as_pair(g) for g in held if isinstance(g, Bucket)],
                **s,
                **extra(label, {**s, "graphs": held}),
            }
        eager_buckets = [{**e, "bucket": as_pair(e["bucket"])} for e in cached["eager_buckets"]]
        return {
            "lanes": lanes,
            "fallbacks": cached["fallbacks"],
            "eager_buckets": eager_buckets,
            "padding_waste": self._padding.waste(),
            "policy": self.policy,
        }
