"""The 'fla' guard: flash-linear-attention's `tensor_cache` keeps a deque in each
wrapper's closure that every call iterates and a miss appends to, so calls from several
threads raise 'deque mutated during iteration'. The guard swaps each such deque for one
whose iteration walks a snapshot, for functions decorated before and after it, as soon
as flash-linear-attention is imported. It needs no Triton of its own."""

from __future__ import annotations

import collections
import functools
import sys
import warnings
from collections.abc import Callable
from typing import Any

from .after_import import ImportGuard
from .patching import Patch


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


class FlaGuard(ImportGuard):
    modules = ("fla.utils.decorators", "fla.utils._decorators", "fla.utils")

    def __init__(self) -> None:
        super().__init__()
        self.swapped_caches: list[Any] = []  # closure cells of tensor_cache wrappers
        self.on = True

    def uninstall(self) -> None:
        self.on = False
        super().uninstall()
        for mod in _fla_modules():  # names imported from a patched module
            for name, value in list(vars(mod).items()):
                original = getattr(value, "_pydflash_original", None)
                if original is not None:
                    setattr(mod, name, original)
        for cell in self.swapped_caches:
            cached = cell.cell_contents
            cell.cell_contents = collections.deque(cached, maxlen=cached.maxlen)
        self.swapped_caches.clear()

    def guard_module(self, module: Any) -> None:
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
            if self.on:
                self._swap_cache(wrapper)
            return wrapper

        tensor_cache._pydflash_original = original  # type: ignore[attr-defined]
        self.apply(Patch(module, "tensor_cache", tensor_cache))
        # Functions decorated before the guard, wherever fla put them.
        for mod in _fla_modules():
            if getattr(mod, "tensor_cache", None) is original and mod is not module:
                self.apply(Patch(mod, "tensor_cache", tensor_cache))
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
    for cell in closure:
        try:
            contents = cell.cell_contents
        except ValueError:
            continue
        if isinstance(contents, (collections.deque, _SnapshotDeque)):
            return cell
    return None
