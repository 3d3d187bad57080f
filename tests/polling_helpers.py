"""Waiting in tests for what another thread brings about."""

import time

POLL_S = 0.0005


def eventually(pred, what: str, *, within_s: float = 10.0) -> None:
    """Polls pred(); the bound turns a hang into a failure, it is not a timing assertion."""
    for _ in range(round(within_s / POLL_S)):
        if pred():
            return
        time.sleep(POLL_S)
    raise AssertionError(f"never happened: {what}")
