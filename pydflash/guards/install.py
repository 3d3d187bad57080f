"""Installing guards by name, once per process, with reference-counted holds.

Each guard is installed by its first holder and removed with its last hold (or at once
by `remove_guards()`). The 'triton' guard checks every part it patches against the
installed Triton first (checks.py) and installs all of them or none."""

from __future__ import annotations

import collections
import threading
import warnings
from collections.abc import Callable, Iterable

from . import allocator, autotuner, interpreter, jit
from .checks import Checker
from .fla import FlaGuard
from .patching import Change, Installed
from .torch_compile import TorchCompileGuard

# The parts of the 'triton' guard, each named by the feature it reports. They go on and
# off together: each closes a race that the others leave open.
_TRITON_PARTS: tuple[tuple[str, Callable[[Checker], list[Change]]], ...] = (
    ("autotuner", autotuner.plan),
    ("jit_single_flight", jit.plan_compile),
    ("kernel_load", jit.plan_load),
    ("interpreter", interpreter.plan),
    ("allocator", allocator.plan),
)


def _install_triton() -> Installed:
    import triton

    check = Checker()
    planned = {feature: plan(check) for feature, plan in _TRITON_PARTS}
    check.raise_if_any(triton)  # before anything is patched
    guard = Installed()
    for feature, changes in planned.items():
        for change in changes:
            guard.apply(change)
        guard.features[feature] = bool(changes)
    return guard


# Every guard by name, in install order ('triton' first: it is the one that may refuse).
GUARDS: dict[str, Callable[[], Installed]] = {
    "triton": _install_triton,
    "fla": FlaGuard.install,
    "torch_compile": TorchCompileGuard.install,
}

_lock = threading.Lock()
_installed: dict[str, Installed] = {}
_holders: collections.Counter[str] = collections.Counter()


def select(names: str | Iterable[str] | None) -> tuple[str, ...]:
    """The guards that `names` selects, in install order; None selects every guard."""
    if names is None:
        return tuple(GUARDS)
    if isinstance(names, str):
        names = (names,)
    try:
        wanted = list(names)
    except TypeError:
        raise TypeError(
            f"expected guard names as a str or an iterable of str, got {type(names).__name__}"
        ) from None
    valid = tuple(GUARDS)  # a tuple: an unhashable name is just unknown
    unknown = [name for name in wanted if name not in valid]
    if unknown:
        raise ValueError(
            f"expected guard names from {', '.join(map(repr, valid))}, "
            f"got {', '.join(map(repr, unknown))}"
        )
    return tuple(name for name in GUARDS if name in wanted)


def guard(
    names: str | Iterable[str] | None = None, *, missing_ok: bool = False
) -> GuardHandle | None:
    """Installs the named guards (each once per process; None: all) and returns a handle
    whose `uninstall()` drops this caller's hold on them. A selection naming 'triton'
    needs Triton: without it nothing is installed, and this returns None when
    `missing_ok`, else raises ImportError. Raises UnsupportedTritonError when Triton's
    internals are not the ones the guard knows."""
    selected = select(names)
    with _lock:
        if "triton" in selected and "triton" not in _installed:
            try:
                import triton  # noqa: F401
            except ImportError as exc:
                if missing_ok:
                    return None
                raise ImportError(
                    "the 'triton' guard needs Triton, which is not importable here; pass "
                    "missing_ok=True to skip the guards when Triton is absent"
                ) from exc
        new = [name for name in selected if name not in _installed]
        try:
            for name in new:
                _installed[name] = GUARDS[name]()
        except BaseException:
            for name in reversed(new):  # nothing half-installed
                if name in _installed:
                    _installed.pop(name).uninstall()
            raise
        _holders.update(selected)
        return GuardHandle({name: _installed[name] for name in selected})


def install_guards(*, missing_ok: bool = False) -> GuardHandle | None:
    """Installs every guard (`guard()` with no names) and returns the handle. Without
    Triton: None when `missing_ok`, else ImportError."""
    return guard(None, missing_ok=missing_ok)


def remove_guards() -> None:
    """Removes every guard now, whatever handles are still held."""
    with _lock:
        for name in reversed(list(_installed)):
            _installed.pop(name).uninstall()
        _holders.clear()


def guard_triton(*, missing_ok: bool = False) -> GuardHandle | None:
    """Deprecated: `install_guards()`, which it is (every guard, not only Triton's)."""
    _deprecated("guard_triton()", "install_guards()")
    return install_guards(missing_ok=missing_ok)


def unguard_triton() -> None:
    """Deprecated: `remove_guards()`, which it is (every guard, not only Triton's)."""
    _deprecated("unguard_triton()", "remove_guards()")
    remove_guards()


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"pydflash.{old} is deprecated: it switches every guard; use pydflash.{new}",
        DeprecationWarning,
        stacklevel=3,
    )


def installed() -> tuple[str, ...]:
    """The names of the guards installed now."""
    return tuple(name for name in GUARDS if name in _installed)


def is_guarded() -> bool:
    return bool(_installed)


class GuardHandle:
    """A hold on installed guards (see `guard`)."""

    def __init__(self, held: dict[str, Installed]) -> None:
        self._held = held

    @property
    def active(self) -> bool:
        return bool(self._held) and all(_installed.get(n) is g for n, g in self._held.items())

    @property
    def features(self) -> dict[str, bool]:
        """What the held guards could enable here: autotuner, jit_single_flight,
        kernel_load, interpreter, allocator ('triton'), and once those packages are
        imported fla_tensor_cache ('fla') and torch_compile ('torch_compile')."""
        return {k: v for g in self._held.values() for k, v in g.features.items()}

    def uninstall(self) -> None:
        """Drops this hold; idempotent. Each guard comes off when no hold on it is left."""
        with _lock:
            mine, self._held = self._held, {}
            for name, held in reversed(mine.items()):
                if _installed.get(name) is not held:
                    continue  # removed by remove_guards() since
                _holders[name] -= 1
                if not _holders[name]:
                    del _holders[name]
                    _installed.pop(name).uninstall()

    def __enter__(self) -> GuardHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def __repr__(self) -> str:
        return f"<pydflash.GuardHandle {'active' if self.active else 'released'}>"
