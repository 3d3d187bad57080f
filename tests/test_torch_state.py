"""The caller's torch state at submit is the task's state on the worker."""

import os
import subprocess
import sys
import threading

import pytest

import pydflash
from pydflash import _C

torch = pytest.importorskip("torch")


@pytest.fixture
def lane():
    d = pydflash.Dispatcher(["cpu"], guard=())
    yield d.lanes[0]
    d.shutdown()


def state():
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
    )


def test_default_state(lane):
    assert lane.submit(state).result() == (True, False, False, torch.get_autocast_dtype("cpu"))


def test_no_grad_is_carried_and_does_not_leak(lane):
    with torch.no_grad():
        inside = lane.submit(state).result()
    after = lane.submit(state).result()
    assert inside[0] is False
    assert after[0] is True


def test_enable_grad_inside_no_grad_thread():
    # The worker's own grad mode must not matter: set it off there, submit with grad on.
    with pydflash.Dispatcher(["cpu"], guard=()) as d:
        d.submit(torch.set_grad_enabled, False).result()
        assert d.submit(torch.is_grad_enabled).result() is True


def test_inference_mode_is_carried(lane):
    with torch.inference_mode():
        inside = lane.submit(state).result()
        made = lane.submit(torch.ones, 2).result()
    assert inside[1] is True and made.is_inference()
    assert lane.submit(state).result()[1] is False


def test_autocast_enabled_and_dtype_are_carried(lane):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = lane.submit(state).result()
        product = lane.submit(lambda a, b: a @ b, torch.ones(4, 4), torch.ones(4, 4)).result()
    assert inside[2] is True and inside[3] == torch.bfloat16
    assert product.dtype == torch.bfloat16
    assert lane.submit(state).result()[2] is False


def test_grad_flows_through_a_task(lane):
    w = torch.ones(3, requires_grad=True)
    loss = lane.submit(lambda: (w * 2).sum()).result()
    loss.backward()
    assert torch.equal(w.grad, torch.full((3,), 2.0))


def test_state_of_the_submitting_thread_not_the_main_thread(lane):
    seen = []

    def producer():
        with torch.no_grad():
            seen.append(lane.submit(torch.is_grad_enabled).result())

    t = threading.Thread(target=producer)
    t.start()
    t.join()
    assert seen == [False]
    assert lane.submit(torch.is_grad_enabled).result() is True


def test_inference_mode_with_grad_enabled_inside_is_carried(lane):
    with torch.inference_mode(), torch.enable_grad():
        inside = lane.submit(state).result()
    assert inside[:2] == (True, True)


def test_the_reader_in_use():
    # Native unless told otherwise: a torch whose libraries lack the thread-local
    # accessors would fall back to Python silently, and this says so.
    expected = "python" if os.environ.get("PYDFLASH_TORCH_STATE") == "python" else "native"
    assert _C.torch_state_reader() == expected


@pytest.mark.skipif(
    os.environ.get("PYDFLASH_TORCH_STATE") == "python", reason="this run is the fallback"
)
def test_the_python_fallback_carries_the_same_state():
    env = dict(os.environ, PYDFLASH_TORCH_STATE="python")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("run", range(3))
def test_lanes_importing_torch_at_once(run, run_child_script):
    out = run_child_script("first_torch_tasks.py")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([2] * 9)
