"""The 'triton' guard (pydflash/guards/): installing it, its drift checks, and each part
it patches (autotuner.py, jit.py, interpreter.py, allocator.py).

The races are reproduced with real Triton in interpreter mode (TRITON_INTERPRET=1, CPU),
which must be set before triton is imported: those cases run this file as a script in a
subprocess (`python tests/test_guards_triton.py <case> guarded|bare`) that prints one JSON
line. The interleavings are forced (a CPU do_bench that waits for another thread's call),
so the unguarded runs fail every time, not by luck. The rest runs in-process.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import ClassVar

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # as the subprocess: the tree's pydflash, not an installed one
    sys.path.insert(0, str(ROOT))

import polling_helpers  # noqa: E402
import pytest  # noqa: E402

triton = pytest.importorskip("triton") if __name__ != "__main__" else None


# Waits here can sit behind Triton work on a loaded machine: a 20 s bound.
eventually = functools.partial(polling_helpers.eventually, within_s=20.0)


# ======================================================================================
# In-process: installing, checking, and the parts that need no kernel launch.
# ======================================================================================


def waiting_on(prefix: str) -> int:
    from pydflash import compile_queue

    return sum(f["waiters"] for f in compile_queue.in_flight() if f["key"].startswith(prefix))


def triton_layout() -> dict[str, bool]:
    """What differs between the Triton versions the guard supports."""
    import contextvars

    from triton.compiler.compiler import CompiledKernel
    from triton.runtime import _allocation
    from triton.runtime.jit import JITFunction

    return {
        "jit_single_flight": hasattr(JITFunction, "_do_compile"),  # 3.5+
        "run_property": isinstance(vars(CompiledKernel).get("run"), property),  # 3.5+
        "allocator": isinstance(_allocation._allocator, contextvars.ContextVar),  # per thread
    }


LAYOUT = triton_layout() if triton is not None else {}


def patched_attributes():
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime import _allocation
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.interpreter import GridExecutor
    from triton.runtime.jit import JITFunction

    names = [
        (Autotuner, "run"),
        (Autotuner, "_bench"),
        (Autotuner, "nargs"),
        (Autotuner, "restore_copies"),
        (Autotuner, "configs_timings"),
        (Autotuner, "bench_time"),
        (CompiledKernel, "_init_handles"),
        (GridExecutor, "__call__"),
    ]
    if LAYOUT["jit_single_flight"]:
        names.append((JITFunction, "_do_compile"))
    if LAYOUT["run_property"]:
        names.append((CompiledKernel, "run"))
    if LAYOUT["allocator"]:
        names += [(_allocation, "set_allocator"), (triton, "set_allocator")]
    return {(owner.__name__, name): vars(owner).get(name) for owner, name in names}


def test_the_guard_is_idempotent_and_reversible(guard_module):
    before = patched_attributes()
    first = guard_module.install_guards()
    second = guard_module.install_guards()
    during = patched_attributes()
    assert all(during[k] is not before[k] for k in before), [
        k for k in before if during[k] is before[k]
    ]
    # fla_tensor_cache and torch_compile join once those packages are imported, which
    # other tests may have done already.
    base = {
        k: v for k, v in first.features.items() if k not in ("fla_tensor_cache", "torch_compile")
    }
    assert base == {
        "autotuner": True,
        "jit_single_flight": LAYOUT["jit_single_flight"],
        "kernel_load": True,
        "interpreter": True,
        "allocator": LAYOUT["allocator"],
    }
    assert patched_attributes() == during  # the second call patched nothing again
    first.uninstall()
    first.uninstall()  # a handle lets go once
    assert guard_module.is_guarded() and second.active and not first.active
    second.uninstall()
    assert not guard_module.is_guarded()
    assert patched_attributes() == before
    with guard_module.install_guards() as third:
        assert third.active
    assert patched_attributes() == before
    guard_module.install_guards()
    guard_module.remove_guards()  # whatever handles remain
    assert patched_attributes() == before


def test_unknown_internals_are_refused_naming_versions(guard_module, monkeypatch):
    from triton.runtime.autotuner import Autotuner

    from pydflash import UnsupportedTritonError, __version__

    def run(self, *args, **kwargs):  # a layout the guard does not know
        return self.fn.run(*args, **kwargs)

    monkeypatch.setattr(Autotuner, "run", run)
    before = patched_attributes()
    with pytest.raises(UnsupportedTritonError) as info:
        guard_module.install_guards()
    message = str(info.value)
    assert f"pydflash {__version__} cannot guard Triton {triton.__version__}" in message
    assert (
        "Autotuner.run no longer contains `self.nargs = dict(zip(self.arg_names, args))`" in message
    )
    assert "Dispatcher(guard=())" in message
    assert not guard_module.is_guarded()
    assert patched_attributes() == before  # nothing half-installed


def test_autotuner_call_state_is_per_thread(guard_module):
    import triton.language as tl
    from triton.runtime.autotuner import Autotuner, Config

    @triton.jit
    def kernel(x_ptr, n, BLOCK: tl.constexpr):
        pass

    tuner = Autotuner(
        kernel,
        kernel.arg_names,
        [Config({"BLOCK": 16}), Config({"BLOCK": 32})],
        ["n"],
        None,
        ["x_ptr"],
        do_bench=lambda call, quantiles: [1.0, 1.0, 1.0],  # Triton 3.3 asks a driver otherwise
    )
    tuner.nargs = {"n": "before the guard"}
    mixed = []
    with guard_module.install_guards():
        assert tuner.nargs == {"n": "before the guard"}  # still readable
        barrier = threading.Barrier(4)

        def body(i: int) -> None:
            barrier.wait()
            for j in range(5000):
                mine = {"n": (i, j)}
                tuner.nargs = mine
                tuner.restore_copies = mine
                tuner.configs_timings = mine
                if not (
                    tuner.nargs is mine
                    and tuner.restore_copies is mine
                    and tuner.configs_timings is mine
                ):
                    mixed.append((i, j))

        threads = [threading.Thread(target=body, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        fresh = []
        t = threading.Thread(target=lambda: fresh.append((tuner.restore_copies, tuner.nargs)))
        t.start()
        t.join()
    assert mixed == []
    assert fresh == [({}, {"n": "before the guard"})]
    assert tuner.nargs == {"n": "before the guard"}  # the instance's own value again


@pytest.mark.skipif(
    not LAYOUT.get("jit_single_flight"), reason="Triton < 3.5 compiles inside JITFunction.run"
)
def test_jit_compiles_are_single_flight_per_kernel_device_and_key(guard_module, monkeypatch):
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    compiles: list = []
    kernels: dict = {}

    def _do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        # The guard checks that _do_compile's source holds this very statement.
        kernel_cache, _, target, backend, _ = self.device_caches[device]  # noqa: RUF059
        compiles.append(device)
        # Hold until the other callers wait for this (device, key), and until the other
        # device's compile runs too: devices do not wait for each other.
        eventually(
            lambda: waiting_on("jit:") >= 3 * len(kernels) or len(compiles) == 2, "callers waiting"
        )
        eventually(lambda: len(compiles) == 2, "both devices compiling at once")
        kernel = kernels.setdefault(device, object())
        kernel_cache[key] = kernel
        return kernel

    monkeypatch.setattr(JITFunction, "_do_compile", _do_compile)
    guard_module.install_guards()

    @triton.jit
    def kernel(x_ptr, BLOCK: tl.constexpr):
        pass

    for device in (0, 1):  # skip the binder, which needs a GPU driver
        kernel.device_caches[device] = ({}, {}, None, None, None)
    barrier = threading.Barrier(8)
    got: list = [None] * 8

    def body(i: int) -> None:
        barrier.wait()
        got[i] = (i % 2, kernel._do_compile("key", {}, i % 2, {}, None, {}, False))

    threads = [threading.Thread(target=body, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(compiles) == [0, 1]
    assert all(k is kernels[device] for device, k in got)


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "bare"])
def test_a_kernel_is_never_seen_half_loaded(guard_module, monkeypatch, guarded):
    """Triton 3.5+ sets CompiledKernel._run before it loads the module: a second thread
    launching the same kernel then passes `function=None`. Triton 3.3/3.4 load it in
    both threads. Guarded, the second thread waits for the one load."""
    from triton.compiler.compiler import CompiledKernel

    loads: list = []
    half_loaded = threading.Event()
    reader_done = threading.Event()

    def _init_handles(self):
        if self.module is not None:
            return
        if LAYOUT["run_property"]:
            self._run = "launcher"
        else:
            self.run = "launcher"
        loads.append(threading.current_thread().name)
        half_loaded.set()
        eventually(
            lambda: reader_done.is_set() or waiting_on("load:") == 1 or len(loads) == 2,
            "the reader went ahead",
        )
        self.module, self.function, self.n_regs, self.n_spills, self.n_max_threads = (
            "module",
            "fn",
            0,
            0,
            0,
        )

    monkeypatch.setattr(CompiledKernel, "_init_handles", _init_handles)
    if guarded:
        guard_module.install_guards()
    kernel = CompiledKernel.__new__(CompiledKernel)
    kernel.name, kernel.module, kernel.function, kernel._run = "fake", None, None, None
    kernel._module_pid = None  # so that __del__ unloads nothing
    seen = []

    def reader():
        half_loaded.wait()
        seen.append((kernel.run, kernel.function))  # what JITFunction.run passes to a launch
        reader_done.set()

    threads = [
        threading.Thread(target=lambda: kernel.run, name="loader"),
        threading.Thread(target=reader),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if guarded:
        assert loads == ["loader"] and seen == [("launcher", "fn")]
    elif LAYOUT["run_property"]:
        assert seen == [("launcher", None)]  # a launch with no function
    else:
        assert len(loads) == 2  # loaded twice


@pytest.mark.parametrize("threads", ["4", "0"])
def test_a_cold_keys_configs_compile_in_parallel_before_its_first_benchmark(
    guard_module, monkeypatch, threads
):
    from triton.runtime.autotuner import Autotuner, Config

    events: list = []

    def kernel(x, n, BLOCK):
        pass

    class Kernel:  # stands for the JITFunction under the autotuner
        arg_names: ClassVar[list[str]] = ["x", "n"]
        fn = staticmethod(kernel)

        def run(self, *args, grid, warmup, **kwargs):
            events.append((warmup, kwargs["BLOCK"], threading.current_thread().name))
            if warmup and kwargs["BLOCK"] == 64:
                raise RuntimeError("does not compile")  # left for the benchmark to meet

    from pydflash.guards import autotuner

    monkeypatch.setattr(autotuner, "_benchmark_slot", lambda: "cuda:0")  # no GPU here
    monkeypatch.setattr(autotuner, "_set_thread_device", lambda device: None)
    monkeypatch.setenv("PYDFLASH_PRECOMPILE_THREADS", threads)
    guard_module.install_guards()
    tuner = Autotuner(
        Kernel(),
        Kernel.arg_names,
        [Config({"BLOCK": b}) for b in (16, 32, 64)],
        ["n"],
        None,
        None,
        do_bench=lambda call, quantiles: (call(), [float(len(events))] * 3)[1],
    )
    tuner[(1,)]("x", 100)
    tuner[(1,)]("x", 100)  # a hit: nothing compiles
    compiled = [e for e in events if e[0]]
    launched = [e for e in events if not e[0]]
    if threads == "0":
        assert compiled == []
    else:
        assert sorted(block for _, block, _ in compiled) == [16, 32, 64]
        assert all(name.startswith("pydflash-precompile") for _, _, name in compiled)
        assert events[: len(compiled)] == compiled  # all before the first benchmark
    assert [block for _, block, _ in launched] == [16, 32, 64, 16, 16]  # 3 benchmarks, 2 calls


@pytest.mark.skipif(
    not LAYOUT.get("allocator"), reason="Triton < 3.5 has one allocator per process"
)
def test_lane_threads_use_the_process_allocator(guard_module):
    pytest.importorskip("torch")
    from triton.runtime import _allocation

    from pydflash import Dispatcher

    def allocator(size, alignment, stream):
        return ("buffer", size, threading.current_thread().name != "MainThread")

    def allocate():
        return _allocation._allocator.get()(64, 16, None)

    original = _allocation._allocator.get()
    bare = Dispatcher(["cpu"], guard=())
    try:
        triton.set_allocator(allocator)
        with pytest.raises(RuntimeError, match="no allocator was set"):
            bare.submit(allocate).result()  # Triton's allocator is per thread
    finally:
        bare.shutdown()
        _allocation._allocator.set(original)
    guard = guard_module.install_guards()
    lanes = Dispatcher(["cpu"] * 2, guard=())
    try:
        triton.set_allocator(allocator)  # after the lanes started, on this thread
        assert [lane.submit(allocate).result() for lane in lanes.lanes] == [
            ("buffer", 64, True)
        ] * 2
    finally:
        lanes.shutdown()
        guard.uninstall()
        _allocation._allocator.set(original)


# ======================================================================================
# Subprocess cases: real Triton, interpreted on the CPU.
# ======================================================================================


def run_case(case: str, guarded: bool) -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, __file__, case, "guarded" if guarded else "bare"],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"case {case} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1])


def test_forced_interleaving_crashes_bare_triton():
    """Thread 2 runs a tuned key while thread 1 benchmarks: bare Triton clears the shared
    self.nargs under thread 1 (FACTS: the TypeError seen on the H200)."""
    result = run_case("crash", guarded=False)
    assert any("'NoneType' object is not a mapping" in e for e in result["errors"]), result


def test_forced_interleaving_is_safe_guarded():
    result = run_case("crash", guarded=True)
    assert result["errors"] == []
    assert result["wrong"] == []


def test_hooks_act_on_another_threads_tensors_in_bare_triton():
    """Thread 2 stops inside its call (in a Config.pre_hook) while thread 1 benchmarks:
    thread 1's hooks get thread 2's tensors, thread 1's result is silently wrong."""
    result = run_case("foreign", guarded=False)
    assert result["errors"] == []  # no crash: the damage is silent
    assert result["foreign_hook_calls"] > 0
    assert result["wrong"] == ["thread 1: acc n=100"]


