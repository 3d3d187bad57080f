"""What a pipeline has in flight (pydflash/pipeline/_flight.py): the window of at most `depth`
microbatches, the hidden-byte ledger and a step's optimizer tasks."""

from __future__ import annotations

import pytest

from pydflash.pipeline._flight import FlightWindow, HiddenBytes, StepTasks


def test_the_window_holds_at_most_depth_consecutive_microbatches():
    window = FlightWindow(2)
    first, second = window.enter(0), window.enter(1)
    assert window.full and window.oldest() is first and window.in_flight() == 2
    with pytest.raises(AssertionError):
        window.enter(2)  # microbatch 0 has not left
    first.ended = True
    assert window.in_flight() == 1
    assert window.leave_oldest() is first
    third = window.enter(2)
    with pytest.raises(AssertionError):
        window.leave_oldest()  # microbatch 1's task has not ended
    window.cancel_newest()  # microbatch 2's tasks were never submitted
    assert not window.full and window.oldest() is second
    window.clear()
    assert window.in_flight() == 0 and third.k == 2


def test_a_step_applies_once_all_its_tasks_ended_well():
    tasks = StepTasks(2)
    assert not tasks.task_ended(True) and not tasks.ended
    assert tasks.task_ended(True) and tasks.ended
    failed = StepTasks(2)
    assert not failed.task_ended(False)
    assert not failed.task_ended(True) and failed.ended


def test_the_hidden_byte_ledger_counts_what_is_held():
    ledger = HiddenBytes()
    for k in range(4):
        ledger.open(k)
    ledger.hold(0, 100)  # microbatch 0's target result
    ledger.hold(0, 50)  # its copy on the drafter's device
    ledger.hold(1, 100)
    ledger.release(0)
    ledger.hold(2, 0)
    assert ledger.stats() == {
        "hidden_bytes_held": 100,
        "hidden_bytes_peak": 250,
        "hidden_bytes_per_microbatch": 150,
    }
    # Microbatch 3 left before its target's bytes were counted (its target failed, or the
    # target's done-callback ran after the drafter finished): they do not count when they come.
    ledger.release(3)
    ledger.hold(3, 500)
    ledger.hold(0, 100)  # a late callback of a microbatch that trained
    ledger.hold(9, 100)  # a microbatch that never entered
    assert ledger.stats()["hidden_bytes_held"] == 100  # microbatch 1's alone
    ledger.release_all()
    ledger.hold(1, 70)  # closed by release_all
    assert ledger.stats()["hidden_bytes_held"] == 0 and len(ledger) == 0
    # A new run counts the same indices again once they enter.
    ledger.open(3)
    ledger.hold(3, 500)
    assert ledger.stats() == {
        "hidden_bytes_held": 500,
        "hidden_bytes_peak": 500,
        "hidden_bytes_per_microbatch": 500,
    }
