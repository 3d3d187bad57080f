"""The caller's thread-local torch state, carried into a lane's task.

Grad mode travels natively on every submit (csrc/python/torch_abi.cpp). Inference
mode and autocast are rarer and have more to them (dtype per device type, the cache
flag), so when either is on the native side calls `capture()` at submit and
`call_in_state()` on the worker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

_AUTOCAST_DEVICE_TYPES = ("cuda", "cpu")


def capture() -> tuple:
    autocast = tuple(
        (dt, torch.get_autocast_dtype(dt))
        for dt in _AUTOCAST_DEVICE_TYPES
        if torch.is_autocast_enabled(dt)
    )
    return (torch.is_inference_mode_enabled(), autocast, torch.is_autocast_cache_enabled())


def call_in_state(state: tuple, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    inference, autocast, cache = state
    with contextlib.ExitStack() as stack:
        if inference:
            # The caller's grad mode is already set; entering inference mode turns it off.
            grad = torch.is_grad_enabled()
            stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(grad))
        for device_type, dtype in autocast:
            stack.enter_context(
                torch.autocast(device_type, dtype=dtype, enabled=True, cache_enabled=cache)
            )
        return fn(*args, **kwargs)


def match_intra_op_threads(threads: int) -> None:
    # A worker keeps the intra-op thread count torch had when it first ran torch code;
    # the caller's count keeps CPU reductions in the caller's order.
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
