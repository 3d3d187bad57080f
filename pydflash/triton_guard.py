"""Makes Triton's autotuner and JIT safe to use from several threads at once.

`guard_triton()` patches, once per process and reversibly:

- `Autotuner.run` (and so its subclasses, flash-linear-attention's `CachedAutotuner`
  included): a call's arguments stay in locals; a cache hit takes no lock; a miss is
  tuned once through the compile queue, keyed by (autotuner, tuning key) and holding
  the device's benchmark slot, while other threads needing that key wait for it. The
  state the unpatched code keeps on the instance between statements (`nargs`,
  `restore_copies`, `configs_timings`, `bench_time`) becomes per thread, so hooks
  (`reset_to_zero`, `restore_value`, `Config.pre_hook`, `post_hook`) see only the
  calling thread's tensors and the disk cache gets the timings of the key it names.
  See Note [Per-thread autotuner state].
- A key's configs compile in parallel before its first benchmark (Note [Compiling
  configs in parallel]).
- JIT compiles (`JITFunction._do_compile`, Triton 3.5+) are single-flight per
  (kernel, device, specialization), and a compiled kernel is loaded onto its device
  once (`CompiledKernel._init_handles`), so two lanes on one GPU never race there.
- Under `TRITON_INTERPRET=1` interpreted launches are serialized: the interpreter keeps
  its launch state (grid position, patched `triton.language`) in globals.
- Lane threads get the process's Triton allocator (`triton.set_allocator` is per thread).
- flash-linear-attention's `tensor_cache` iterates over a snapshot of its deque, and the
  first calls of a `torch.compile`d module on a device go through the queue one at a
  time, as soon as those packages are imported.

Warm start: autotune results persist across processes when Triton caches them
(`TRITON_CACHE_AUTOTUNING=1`, or `cache_results=True` in `triton.autotune`) and
flash-linear-attention does (`FLA_CACHE_RESULTS=1`, its default); with a persistent
`TRITON_CACHE_DIR` the second start of a script compiles and benchmarks nothing.
`Dispatcher.warmup` tunes everything a step needs in one pass over the lanes.
"""

from __future__ import annotations

import collections
import contextvars
import functools
import hashlib
import importlib.abc
import inspect
import os
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from . import compile_queue
from ._lane_runtime import register_thread_hook
from ._version import __version__
from .errors import UnsupportedTritonError

# Triton releases whose internals were read when this guard was written. Others are
# accepted when the same internals are found (checked at install), refused otherwise.
CHECKED_TRITON_VERSIONS = ("3.3.1", "3.4.0", "3.5.1", "3.6.0", "3.9.0")

_MISSING = object()


def guard_triton(*, missing_ok: bool = False) -> TritonGuard | None:
    """Installs the guard (once per process) and returns a handle whose `uninstall()`
    drops this caller's hold on it; the guard comes off with the last handle, or with
    `unguard_triton()`. Without Triton: None when `missing_ok`, else ImportError.
    Raises UnsupportedTritonError when Triton's internals are not the ones it knows."""
    global _installation, _holders
    with _install_lock:
        if _installation is None:
            try:
                import triton
            except ImportError as exc:
                if missing_ok:
                    return None
                raise ImportError(
                    "guard_triton() needs Triton, which is not importable here; pass "
                    "missing_ok=True to skip the guard when Triton is absent"
                ) from exc
            _installation = _Installation.install(triton)
        _holders += 1
        return TritonGuard(_installation)


def unguard_triton() -> None:
    """Removes the guard now, whatever handles are still held."""
    global _installation, _holders
    with _install_lock:
        if _installation is not None:
            _installation.uninstall()
        _installation = None
        _holders = 0


def is_guarded() -> bool:
    return _installation is not None


class TritonGuard:
    """A hold on the installed guard (see `guard_triton`)."""

    def __init__(self, installation: _Installation) -> None:
        self._installation: _Installation | None = installation

    @property
    def active(self) -> bool:
        return self._installation is not None and self._installation is _installation

    @property
    def features(self) -> dict[str, bool]:
        """What this Triton allowed: autotuner, jit_single_flight, kernel_load,
        interpreter, allocator (and, once imported, fla_tensor_cache, torch_compile)."""
        return dict(self._installation.features) if self._installation else {}

    def uninstall(self) -> None:
        """Drops this hold; idempotent. The guard comes off when no hold is left."""
        global _installation, _holders
        with _install_lock:
            mine, self._installation = self._installation, None
            if mine is None or mine is not _installation:
                return
            _holders -= 1
            if _holders == 0:
                _installation.uninstall()
                _installation = None

    def __enter__(self) -> TritonGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def __repr__(self) -> str:
        return f"<pydflash.TritonGuard {'active' if self.active else 'released'}>"


