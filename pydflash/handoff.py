"""Handing GPU results from one stream to another without a host sync.

Note [Tensors across streams]: the caching allocator ties a block to the stream it
was allocated on; once the producer's references die it may hand the block to a new
allocation on that stream while a consumer stream still reads it. `hand_over` makes
the consumer stream wait on the producer's event and calls `record_stream(consumer)`
on every CUDA tensor in the result, which delays the block's reuse until the
consumer's work queued so far is done.
"""

from __future__ import annotations

from typing import Any, Iterator

from ._native import C


def iter_tensors(obj: Any) -> Iterator[Any]:
    """CUDA tensors inside nested tuples, lists, dicts and dataclass-like objects."""
    import torch

    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)


def hand_over(result: Any, event: int, stream: Any = None) -> None:
    """Orders `stream` after `event`, a cudaEvent_t as an int, and protects the result's
    tensors for use on it. Default: the current stream of each tensor's own device,
    which is where torch issues reads of it, cross-device copies included."""
    import torch

    tensors = list(iter_tensors(result))
    if stream is not None:
        streams = {stream.device_index: stream}
    else:
        streams = {t.device.index: None for t in tensors} or {torch.cuda.current_device(): None}
        streams = {d: torch.cuda.current_stream(d) for d in streams}
    for s in streams.values():
        C.stream_wait_event(s.cuda_stream, event)
    for tensor in tensors:
        tensor.record_stream(streams.get(tensor.device.index, stream))
