"""The 'fla' guard (pydflash/guards/fla.py): flash-linear-attention's tensor_cache,
on a stand-in package with the same shape."""

from __future__ import annotations

import collections
import sys
import textwrap
import threading

import pytest

FAKE_FLA = {
    "fla/__init__.py": "",
    "fla/utils/__init__.py": "from .decorators import tensor_cache\n",
    # The shape of flash-linear-attention 0.6.0's tensor_cache: a deque in the closure,
    # iterated on every call and appended to on a miss.
    "fla/utils/decorators.py": """
        import collections, functools

        def tensor_cache(fn):
            cached = collections.deque(maxlen=4)

            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                for cached_args, cached_kwargs, cached_result in cached:
                    if len(args) == len(cached_args) and all(
                        a is b for a, b in zip(args, cached_args)
                    ):
                        return cached_result
                result = fn(*args, **kwargs)
                cached.append((args, kwargs, result))
                return result

            return wrapper
    """,
    "fla/ops.py": """
        from fla.utils import tensor_cache

        @tensor_cache
        def prepare(x):
            return [x]
    """,
}


@pytest.fixture
def fake_fla(tmp_path, monkeypatch):
    """A stand-in flash-linear-attention package; a real one imported before is put
    aside meanwhile and restored."""

    def take_fla_modules() -> dict:
        names = [m for m in sys.modules if m == "fla" or m.startswith("fla.")]
        return {name: sys.modules.pop(name) for name in names}

    real = take_fla_modules()
    for name, text in FAKE_FLA.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    take_fla_modules()
    sys.modules.update(real)


def cache_type(fn) -> type:
    from pydflash.guards.fla import _tensor_cache_cell

    return type(_tensor_cache_cell(fn).cell_contents)


@pytest.mark.parametrize(
    "imported_first", [False, True], ids=["guard-then-import", "import-then-guard"]
)
def test_fla_tensor_cache_is_made_thread_safe(guard_module, fake_fla, imported_first):
    pytest.importorskip("triton")  # install_guards() installs every guard
    from pydflash.guards.fla import _SnapshotDeque

    if imported_first:
        import fla.ops
    guard = guard_module.install_guards()
    import fla.ops
    import fla.utils

    assert cache_type(fla.ops.prepare) is _SnapshotDeque
    assert guard.features["fla_tensor_cache"]
    later = fla.utils.tensor_cache(lambda x: x)  # decorated after the guard
    assert cache_type(later) is _SnapshotDeque
    x = object()
    assert fla.ops.prepare(x) is fla.ops.prepare(x)  # still a cache

    errors: list = []
    barrier = threading.Barrier(8)

    def body() -> None:
        barrier.wait()
        try:
            for _ in range(3000):
                fla.ops.prepare(object())  # a miss: iterate, then append
        except RuntimeError as exc:
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=body) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    guard.uninstall()
    assert cache_type(fla.ops.prepare) is collections.deque
    assert fla.utils.tensor_cache is fla.utils.decorators.tensor_cache
    assert not hasattr(fla.utils.tensor_cache, "_pydflash_original")


def test_a_snapshot_deque_survives_appends_while_iterated():
    from pydflash.guards.fla import _SnapshotDeque

    plain = collections.deque([1, 2], maxlen=4)
    it = iter(plain)
    next(it)
    plain.append(3)
    with pytest.raises(RuntimeError, match="mutated during iteration"):
        next(it)
    snap = _SnapshotDeque([1, 2], maxlen=4)
    it = iter(snap)
    next(it)
    snap.append(3)
    assert list(it) == [2]
    assert list(snap) == [1, 2, 3] and snap.maxlen == 4


def test_the_fla_guard_needs_no_triton(guard_module, fake_fla, monkeypatch):
    from pydflash.guards.fla import _SnapshotDeque

    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    with guard_module.guard("fla") as guard:
        import fla.ops

        assert guard_module.installed() == ("fla",)
        assert guard.features == {"fla_tensor_cache": True}
        assert cache_type(fla.ops.prepare) is _SnapshotDeque
    assert cache_type(fla.ops.prepare) is collections.deque
