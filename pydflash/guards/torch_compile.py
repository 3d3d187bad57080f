"""The 'torch_compile' guard: Dynamo and Inductor are not thread-safe while they compile
(Dynamo's `compile_lock` covers tracing only), so the first call of a `torch.compile`d
module on each device runs alone, through the compile queue with the module as the
slot; later calls go straight through. Installed on `OptimizedModule` as soon as
`torch._dynamo` is imported. It needs no Triton of its own."""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

from .. import compile_queue
from .after_import import ImportGuard
from .patching import Patch


class TorchCompileGuard(ImportGuard):
    modules = ("torch._dynamo.eval_frame",)

    def guard_module(self, module: Any) -> None:
        optimized = getattr(module, "OptimizedModule", None)
        call = vars(optimized).get("__call__") if optimized is not None else None
        if call is None:
            self.features["torch_compile"] = False
            return
        self.apply(Patch(optimized, "__call__", _make_first_calls_queued(call)))
        self.features["torch_compile"] = True


def _make_first_calls_queued(original: Callable[..., Any]) -> Callable[..., Any]:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        device = _torch_device()
        warm = self.__dict__.get("_pydflash_warm_devices")
        if warm is not None and device in warm:
            return original(self, *args, **kwargs)

        def work() -> Any:
            result = original(self, *args, **kwargs)
            self.__dict__.setdefault("_pydflash_warm_devices", set()).add(device)
            return result

        name = type(getattr(self, "_orig_mod", self)).__name__
        key = f"torch.compile:{name}@{id(self):x}[{device}]:{threading.get_ident()}"
        return compile_queue.run(key, work, slot=f"torch.compile:{id(self):x}")

    functools.update_wrapper(__call__, original)
    return __call__


def _torch_device() -> int:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return -1
