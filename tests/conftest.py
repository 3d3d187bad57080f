import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")  # what tests run in a child interpreter


# A shell that starts pytest in the background (`cmd &` without job control) starts it
# with SIGINT ignored: Python then installs no KeyboardInterrupt handler, interrupt_main()
# does nothing, and child processes inherit the ignore. The Ctrl-C tests need Ctrl-C live,
# as it is in a terminal; a handler set here is reset to the default in each child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none visible); runs on the GPU host")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def python_subprocess_env():
    """Environment for child interpreters: this checkout importable, output unbuffered."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run_child(argv: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,  # the tests read the status
    )


@pytest.fixture
def run_child_script(python_subprocess_env):
    """Runs tests/scripts/<name> with `args` in a fresh interpreter; returns the
    CompletedProcess. `env` entries replace the subprocess environment's."""

    def run(name: str, *args: str, timeout: float = 60, env: dict | None = None):
        argv = [os.path.join(SCRIPTS, name), *args]
        return _run_child(argv, {**python_subprocess_env, **(env or {})}, timeout)

    return run


@pytest.fixture
def run_child_module(python_subprocess_env):
    """Runs `python -m <module>` with `args` in a fresh interpreter, as
    `run_child_script` runs a script."""

    def run(module: str, *args: str, timeout: float = 60, env: dict | None = None):
        argv = ["-m", module, *args]
        return _run_child(argv, {**python_subprocess_env, **(env or {})}, timeout)

    return run


@pytest.fixture
def start_child_script(python_subprocess_env):
    """Starts tests/scripts/<name> with `args` in a fresh interpreter, with text pipes
    for stdout and stderr; returns the Popen and kills what is still running at
    teardown. `env` entries replace the subprocess environment's."""
    children = []

    def start(name: str, *args: str, env: dict | None = None):
        child = subprocess.Popen(
            [sys.executable, os.path.join(SCRIPTS, name), *args],
            env={**python_subprocess_env, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        children.append(child)
        return child

    yield start
    for child in children:
        if child.poll() is None:
            child.kill()
        child.communicate()


@pytest.fixture
def guard_module():
    """pydflash.guards with no guard installed; the previous state afterwards."""
    from pydflash import guards

    was = guards.is_guarded()
    guards.remove_guards()
    yield guards
    guards.remove_guards()
    if was:
        guards.install_guards(missing_ok=True)


EMPTY_GRAPH = "The CUDA Graph is empty"


@pytest.fixture(autouse=True)
def no_empty_cuda_graph(request, monkeypatch):
    """A test marked gpu fails when torch warns that a CUDA graph it ended was empty
    (Note [No empty graph] in pydflash/graphs/_cuda_capture.py). The warning is a TORCH_WARN that
    reaches Python as a UserWarning from `capture_end`; where a cleanup ends a capture
    under `contextlib.suppress(Exception)`, pytest's filterwarnings=error would turn it
    into an exception that the cleanup swallows, so each capture_end is watched here and
    every other warning it gives is passed on as it was."""
    if request.node.get_closest_marker("gpu") is None or not cuda_available():
        yield []
        return
    import warnings

    import torch

    empty: list[str] = []
    original = torch.cuda.CUDAGraph.capture_end

    def capture_end(self, *args, **kwargs):
        # catch_warnings is process-wide: captures in the GPU tests are few and brief.
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                original(self, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - raised below, after the warnings
                failure = exc
            else:
                failure = None
        empty.extend(str(w.message) for w in seen if EMPTY_GRAPH in str(w.message))
        for w in seen:  # the others, raised or shown as pytest's filters say
            if EMPTY_GRAPH not in str(w.message):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if failure is not None:
            raise failure

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_end", capture_end)
    yield empty  # a test that makes an empty graph on purpose takes it back out
    assert not empty, f"expected no empty CUDA graph, got {len(empty)}: {empty[0]}"
