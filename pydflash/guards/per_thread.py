"""Per-thread attributes: a data descriptor that gives each thread its own value of an
instance attribute, for the autotuner state Triton keeps on the shared instance."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .patching import MISSING


# Note [Per-thread autotuner state]
# Triton's Autotuner passes a call's state between its methods through the instance:
# run() sets self.nargs and _bench()/prune_configs()/the hooks read it; the default
# pre/post hooks keep restore copies in self.restore_copies; benchmark() leaves
# self.configs_timings for check_disk_cache() to write. With threads those are shared.
# PerThread makes each of these attributes a data descriptor on the class, so the
# unpatched methods (which the miss path still runs) read and write a per-thread
# value; the hit path never touches them. Values set before the guard stay readable as
# the fallback.
class PerThread:
    def __init__(self, name: str, default: Callable[[], Any] | None) -> None:
        self.name = name
        self.default = default

    @staticmethod
    def _local(obj: Any) -> threading.local:
        local = obj.__dict__.get("_pydflash_local")
        if local is None:
            local = obj.__dict__.setdefault("_pydflash_local", threading.local())
        return local

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = self._local(obj).__dict__.get(self.name, MISSING)
        if value is MISSING:
            value = obj.__dict__.get(self.name, MISSING)
        if value is MISSING:
            if self.default is None:
                raise AttributeError(
                    f"{type(obj).__name__!r} object has no attribute {self.name!r}"
                )
            value = self.default()
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        self._local(obj).__dict__[self.name] = value

    def __delete__(self, obj: Any) -> None:
        self._local(obj).__dict__.pop(self.name, None)