_install_lock = threading.Lock()
_installation: _Installation | None = None
_holders = 0


# --- checking the internals -----------------------------------------------------------


def _squash(text: str) -> str:
    return "".join(text.split())


def _source(obj: Any) -> str | None:
    try:
        return _squash(inspect.getsource(obj))
    except (OSError, TypeError):
        return None


class _Checker:
    """Collects every internal that is missing, so one error lists them all."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def source_has(self, what: str, obj: Any, snippets: tuple[str, ...]) -> bool:
        source = _source(obj)
        if source is None:
            self.problems.append(f"{what}: source not available")
            return False
        missing = [s for s in snippets if _squash(s) not in source]
        for s in missing:
            self.problems.append(f"{what} no longer contains `{s}`")
        return not missing

    def has_attr(self, what: str, owner: Any, name: str) -> bool:
        if getattr(owner, name, _MISSING) is _MISSING:
            self.problems.append(f"{what} has no `{name}`")
            return False
        return True


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
_PER_THREAD_ATTRIBUTES = ("nargs", "restore_copies", "configs_timings", "bench_time")


# --- Note [Per-thread autotuner state] -------------------------------------------------
# Triton's Autotuner passes a call's state between its methods through the instance:
# run() sets self.nargs and _bench()/prune_configs()/the hooks read it; the default
# pre/post hooks keep restore copies in self.restore_copies; benchmark() leaves
# self.configs_timings for check_disk_cache() to write. With threads those are shared.
# _PerThread makes each of these attributes a data descriptor on the class, so the
# unpatched methods (which the miss path still runs) read and write a per-thread
# value; the hit path never touches them. Values set before the guard stay readable as
# the fallback.
class _PerThread:
    def __init__(self, name: str, default: Callable[[], Any] | None) -> None:
        self.name = name
        self.default = default

    @staticmethod
    def _local(obj: Any) -> threading.local:
        local = obj.__dict__.get("_pydflash_local")
        if local is None:
            local = obj.__dict__.setdefault("_pydflash_local", threading.local())
        return local

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = self._local(obj).__dict__.get(self.name, _MISSING)
        if value is _MISSING:
            value = obj.__dict__.get(self.name, _MISSING)
        if value is _MISSING:
            if self.default is None:
                raise AttributeError(
                    f"{type(obj).__name__!r} object has no attribute {self.name!r}"
                )
            value = self.default()
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        self._local(obj).__dict__[self.name] = value

    def __delete__(self, obj: Any) -> None:
        self._local(obj).__dict__.pop(self.name, None)


_PER_THREAD_DEFAULTS: dict[str, Callable[[], Any] | None] = {
    "nargs": lambda: None,
    "restore_copies": dict,
    "configs_timings": None,
    "bench_time": None,
}


# --- the installation -----------------------------------------------------------------


@dataclass
class _Patch:
    owner: Any
    name: str
    value: Any
    original: Any = _MISSING  # what owner.__dict__ held before

    def apply(self) -> None:
        self.original = vars(self.owner).get(self.name, _MISSING)
        setattr(self.owner, self.name, self.value)

    def undo(self) -> None:
        if vars(self.owner).get(self.name, _MISSING) is not self.value:
            return  # replaced again since; leave the newer value alone
        if self.original is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)


@dataclass
class _Installation:
    triton: Any
    patches: list[_Patch] = field(default_factory=list)
    features: dict[str, bool] = field(default_factory=dict)
    allocator: Any = None  # the process-wide allocator lanes use
    swapped_caches: list[Any] = field(default_factory=list)  # closure cells of tensor_cache

    @classmethod
    def install(cls, triton: Any) -> _Installation:
        self = cls(triton)
        check = _Checker()
        plans = [
            self._plan_autotuner(check),
            self._plan_jit(check),
            self._plan_kernel_load(check),
            self._plan_interpreter(check),
            self._plan_allocator(check),
        ]
        if check.problems:
            raise UnsupportedTritonError(
                f"pydflash {__version__} cannot guard Triton {getattr(triton, '__version__', '?')}"
                f" (read for {', '.join(CHECKED_TRITON_VERSIONS)}): "
                + "; ".join(check.problems)
                + ". Without the guard, autotuning from several threads is unsafe; pass "
                "Dispatcher(guard_triton=False) to run without it."
            )
        for plan in plans:
            plan()
        for patch in self.patches:
            patch.apply()
        _when_imported(_FLA_MODULES, self._guard_fla)
        _when_imported(("torch._dynamo.eval_frame",), self._guard_torch_compile)
        register_thread_hook(_lane_thread_setup)
        return self

    def uninstall(self) -> None:
        _forget_import_hooks()
        for patch in reversed(self.patches):
            patch.undo()
        for mod in _fla_modules():  # names imported from a patched module
            for name, value in list(vars(mod).items()):
                original = getattr(value, "_pydflash_original", None)
                if original is not None:
                    setattr(mod, name, original)
        for cell in self.swapped_caches:
            cached = cell.cell_contents
            cell.cell_contents = collections.deque(cached, maxlen=cached.maxlen)
        self.patches.clear()
        self.swapped_caches.clear()

    # Each _plan_* checks what it relies on and returns what to do once all checks pass.

    def _plan_autotuner(self, check: _Checker) -> Callable[[], None]:
        from triton.runtime.autotuner import Autotuner

        ok = check.source_has(
            "triton.runtime.autotuner.Autotuner.run", Autotuner.run, _RUN_HOT_PATH
        )
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
        for name in _PER_THREAD_ATTRIBUTES:
            if name in vars(Autotuner):
                check.problems.append(f"Autotuner already defines a class attribute `{name}`")
                ok = False

        def plan() -> None:
            original_run = Autotuner.run
            self.patches.append(_Patch(Autotuner, "run", _make_guarded_run(original_run)))
            self.patches.append(
                _Patch(Autotuner, "_bench", _make_precompiling_bench(Autotuner._bench))
            )
            for name in _PER_THREAD_ATTRIBUTES:
                self.patches.append(
                    _Patch(Autotuner, name, _PerThread(name, _PER_THREAD_DEFAULTS[name]))
                )
            self.features["autotuner"] = True

        return plan if ok else _nothing

    def _plan_jit(self, check: _Checker) -> Callable[[], None]:
        from triton.runtime.jit import JITFunction

        do_compile = getattr(JITFunction, "_do_compile", None)
        if do_compile is None:
            # Triton 3.3/3.4 compile inside JITFunction.run: duplicated compiles there only
            # waste work (the kernel load, which can race, is guarded below).
            check.source_has(
                "triton.runtime.jit.JITFunction.run",
                JITFunction.run,
                ("kernel = kernel_cache.get(key, None)", "kernel_cache[key] = kernel"),
            )
            self.features["jit_single_flight"] = False
            return _nothing
        params = list(inspect.signature(do_compile).parameters)
        ok = params[:4] == ["self", "key", "signature", "device"]
        if not ok:
            check.problems.append(
                f"JITFunction._do_compile takes {params}, "
                "expected (self, key, signature, device, ...)"
            )
        ok &= check.source_has(
            "triton.runtime.jit.JITFunction.run",
            JITFunction.run,
            ("kernel = kernel_cache.get(key, None)", "self._do_compile(key, signature, device,"),
        )
        ok &= check.source_has(
            "triton.runtime.jit.JITFunction._do_compile",
            do_compile,
            ("kernel_cache, _, target, backend, _ = self.device_caches[device]",),
        )

        def plan() -> None:
            self.patches.append(
                _Patch(JITFunction, "_do_compile", _make_single_flight_compile(do_compile))
            )
            self.features["jit_single_flight"] = True

        return plan if ok else _nothing

    def _plan_kernel_load(self, check: _Checker) -> Callable[[], None]:
        from triton.compiler.compiler import CompiledKernel

        ok = check.source_has(
            "triton.compiler.compiler.CompiledKernel._init_handles",
            CompiledKernel._init_handles,
            ("if self.module is not None: return", "self.module, self.function,"),
        )
        run = vars(CompiledKernel).get("run")
        if isinstance(run, property):  # Triton 3.5+: `_run` is set before the module loads
            ok &= check.source_has(
                "triton.compiler.compiler.CompiledKernel.run",
                run.fget,
                ("if self._run is None:", "self._init_handles()", "return self._run"),
            )
        else:  # Triton 3.3/3.4: every `.run` lookup loads the handles first
            ok &= check.source_has(
                "triton.compiler.compiler.CompiledKernel.__getattribute__",
                CompiledKernel.__getattribute__,
                ("if name == 'run':", "self._init_handles()"),
            )

        def plan() -> None:
            original = CompiledKernel._init_handles
            self.patches.append(
                _Patch(CompiledKernel, "_init_handles", _make_single_flight_load(original))
            )
            if isinstance(run, property):
                self.patches.append(_Patch(CompiledKernel, "run", property(_loaded_run)))
            self.features["kernel_load"] = True

        return plan if ok else _nothing

    def _plan_interpreter(self, check: _Checker) -> Callable[[], None]:
        from triton.runtime import interpreter

        executor = getattr(interpreter, "GridExecutor", None)
        if not check.has_attr("triton.runtime.interpreter", interpreter, "GridExecutor"):
            return _nothing
        if "__call__" not in vars(executor):
            check.problems.append("triton.runtime.interpreter.GridExecutor defines no __call__")
            return _nothing
        original = executor.__call__

        def plan() -> None:
            # Every interpreted launch, whichever way it was made, runs a GridExecutor.
            self.patches.append(_Patch(executor, "__call__", _make_serialized(original)))
            self.features["interpreter"] = True

        return plan

    def _plan_allocator(self, check: _Checker) -> Callable[[], None]:
        try:
            from triton.runtime import _allocation
        except ImportError:  # older than per-thread allocators: nothing to carry
            self.features["allocator"] = False
            return _nothing
        ok = check.has_attr("triton.runtime._allocation", _allocation, "_allocator")
        if ok and not isinstance(_allocation._allocator, contextvars.ContextVar):
            self.features["allocator"] = False  # one per process already (Triton < 3.5)
            return _nothing
        ok &= check.has_attr("triton.runtime._allocation", _allocation, "set_allocator")
        ok &= check.has_attr("triton.runtime._allocation", _allocation, "NullAllocator")

        def plan() -> None:
            original = _allocation.set_allocator
            current = _allocation._allocator.get()
            if not isinstance(current, (_allocation.NullAllocator, _ProcessAllocator)):
                self.allocator = current  # set on this thread before the guard

            def set_allocator(allocator: Any) -> None:
                self.allocator = allocator
                original(allocator)

            functools.update_wrapper(set_allocator, original)
            self.patches.append(_Patch(_allocation, "set_allocator", set_allocator))
            if getattr(self.triton, "set_allocator", None) is original:
                self.patches.append(_Patch(self.triton, "set_allocator", set_allocator))
            self.features["allocator"] = True

        return plan if ok else _nothing

    # --- packages that may come later -------------------------------------------------

    def _guard_fla(self, module: Any) -> None:
        original = getattr(module, "tensor_cache", None)
        if not callable(original) or getattr(original, "_pydflash_original", None) is not None:
            return
        probe = original(lambda: None)
        if _tensor_cache_cell(probe) is None:
            warnings.warn(
                "pydflash cannot make flash-linear-attention's tensor_cache thread-safe: its "
                "wrapper keeps no deque; calls from several lanes may fail",
                RuntimeWarning,
                stacklevel=2,
            )
            self.features["fla_tensor_cache"] = False
            return

        @functools.wraps(original)
        def tensor_cache(fn: Callable[..., Any]) -> Callable[..., Any]:
            wrapper = original(fn)
            if _installation is self:
                self._swap_cache(wrapper)
            return wrapper

        tensor_cache._pydflash_original = original  # type: ignore[attr-defined]
        self.patches.append(_Patch(module, "tensor_cache", tensor_cache))
        self.patches[-1].apply()
        # Functions decorated before the guard, wherever fla put them.
        for mod in _fla_modules():
            if getattr(mod, "tensor_cache", None) is original and mod is not module:
                self.patches.append(_Patch(mod, "tensor_cache", tensor_cache))
                self.patches[-1].apply()
            for value in list(vars(mod).values()):
                for _ in range(4):  # through a few stacked decorators
                    if getattr(value, "__code__", None) is probe.__code__:
                        self._swap_cache(value)
                        break
                    value = getattr(value, "__wrapped__", None)
                    if value is None:
                        break
        self.features["fla_tensor_cache"] = True

    def _swap_cache(self, wrapper: Any) -> None:
        cell = _tensor_cache_cell(wrapper)
        if cell is not None and type(cell.cell_contents) is collections.deque:
            cached = cell.cell_contents
            cell.cell_contents = _SnapshotDeque(cached, maxlen=cached.maxlen)
            self.swapped_caches.append(cell)

    def _guard_torch_compile(self, module: Any) -> None:
        optimized = getattr(module, "OptimizedModule", None)
        call = vars(optimized).get("__call__") if optimized is not None else None
        if call is None:
            self.features["torch_compile"] = False
            return
        self.patches.append(_Patch(optimized, "__call__", _make_first_calls_queued(call)))
        self.patches[-1].apply()
        self.features["torch_compile"] = True


def _nothing() -> None:
    pass


# --- the autotuner ----------------------------------------------------------------------


def _make_guarded_run(original_run: Callable[..., Any]) -> Callable[..., Any]:
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        # The statements of Autotuner.run's hit path (_RUN_HOT_PATH), arguments in locals.
        if len(self.configs) > 1:
            arg_names = self.arg_names
            all_args = {**dict(zip(arg_names, args)), **kwargs}
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
            config.pre_hook({**dict(zip(self.arg_names, args)), **kwargs, **config.all_kwargs()})
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


def _interpreting() -> bool:
    knobs = getattr(sys.modules.get("triton"), "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _benchmark_slot() -> str:
    """One autotune benchmark per device at a time; the interpreter is one device."""
    if _interpreting():
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
        try:
            autotuner.fn.run(*args, grid=(1, 1, 1), warmup=True, **options, **config.all_kwargs())
        except Exception:  # noqa: BLE001 - the benchmark meets it again, see the Note
            pass

    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(
        max_workers=min(threads, len(configs)), thread_name_prefix="pydflash-precompile"
    ) as pool:
        list(pool.map(compile_config, configs))


def _set_thread_device(device: int) -> None:
    from triton.runtime.driver import driver

    driver.active.set_current_device(device)


# --- compiles and kernel loads ----------------------------------------------------------


def _make_single_flight_compile(original: Callable[..., Any]) -> Callable[..., Any]:
    def _do_compile(self: Any, key: Any, signature: Any, device: int, *rest: Any, **kw: Any) -> Any:
        kernel_cache = self.device_caches[device][0]
        me = threading.get_ident()

        def work() -> tuple:
            kernel = kernel_cache.get(key)  # compiled while this call waited for its turn
            if kernel is None:
                kernel = original(self, key, signature, device, *rest, **kw)
            return me, kernel

        digest = hashlib.blake2b(str(key).encode(), digest_size=8).hexdigest()
        name = getattr(self, "__name__", None) or getattr(self.fn, "__name__", "kernel")
        holder, kernel = compile_queue.run(f"jit:{name}@{id(self):x}[{device}]:{digest}", work)
        if kernel is None and holder != me:
            # A hook told the holder to skip the compile; this caller decides for itself.
            kernel = original(self, key, signature, device, *rest, **kw)
        return kernel

    functools.update_wrapper(_do_compile, original)
    return _do_compile


def _make_single_flight_load(original: Callable[[Any], None]) -> Callable[[Any], None]:
    def _init_handles(self: Any) -> None:
        if self.module is not None:
            return

        def work() -> None:
            if self.module is None:
                original(self)

        compile_queue.run(f"load:{getattr(self, 'name', 'kernel')}@{id(self):x}", work)

    functools.update_wrapper(_init_handles, original)
    return _init_handles


def _loaded_run(self: Any) -> Any:
    # Triton 3.5+ sets `_run` before it loads the module: wait for the whole load.
    if self.module is None:
        self._init_handles()
    return self._run


_interpreter_lock = threading.RLock()


def _make_serialized(original: Callable[..., Any]) -> Callable[..., Any]:
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _interpreter_lock:
            return original(self, *args, **kwargs)

    functools.update_wrapper(run, original)
    return run


# --- lane threads -----------------------------------------------------------------------


class _ProcessAllocator:
    """Lane threads' Triton allocator: whatever was last set with triton.set_allocator,
    on any thread (Triton keeps one per thread)."""

    def __call__(self, size: int, alignment: int, stream: Any) -> Any:
        installation = _installation
        allocator = installation.allocator if installation is not None else None
        if allocator is None:
            from triton.runtime._allocation import NullAllocator

            allocator = NullAllocator()
        return allocator(size, alignment, stream)


def _lane_thread_setup(device: int) -> None:
    installation = _installation
    if installation is None or not installation.features.get("allocator"):
        return
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        _allocation._allocator.set(_ProcessAllocator())


# --- flash-linear-attention's tensor_cache ----------------------------------------------

_FLA_MODULES = ("fla.utils.decorators", "fla.utils._decorators", "fla.utils")


class _SnapshotDeque:
    """A bounded deque whose iteration walks a copy. The copy is one C call (tuple() of a
    plain deque), so no other thread runs during it: an append from another thread
    cannot break a loop over the cache ('deque mutated during iteration')."""

    __slots__ = ("_items",)

    def __init__(self, items: Any = (), maxlen: int | None = None) -> None:
        self._items = collections.deque(items, maxlen)

    def __iter__(self) -> Any:
        return iter(tuple(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def append(self, item: Any) -> None:
        self._items.append(item)

    @property
    def maxlen(self) -> int | None:
        return self._items.maxlen

    def __getattr__(self, name: str) -> Any:
        return getattr(self._items, name)


def _fla_modules() -> list[Any]:
    return [
        mod
        for name, mod in list(sys.modules.items())
        if mod is not None and (name == "fla" or name.startswith("fla."))
    ]


def _tensor_cache_cell(wrapper: Any) -> Any:
    code = getattr(wrapper, "__code__", None)
    closure = getattr(wrapper, "__closure__", None) or ()
    if code is None:
        return None
    for name, cell in zip(code.co_freevars, closure):
        try:
            contents = cell.cell_contents
        except ValueError:
            continue
        if isinstance(contents, (collections.deque, _SnapshotDeque)):
            return cell
    return None


# --- torch.compile --------------------------------------------------------------------


def _make_first_calls_queued(original: Callable[..., Any]) -> Callable[..., Any]:
    # Dynamo and Inductor are not thread-safe while they compile: a module's first call
    # on each device runs alone (the module is the slot); later calls go straight through.
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        device = _torch_device()
        warm = self.__dict__.get("_pydflash_warm_devices")
        if warm is not None and device in warm:
            return original(self, *args, **kwargs)

        def work() -> Any:
            result = original(self, *args, **kwargs)
            self.__dict__.setdefault("_pydflash_warm_devices", set()).add(device)
            return result

        name = type(getattr(self, "_orig_mod", self)).__name__
        key = f"torch.compile:{name}@{id(self):x}[{device}]:{threading.get_ident()}"
        return compile_queue.run(key, work, slot=f"torch.compile:{id(self):x}")

    functools.update_wrapper(__call__, original)
    return __call__


def _torch_device() -> int:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return -1


# --- running code when a module is imported ---------------------------------------------


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs callbacks right after the named modules execute."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable[[Any], None]]] = {}

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        callbacks = self.callbacks.get(name)
        if not callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _CallbackLoader(spec.loader, list(callbacks))
        return spec


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, callbacks: list[Callable[[Any], None]]) -> None:
        self._loader = loader
        self._callbacks = callbacks

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        for callback in self._callbacks:
            callback(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


_after_import = _AfterImport()


def _when_imported(names: tuple[str, ...], callback: Callable[[Any], None]) -> None:
    """callback(module) for each of `names`: now if imported, else right after import."""
    for name in names:
        module = sys.modules.get(name)
        if module is not None:
            callback(module)
        else:
            _after_import.callbacks.setdefault(name, []).append(callback)
    if _after_import not in sys.meta_path:
        sys.meta_path.insert(0, _after_import)


def _forget_import_hooks() -> None:
    _after_import.callbacks.clear()
    if _after_import in sys.meta_path:
        sys.meta_path.remove(_after_import)
