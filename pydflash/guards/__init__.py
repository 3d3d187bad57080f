"""Guards that make what compiles kernels safe to call from several threads at once.

Each guard is installed once per process, reversibly, and held by name with
`Dispatcher(guard=...)` or `guard(names)` (by default, and with `install_guards()`, all;
`remove_guards()` removes them all):

- 'triton': Triton's autotuner (autotuner.py, with per-thread instance state from
  per_thread.py), single-flight JIT compiles and kernel loads (jit.py), serialized
  interpreted launches (interpreter.py) and the allocator lane threads get
  (allocator.py). These parts are always on together: each closes a race the others
  leave open. Before patching, every Triton internal they rely on is checked
  (checks.py); when one moved, the guard refuses to install (UnsupportedTritonError).
- 'fla': flash-linear-attention's `tensor_cache` (fla.py).
- 'torch_compile': the first calls of a `torch.compile`d module (torch_compile.py).

The last two need no Triton and take effect when their package is imported, now or
later (after_import.py). install.py keeps the holds; every patch is a reversible
`Patch` (patching.py). The slow work goes through the compile queue
(pydflash/compile_queue.py).

Warm start: autotune results persist across processes when Triton caches them
(`TRITON_CACHE_AUTOTUNING=1`, or `cache_results=True` in `triton.autotune`) and
flash-linear-attention does (`FLA_CACHE_RESULTS=1`, its default); with a persistent
`TRITON_CACHE_DIR` the second start of a script compiles and benchmarks nothing.
`Dispatcher.warmup` tunes everything a step needs in one pass over the lanes.
"""

from __future__ import annotations

from .install import (
    GUARDS,
    GuardHandle,
    guard,
    guard_triton,
    install_guards,
    installed,
    is_guarded,
    remove_guards,
    select,
    unguard_triton,
)

__all__ = [
    "GUARDS",
    "GuardHandle",
    "guard",
    "guard_triton",
    "install_guards",
    "installed",
    "is_guarded",
    "remove_guards",
    "select",
    "unguard_triton",
]
