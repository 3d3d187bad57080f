"""JIT compiles and kernel loads: a compile (`JITFunction._do_compile`, Triton 3.5+) is
single-flight per (kernel, device, specialization), and a compiled kernel is loaded onto
its device once (`CompiledKernel._init_handles`), so two lanes on one GPU never race
there. Compiles on different devices, or of different kernels, go on in parallel."""

from __future__ import annotations

import functools
import hashlib
import inspect
import threading
from collections.abc import Callable
from typing import Any

from .. import compile_queue
from .checks import Checker
from .patching import Change, Patch


def plan_compile(check: Checker) -> list[Change]:
    from triton.runtime.jit import JITFunction

    do_compile = getattr(JITFunction, "_do_compile", None)
    if do_compile is None:
        # Triton 3.3/3.4 compile inside JITFunction.run: duplicated compiles there only
        # waste work (the kernel load, which can race, is guarded by plan_load).
        check.source_has(
            "triton.runtime.jit.JITFunction.run",
            JITFunction.run,
            ("kernel = kernel_cache.get(key, None)", "kernel_cache[key] = kernel"),
        )
        return []
    params = list(inspect.signature(do_compile).parameters)
    ok = params[:4] == ["self", "key", "signature", "device"]
    if not ok:
        check.problems.append(
            f"JITFunction._do_compile takes {params}, expected (self, key, signature, device, ...)"
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
    if not ok:
        return []
    return [Patch(JITFunction, "_do_compile", _make_single_flight_compile(do_compile))]


def plan_load(check: Checker) -> list[Change]:
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
    if not ok:
        return []
    load = _make_single_flight_load(CompiledKernel._init_handles)
    patches: list[Change] = [Patch(CompiledKernel, "_init_handles", load)]
    if isinstance(run, property):
        patches.append(Patch(CompiledKernel, "run", property(_loaded_run)))
    return patches


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
