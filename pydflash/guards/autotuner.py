"""The autotuner: `Autotuner.run` (and so its subclasses, flash-linear-attention's
`CachedAutotuner` included) keeps a call's arguments in locals; a cache hit takes no
lock; a miss is tuned once through the compile queue, keyed by (autotuner, tuning key)
and holding the device's benchmark slot, while other threads needing that key wait for
it. The state the unpatched code keeps on the instance between statements becomes per
thread (Note [Per-thread autotuner state] in per_thread.py), so hooks (`reset_to_zero`,
`restore_value`, `Config.pre_hook`, `post_hook`) see only the calling thread's tensors
and the disk cache gets the timings of the key it names. A key's configs compile in
parallel before its first benchmark (Note [Compiling configs in parallel])."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import inspect
import os
import threading
from collections.abc import Callable
from typing import Any

from .. import compile_queue
from .checks import Checker
from .interpreter import interpreting
from .patching import Change, Patch
from .per_thread import PerThread

# Statements of Autotuner.run that the lock-free hit path reproduces.
_RUN_HOT_PATH = (
    "self.nargs = dict(zip(self.arg_names, args))",
    "if len(self.configs) > 1:",
    "all_args = {**self.nargs, **kwargs}",
    "_args = {k: v for (k, v) in all_args.items() if k in self.arg_names}",
    "key = [_args[key] for key in self.keys if key in _args]",
    'if hasattr(arg, "dtype"): key.append(str(arg.dtype))',
    "key = tuple(key)",
    "if key not in self.cache:",
    "config = self.cache[key]",
    "config = self.configs[0]",
    "self.best_config = config",
    "if config.pre_hook is not None:",
    "full_nargs = {**self.nargs, **kwargs, **config.all_kwargs()}",
    "config.pre_hook(full_nargs)",
    "ret = self.fn.run(*args, **kwargs, **config.all_kwargs(),)",
    "self.nargs = None",
)

# The instance attributes made per thread, and what a thread reads before it set one.
_PER_THREAD_DEFAULTS: dict[str, Callable[[], Any] | None] = {
    "nargs": lambda: None,
    "restore_copies": dict,
    "configs_timings": None,
    "bench_time": None,
}


def plan(check: Checker) -> list[Change]:
    from triton.runtime.autotuner import Autotuner

    ok = check.source_has("triton.runtime.autotuner.Autotuner.run", Autotuner.run, _RUN_HOT_PATH)
    ok &= check.source_has(
        "triton.runtime.autotuner.Autotuner._bench", Autotuner._bench, ("{**self.nargs,",)
    )
    bench_params = inspect.signature(Autotuner._bench).parameters
    if (
        "config" not in bench_params
        or bench_params["config"].kind is not inspect.Parameter.KEYWORD_ONLY
    ):
        check.problems.append("Autotuner._bench takes no keyword-only `config`")
        ok = False
    for name in _PER_THREAD_DEFAULTS:
        if name in vars(Autotuner):
            check.problems.append(f"Autotuner already defines a class attribute `{name}`")
            ok = False
    if not ok:
        return []
    return [
        Patch(Autotuner, "run", _make_guarded_run(Autotuner.run)),
        Patch(Autotuner, "_bench", _make_precompiling_bench(Autotuner._bench)),
        *(Patch(Autotuner, name, PerThread(name, d)) for name, d in _PER_THREAD_DEFAULTS.items()),
    ]


def _make_guarded_run(original_run: Callable[..., Any]) -> Callable[..., Any]:
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        # The statements of Autotuner.run's hit path (_RUN_HOT_PATH), arguments in locals.
        if len(self.configs) > 1:
            arg_names = self.arg_names
            # Here and for the pre_hook: arg_names may outnumber args (the rest come as
            # kwargs), and zip(..., strict=False) would add a keyword call to the hot path.
            all_args = {**dict(zip(arg_names, args)), **kwargs}  # noqa: B905
            named = {k: v for (k, v) in all_args.items() if k in arg_names}
            key = [named[name] for name in self.keys if name in named]
            for arg in named.values():
                if hasattr(arg, "dtype"):
                    key.append(str(arg.dtype))
            key = tuple(key)
            config = self.cache.get(key)
            if config is None:
                return tune(self, key, args, kwargs)
        else:
            config = self.configs[0]
        self.best_config = config
        if config.pre_hook is not None:
            config.pre_hook({**dict(zip(self.arg_names, args)), **kwargs, **config.all_kwargs()})  # noqa: B905
        return self.fn.run(*args, **kwargs, **config.all_kwargs())

    def tune(self: Any, key: tuple, args: tuple, kwargs: dict) -> Any:
        me = threading.get_ident()

        def work() -> tuple:
            # The unpatched run benchmarks (with per-thread state) and launches this
            # thread's own call; waiters only need the config it leaves in the cache.
            _tuning.autotuner = self  # its first benchmark compiles every config first
            try:
                return me, original_run(self, *args, **kwargs), None
            except Exception as exc:
                if key in self.cache:  # tuned; only this thread's launch failed
                    return me, None, exc
                raise
            finally:
                _tuning.autotuner = None

        name = getattr(getattr(self, "base_fn", None), "__name__", "kernel")
        holder, result, error = compile_queue.run(
            f"autotune:{name}@{id(self):x}:{key!r}", work, slot=_benchmark_slot()
        )
        if holder != me:
            return run(self, *args, **kwargs)
        if error is not None:
            raise error
        return result

    functools.update_wrapper(run, original_run)
    return run


def _benchmark_slot() -> str:
    """One autotune benchmark per device at a time; the interpreter is one device."""
    if interpreting():
        return compile_queue.slot_for_device(None)
    from triton.runtime.driver import driver

    return compile_queue.slot_for_device(driver.active.get_current_device())


# Note [Compiling configs in parallel]
# A cold autotune key compiles every config, one after another, inside the benchmark
# loop, and compiling dominates a cold start. When the holder of a key is about to run
# its first benchmark (so the disk cache missed), it compiles all the configs at once on
# a few threads (Triton compiles in its own MLIR context each time, and ptxas runs as a
# subprocess), then benchmarks as usual: every config is found compiled. A failed
# compile is left for the benchmark, which compiles it again and handles the error as
# Triton always does. PYDFLASH_PRECOMPILE_THREADS sets the threads (0: off).
_tuning = threading.local()


def _precompile_threads() -> int:
    value = os.environ.get("PYDFLASH_PRECOMPILE_THREADS")
    if value is None:
        return min(8, os.cpu_count() or 1)
    try:
        return max(0, int(value))
    except ValueError:
        raise ValueError(f"expected PYDFLASH_PRECOMPILE_THREADS as an int, got {value!r}") from None


def _make_precompiling_bench(original: Callable[..., Any]) -> Callable[..., Any]:
    def _bench(self: Any, *args: Any, config: Any, **meta: Any) -> Any:
        if getattr(_tuning, "autotuner", None) is self:
            _tuning.autotuner = None
            _precompile(self, args, meta)
        return original(self, *args, config=config, **meta)

    functools.update_wrapper(_bench, original)
    return _bench


def _precompile(autotuner: Any, args: tuple, meta: dict) -> None:
    threads = _precompile_threads()
    slot = _benchmark_slot()
    if threads == 0 or not slot.startswith("cuda:"):
        return  # the interpreter compiles nothing
    configs = autotuner.prune_configs(meta)  # as the benchmark loop does, this thread's nargs
    if len(configs) < 2:
        return
    device = int(slot.split(":")[1])
    jit = autotuner.fn
    while hasattr(jit, "fn") and not hasattr(jit, "device_caches"):
        jit = jit.fn
    if hasattr(jit, "device_caches"):
        jit.device_caches[device]  # create the per-device cache here, not in a race
    options = {k: v for k, v in meta.items() if k not in ("grid", "warmup")}

    def compile_config(config: Any) -> None:
        _set_thread_device(device)
        with contextlib.suppress(Exception):  # the benchmark meets it again, see the Note
            autotuner.fn.run(*args, grid=(1, 1, 1), warmup=True, **options, **config.all_kwargs())

    with concurrent.futures.ThreadPoolExecutor(
        max_workers=min(threads, len(configs)), thread_name_prefix="pydflash-precompile"
    ) as pool:
        list(pool.map(compile_config, configs))


def _set_thread_device(device: int) -> None:
    from triton.runtime.driver import driver

    driver.active.set_current_device(device)
