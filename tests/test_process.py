"""Process-level behaviour: Ctrl-C during a wait, exit with live lanes, fork."""

import os
import textwrap
import time
import warnings

import pytest

import pydflash


def test_ctrl_c_interrupts_a_wait_promptly(run_python):
    code = textwrap.dedent(
        """
        import os, signal, threading, time, pydflash
        d = pydflash.Dispatcher(["cpu"], guard_triton=False)
        gate = threading.Event()
        f = d.submit(gate.wait)
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        start = time.perf_counter()
        try:
            f.result()
        except KeyboardInterrupt:
            print("interrupted after %.3f s" % (time.perf_counter() - start))
        gate.set()
        print("then", f.result(timeout=5))
        d.shutdown()
        """
    )
    out = run_python(code, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert lines[0].startswith("interrupted after") and float(lines[0].split()[2]) < 2.0
    assert lines[1] == "then True"


QUEUED_AT_EXIT = """
import time, pydflash
ex = pydflash.Dispatcher(devices=["cpu"])
ex.submit(time.sleep, 0.3)
ex.submit(print, "queued task ran")   # never printed; ThreadPoolExecutor prints it
"""


@pytest.mark.parametrize("then", ["", "ex.shutdown(wait=False)"])
def test_work_queued_at_exit_runs(run_python, then):
    # As concurrent.futures does: the program exits once pending work is done, also
    # after shutdown(wait=False) (cancel_futures=False).
    out = run_python(QUEUED_AT_EXIT + then)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "queued task ran\n" and out.stderr == ""


def test_exit_runs_the_queues_of_live_and_dropped_dispatchers(run_python):
    code = textwrap.dedent(
        """
        import atexit, gc, time, pydflash
        ran = {"live": [], "dropped": []}
        def task(name, i):
            time.sleep(0.002)
            ran[name].append(i)
        # atexit handlers run after the lanes' queues (as after ThreadPoolExecutor's).
        atexit.register(lambda: print(*(sorted(v) == list(range(40)) for v in ran.values())))
        live = pydflash.Dispatcher(["cpu", "cpu"], guard_triton=False)
        dropped = pydflash.Dispatcher(["cpu"], guard_triton=False)
        for i in range(40):
            live.submit(task, "live", i)
            dropped.submit(task, "dropped", i)
        del dropped
        gc.collect()
        print("leaving", flush=True)
        """
    )
    out = run_python(code, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "leaving\nTrue True\n" and out.stderr == ""


def test_exit_with_a_task_that_never_returns(run_python):
    code = textwrap.dedent(
        """
        import threading, time, pydflash
        d = pydflash.Dispatcher(["cpu"], guard_triton=False)
        f = d.submit(threading.Event().wait)
        d.submit(print, "queued behind it")
        while not f.running():
            time.sleep(0.001)
        print("leaving")
        """
    )
    start = time.perf_counter()
    out = run_python(code, timeout=60, env={"PYDFLASH_EXIT_TIMEOUT": "0.5"})
    assert out.returncode == 0, out.stderr
    assert out.stdout == "leaving\n"
    assert out.stderr == (
        "pydflash: exit stopped waiting for lane 0 (cpu) (a task ran past "
        "PYDFLASH_EXIT_TIMEOUT=0.5 s): 1 task left running, 1 queued task cancelled\n"
    )
    assert time.perf_counter() - start < 20


def test_dropped_dispatcher_finishes_its_queue(run_python):
    code = textwrap.dedent(
        """
        import gc, time, pydflash
        done = []
        d = pydflash.Dispatcher(["cpu"], guard_triton=False)
        fs = [d.submit(done.append, i) for i in range(50)]
        del d; gc.collect()
        print(sum(f.result(timeout=10) is None for f in fs), len(done))
        """
    )
    out = run_python(code, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["50", "50"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_child_gets_a_clear_error_and_can_start_its_own():
    d = pydflash.Dispatcher(["cpu"], guard_triton=False)
    d.submit(lambda: None).result()
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns that forking a multi-threaded process may deadlock.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # child: report through the pipe, never return into pytest
        status = "ok"
        try:
            d.submit(print)
            status = "no error"
        except RuntimeError as e:
            if "forked child" not in str(e):
                status = f"wrong message: {e}"
        try:
            with pydflash.Dispatcher(["cpu"], guard_triton=False) as child:
                if child.submit(pow, 2, 5).result(timeout=10) != 32:
                    status = "child dispatcher gave a wrong result"
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            status = f"child dispatcher failed: {e!r}"
        os.write(write_end, status.encode())
        os._exit(0)
    os.close(write_end)
    _, wait_status = os.waitpid(pid, 0)
    message = os.read(read_end, 1000).decode()
    os.close(read_end)
    assert os.WEXITSTATUS(wait_status) == 0
    assert message == "ok"
    assert d.submit(pow, 3, 2).result() == 9
    d.shutdown()


def test_python_m_pydflash_prints_build_info(run_child_module):
    out = run_child_module("pydflash")
    assert out.returncode == 0, out.stderr
    fields = dict(line.split(None, 1) for line in out.stdout.strip().splitlines())
    assert fields["pydflash"] == pydflash.__version__
    assert fields["built_with_cuda"] in {"True", "False"}
    assert "visible_devices" in fields and "torch" in fields
