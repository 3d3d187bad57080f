"""Handing results from one lane to another, and from one stream to another, without a
host sync; and the walk over the tensors of a result.

A result is a tree: tensors inside nested tuples, lists, dicts, namedtuples and any other
container `torch.utils._pytree` knows (transformers registers its ModelOutput). Other
containers, and other objects, are leaves, passed through as they are.

Note [Tensors across streams]: the caching allocator ties a block to the stream it
was allocated on; once the producer's references die it may hand the block to a new
allocation on that stream while a consumer stream still reads it. `hand_over` makes
the consumer stream wait on the producer's event and calls `record_stream(consumer)`
on every CUDA tensor in the result, which delays the block's reuse until the
consumer's work queued so far is done.

Note [Hidden-state handoff]: `hand_to_lane` makes no host sync on GPU lanes. On one GPU
the consuming lane's stream waits on the producer's event and the tensors are used in
place (Note [Tensors across streams]). Across GPUs torch issues a device-to-device copy
on the *source* device's current stream, with event barriers to the destination's
current stream (aten/src/ATen/native/cuda/Copy.cu). So the copy is made with the
producing lane's copy stream current on the source device (made to wait on the
producer's event) and the consuming lane's copy stream current on the destination; the
consumer's compute stream then waits on an event recorded on its copy stream. torch
uses a peer copy when `can_device_access_peer` allows, and stages through the host
otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from .._native import C
from .._tree import map_tensors, tensors

__all__ = ["hand_over", "hand_to_lane", "map_tensors", "peer_access", "tensors", "to_lane"]


def hand_over(result: Any, event: int, stream: Any = None) -> None:
    """Orders `stream` after `event`, a cudaEvent_t as an int, and protects the result's
    tensors for use on it. Default: the current stream of each tensor's own device,
    which is where torch issues reads of it, cross-device copies included."""
    cuda = [t for t in tensors(result) if t.is_cuda]
    if stream is not None:
        streams = {stream.device_index: stream}
    else:
        streams = {t.device.index: None for t in cuda} or {torch.cuda.current_device(): None}
        streams = {d: torch.cuda.current_stream(d) for d in streams}
    for s in streams.values():
        C.stream_wait_event(s.cuda_stream, event)
    for tensor in cuda:
        tensor.record_stream(streams.get(tensor.device.index, stream))


def hand_to_lane(value: Any, src: Any, event: int, dst: Any) -> tuple[Any, int]:
    """`value`, produced on lane `src` before `event` (a cudaEvent_t as an int), made
    usable on lane `dst`'s compute stream (the calling lane's), and the bytes of any copy
    made. See Note [Hidden-state handoff]."""
    if not src.is_gpu and not dst.is_gpu:
        return value, 0
    if src.is_gpu and dst.is_gpu and src.device_index == dst.device_index:
        hand_over(value, event, dst.stream)
        return value, 0
    device = torch.device(dst.device)
    with contextlib.ExitStack() as streams:
        if src.is_gpu:
            src_stream = src.copy_stream
            C.stream_wait_event(src_stream.cuda_stream, event)
            streams.enter_context(torch.cuda.stream(src_stream))
        if dst.is_gpu:
            dst_stream = dst.copy_stream
            streams.enter_context(torch.cuda.stream(dst_stream))
        # Into host memory the copy must be complete before the CPU reads it.
        moved = map_tensors(lambda t: t.to(device, non_blocking=dst.is_gpu), value)
        if src.is_gpu:
            for tensor in tensors(value):
                if tensor.is_cuda:
                    tensor.record_stream(src_stream)
        if dst.is_gpu:
            copied = torch.cuda.Event()
            copied.record(dst_stream)
    if dst.is_gpu:
        compute = dst.stream
        compute.wait_event(copied)
        for tensor in tensors(moved):
            if tensor.is_cuda:
                tensor.record_stream(compute)
    return moved, sum(t.nbytes for t in tensors(moved))


def to_lane(batch: Any, lane: Any) -> Any:
    """The batch's tensors moved to a GPU lane's device (non-blocking); unchanged on a CPU lane."""
    if not lane.is_gpu:
        return batch
    device = torch.device(lane.device)
    return map_tensors(lambda t: t.to(device, non_blocking=True), batch)


def peer_access(sources: Sequence[Any], consumers: Sequence[Any]) -> dict[str, bool]:
    """For each pair of GPU lanes on different devices, 'cuda:S->cuda:D': whether D can
    access S's memory directly (a peer copy) rather than through the host."""
    pairs = {}
    for s in sources:
        for d in consumers:
            if s.is_gpu and d.is_gpu and s.device_index != d.device_index:
                pairs[f"{s.device}->{d.device}"] = torch.cuda.can_device_access_peer(
                    d.device_index, s.device_index
                )
    return pairs