def test_hooks_see_only_their_threads_tensors_guarded():
    result = run_case("foreign", guarded=True)
    assert result == {"errors": [], "foreign_hook_calls": 0, "wrong": []}


def test_a_cold_key_opened_during_a_benchmark_bare_triton_crashes():
    result = run_case("cold", guarded=False)
    assert any("'NoneType' object is not a mapping" in e for e in result["errors"]), result


def test_a_cold_key_opened_during_a_benchmark_waits_its_turn_guarded():
    result = run_case("cold", guarded=True)
    assert result["errors"] == [] and result["wrong"] == []
    assert result["queued_behind_benchmark"]  # the second key waited for the cpu slot


@pytest.mark.parametrize(
    "guarded",
    [True, pytest.param(False, marks=pytest.mark.xfail(reason="bare Triton races", strict=True))],
    ids=["guarded", "bare"],
)
def test_many_lanes_mixed_keys_every_result_exact(guarded):
    """4 CPU lanes and 4 threads, on a barrier: positional launches of two autotuned
    kernels (reset_to_zero + restore_value; Config.pre_hook), cold and repeated keys mixed,
    after a forced interleaving. Guarded: no exception, every result exact, one benchmark
    per key."""
    result = run_case("stress", guarded=guarded)
    assert result["errors"] == [], result["errors"][:5]
    assert result["wrong"] == [], result["wrong"][:5]
    assert result["foreign_hook_calls"] == 0
    assert result["calls"] == result["expected_calls"]
    assert result["benchmarks_per_key"] and set(result["benchmarks_per_key"].values()) == {1}


