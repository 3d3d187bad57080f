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
