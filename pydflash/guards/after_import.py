"""Running code right after a module is imported: the guards of packages that may be
imported after the guard is installed (flash-linear-attention, torch._dynamo)."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

from .patching import Installed


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


def when_imported(names: tuple[str, ...], callback: Callable[[Any], None]) -> None:
    """callback(module) for each of `names`: now if imported, else right after import."""
    for name in names:
        module = sys.modules.get(name)
        if module is not None:
            callback(module)
        else:
            _after_import.callbacks.setdefault(name, []).append(callback)
    if _after_import.callbacks and _after_import not in sys.meta_path:
        sys.meta_path.insert(0, _after_import)


def forget(callback: Callable[[Any], None]) -> None:
    """Drops `callback` wherever it still waits; the finder leaves with the last one."""
    callbacks = _after_import.callbacks
    for name in list(callbacks):
        callbacks[name] = [c for c in callbacks[name] if c != callback]
        if not callbacks[name]:
            del callbacks[name]
    if not callbacks and _after_import in sys.meta_path:
        sys.meta_path.remove(_after_import)


class ImportGuard(Installed):
    """A guard of a package: `guard_module(module)` runs on each of `modules` once it is
    imported, now or later, until the guard is uninstalled."""

    modules: tuple[str, ...] = ()

    @classmethod
    def install(cls) -> ImportGuard:
        guard = cls()
        when_imported(cls.modules, guard.guard_module)
        return guard

    def guard_module(self, module: Any) -> None:
        raise NotImplementedError

    def uninstall(self) -> None:
        forget(self.guard_module)
        super().uninstall()