def test_a_subclass_like_fla_cached_autotuner_is_guarded():
    """An Autotuner subclass that overrides run() and installs its own restore hooks
    (as flash-linear-attention's CachedAutotuner does) gets the same protection."""
    assert run_case("subclass", guarded=True) == {
        "errors": [],
        "wrong": [],
        "foreign_hook_calls": 0,
    }
    bare = run_case("subclass", guarded=False)
    assert bare["errors"] or bare["wrong"]


# --- the child side -----------------------------------------------------------------------


def _child(case: str, guarded: bool) -> dict:
    import torch
    import triton
    import triton.language as tl

    from pydflash import Dispatcher, compile_queue, guards

    globals()["triton"] = triton  # Triton 3.3's interpreter rewrites kernels to use it
    assert triton.knobs.runtime.interpret if hasattr(triton, "knobs") else True
    if guarded:
        guards.install_guards()

    pause = threading.local()  # per thread: a function to run before its next benchmark
    benchmarks: collections.Counter = collections.Counter()
    expected = threading.local()  # the tensors this thread passed
    foreign_hook_calls = []
    stop_in_pre_hook = threading.local()

    def cpu_do_bench(kernel_call, quantiles):
        hook = getattr(pause, "before", None)
        if hook is not None:
            pause.before = None
            hook()
        start = time.perf_counter()
        kernel_call()
        ms = (time.perf_counter() - start) * 1e3
        return [ms, ms, ms]

    def config_pre_hook(nargs):
        want = getattr(expected, "x", None)
        if want is not None and nargs["x_ptr"] is not want:
            foreign_hook_calls.append(threading.current_thread().name)
        hook = getattr(stop_in_pre_hook, "fn", None)
        if hook is not None:
            stop_in_pre_hook.fn = None
            hook()

    configs = [triton.Config({"BLOCK": b}, pre_hook=config_pre_hook) for b in (16, 32)]

    @triton.autotune(
        configs=configs,
        key=["n"],
        reset_to_zero=["out_ptr"],
        restore_value=["acc_ptr"],
        do_bench=cpu_do_bench,
    )
    @triton.jit
    def accumulate(x_ptr, acc_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        acc = tl.load(acc_ptr + offs, mask=mask)
        tl.store(acc_ptr + offs, acc + x, mask=mask)  # in place: needs restore_value
        tl.atomic_add(out_ptr + offs, x * 2, mask=mask)  # accumulates: needs reset_to_zero

    @triton.autotune(
        configs=[triton.Config({"BLOCK": b}) for b in (16, 32, 64)],
        key=["n"],
        do_bench=cpu_do_bench,
    )
    @triton.jit
    def scale(x_ptr, y_ptr, n, factor, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * factor, mask=mask)

    # Count benchmarks per (kernel, n).
    original_bench = triton.runtime.autotuner.Autotuner._bench

    def counting_bench(self, *args, config, **meta):
        nargs = self.nargs
        if isinstance(nargs, dict):  # bare Triton may have lost it: let _bench fail as it does
            benchmarks[(self.base_fn.__name__, nargs["n"])] += 1
        return original_bench(self, *args, config=config, **meta)

    triton.runtime.autotuner.Autotuner._bench = counting_bench

    def grid(n):
        return lambda meta: (triton.cdiv(n, meta["BLOCK"]),)

    def call_accumulate(n: int, seed: int, kernel=accumulate) -> str | None:
        """Positional launch of `kernel` (accumulate's body) on fresh tensors; returns
        what was wrong, if anything."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(-50, 50, (n,), generator=g).float()
        acc0 = torch.randint(-50, 50, (n,), generator=g).float()
        acc, out = acc0.clone(), torch.zeros(n)
        expected.x = x
        try:
            kernel[grid(n)](x, acc, out, n)
        finally:
            expected.x = None
        if not torch.equal(acc, acc0 + x):
            return f"acc n={n}"
        if not torch.equal(out, 2 * x):
            return f"out n={n}"
        return None

    def call_scale(n: int, seed: int) -> str | None:
        x = torch.arange(n, dtype=torch.float32) + seed
        y = torch.empty(n)
        scale[grid(n)](x, y, n, 3.0)
        return None if torch.equal(y, 3 * x) else f"scale n={n}"

    errors: list[str] = []
    wrong: list[str] = []

    def guarded_call(label, fn, *args):
        try:
            problem = fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            errors.append(f"{label}: {type(exc).__name__}: {exc}")
            return
        if problem is not None:
            wrong.append(f"{label}: {problem}")

    def forced_pair(second_call, second_done_or_queued, second_key_stops=False, first_call=None):
        """Thread 1 benchmarks a cold key (n=100); its first benchmark waits until thread 2
        has made `second_call` (or is queued behind thread 1)."""
        first_call = first_call or call_accumulate
        t1_benchmarking = threading.Event()
        t2_done = threading.Event()
        t1_done = threading.Event()

        def thread1():
            pause.before = lambda: (
                t1_benchmarking.set(),
                eventually(lambda: second_done_or_queued(t2_done), "thread 2 went ahead"),
            )
            guarded_call("thread 1", first_call, 100, 1)
            t1_done.set()

        def thread2():
            t1_benchmarking.wait()
            if second_key_stops:
                stop_in_pre_hook.fn = lambda: (t2_done.set(), t1_done.wait())
            guarded_call("thread 2", second_call)
            t2_done.set()

        threads = [
            threading.Thread(target=thread1, name="thread 1"),
            threading.Thread(target=thread2, name="thread 2"),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def queued_or(done_event, key_part):
        return done_event.is_set() or any(
            key_part in f["key"] and not f["running"] for f in compile_queue.in_flight()
        )

    if case == "crash":
        # Tune n=64 first, on this thread: thread 2's call is then a cache hit.
        guarded_call("main", call_accumulate, 64, 0)
        forced_pair(lambda: call_accumulate(64, 2), lambda done: done.is_set())
        return {"errors": errors, "wrong": wrong}

    if case == "foreign":
        guarded_call("main", call_accumulate, 64, 0)
        forced_pair(
            lambda: call_accumulate(64, 2), lambda done: done.is_set(), second_key_stops=True
        )
        return {"errors": errors, "foreign_hook_calls": len(foreign_hook_calls), "wrong": wrong}

    if case == "cold":
        seen_queued = []

        def done_or_queued(done):
            queued = queued_or(done, ":(128,")  # the second thread's key, n=128
            if queued and not done.is_set():
                seen_queued.append(True)
            return queued

        forced_pair(lambda: call_accumulate(128, 2), done_or_queued)
        return {"errors": errors, "wrong": wrong, "queued_behind_benchmark": bool(seen_queued)}

    if case == "stress":
        guarded_call("main", call_accumulate, 64, 0)
        forced_pair(lambda: call_accumulate(64, 2), lambda done: done.is_set())
        done_calls: list[int] = []
        sizes = [64, 96, 100, 128, 160, 192]
        per_worker = 8
        barrier = threading.Barrier(8)

        def worker(w: int) -> None:
            barrier.wait()
            for i in range(per_worker):
                n = sizes[(w + i) % len(sizes)]
                if i % 2:
                    guarded_call(f"worker {w}", call_scale, n, w * 100 + i)
                else:
                    guarded_call(f"worker {w}", call_accumulate, n, w * 100 + i)
                done_calls.append(1)

        dispatcher = Dispatcher(["cpu"] * 4, guard=None if guarded else ())
        try:
            futures = [dispatcher.on("cpu", i).submit(worker, i) for i in range(4)]
            threads = [
                threading.Thread(target=worker, args=(4 + i,), name=f"thread {i}") for i in range(4)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for f in futures:
                f.result()
        finally:
            dispatcher.shutdown()
        return {
            "errors": errors,
            "wrong": wrong,
            "foreign_hook_calls": len(foreign_hook_calls),
            "calls": len(done_calls),
            "expected_calls": 8 * per_worker,
            "benchmarks_per_key": {
                f"{name}:{n}": count / (2 if name == "accumulate" else 3)
                for (name, n), count in benchmarks.items()
            },
        }

    if case == "subclass":
        from triton.runtime.autotuner import Autotuner

        class CachedLike(Autotuner):
            # The shape of flash-linear-attention's CachedAutotuner: its own restore hooks
            # keeping copies on the instance, and a run() that calls super().run().
            def __init__(self, fn, arg_names, configs, key, reset_to_zero, restore_value, **kw):
                super().__init__(fn, arg_names, configs, key, reset_to_zero, restore_value, **kw)

                def _pre_hook(kw, reset_only=False):
                    for name in self.reset_to_zero:
                        kw[name].zero_()
                    if not reset_only:
                        self.restore_copies = {
                            name: kw[name].clone() for name in self.restore_value
                        }

                def _post_hook(kw, exception):
                    for name, copy in self.restore_copies.items():
                        kw[name].copy_(copy)
                    self.restore_copies = {}

                self.pre_hook, self.post_hook = _pre_hook, _post_hook

            def run(self, *args, **kwargs):
                return super().run(*args, **kwargs)

        cached_like = CachedLike(
            accumulate.fn,
            accumulate.arg_names,
            configs,
            ["n"],
            ["out_ptr"],
            ["acc_ptr"],
            do_bench=cpu_do_bench,
        )

        def call_sub(n, seed):
            return call_accumulate(n, seed, kernel=cached_like)

        guarded_call("main", call_sub, 64, 0)
        forced_pair(
            lambda: call_sub(64, 2),
            lambda done: done.is_set(),
            second_key_stops=True,
            first_call=call_sub,
        )
        return {"errors": errors, "wrong": wrong, "foreign_hook_calls": len(foreign_hook_calls)}

    raise SystemExit(f"unknown case {case!r}")


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (the tests do)")
    print(json.dumps(_child(sys.argv[1], sys.argv[2] == "guarded")))
    sys.stdout.flush()
    os._exit(0)  # threads left blocked by a bare-Triton crash must not hold the exit
