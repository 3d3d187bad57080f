"""CUDA graphs on lanes: capture, the per-lane cache, buckets, the output ring.

- lane_graph.py: `capture_graph`, the one capture routine; `capture` and
  `CapturedGraph` for one inference forward; `submit`, a native launch.
- cache.py: `GraphCache`, the graphs of each lane, keyed by bucket, with its fallbacks;
  lane_cache.py: one lane's graphs; policy.py: `Policy`, what a graph must pay back;
  pools.py: memory pools, and giving one back.
- bucketed.py: `BucketedGraphs`, the one helper under both graph stages, with the key of
  a graph (`GraphKey`) and what a stream program launches (`NativeLaunch`).
- buckets.py: the bucket ladder and padding; output_ring.py: output buffers per replay.
- _cuda_capture.py: the torch CUDA calls a capture makes, in one place.

Graphs build on lanes (pydflash/lanes) and never import the stages that use them.
"""

from .lane_graph import CapturedGraph, TensorSpec, capture, capture_graph, submit

__all__ = ["CapturedGraph", "TensorSpec", "capture", "capture_graph", "submit"]
