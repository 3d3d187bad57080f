"""A microbatch's submission (pydflash/pipeline/microbatch.py) on CPU lanes: what the
pipeline tracks of a microbatch submitted as stream programs, with the programs stood in
for by lane tasks."""

from __future__ import annotations

import threading

import pytest
import torch

import pydflash
from pydflash.pipeline import scheduler

WAIT_S = 30.0


class FakeNative:
    """Stands in for NativeMicrobatches: every microbatch qualifies, its target "program"
    is a lane task that returns the batch, its drafter "program" one that returns a loss.
    The target program gets no callback of its own, as the real one does not."""

    def __init__(self, drafter_lanes) -> None:
        self.drafter_lanes = drafter_lanes
        self.targets: list = []
        self.submitted = 0

    def start_run(self, target_lanes) -> None:
        pass

    def submit(self, k, t_index, t_lane, replica, batch, previous):
        target = t_lane.submit(lambda: batch)
        drafter = self.drafter_lanes[replica].submit(lambda: torch.tensor(float(k)))
        self.targets.append(target)
        self.submitted += 1
        return target, drafter, None, None


@pytest.fixture
def native_pipeline(monkeypatch):
    dispatcher = pydflash.Dispatcher(["cpu"] * 2)
    t_lane, d_lane = dispatcher.lanes
    drafter = torch.nn.Linear(2, 1)
    natives = []

    class Factory:
        @staticmethod
        def of(targets, target_lanes, drafter, drafter_lanes, depth):
            natives.append(FakeNative(drafter_lanes))
            return natives[-1]

    monkeypatch.setattr(scheduler, "NativeMicrobatches", Factory)
    pipe = pydflash.Pipeline(
        t_lane,
        d_lane,
        target=lambda batch: batch,
        drafter=drafter,
        loss=lambda m, x: m(x).sum(),
        optimizer=torch.optim.SGD(drafter.parameters(), lr=0.1),
    )
    yield pipe, natives[0], t_lane
    dispatcher.shutdown(cancel_futures=True)


def test_native_microbatches_train_and_count(native_pipeline):
    pipe, native, _ = native_pipeline
    losses = [step.loss() for step in pipe.run(torch.zeros(2) for _ in range(6))]
    assert losses == [float(k) for k in range(6)]
    stats = pipe.stats()
    assert (stats["steps"], stats["microbatches"], stats["native_microbatches"]) == (6, 6, 6)
    assert all(target.done() for target in native.targets)


def test_leaving_early_cancels_the_queued_target_programs(native_pipeline):
    # The target programs queue behind a task that blocks their lane; leaving the loop
    # must cancel them, as it does a Python target task, though they have no callback.
    pipe, native, t_lane = native_pipeline
    release = threading.Event()
    blocker = t_lane.submit(release.wait, WAIT_S)
    try:
        run = pipe.run(torch.zeros(2) for _ in range(6))
        assert next(run).step == 0
        run.close()
        assert native.targets and all(target.cancelled() for target in native.targets)
    finally:
        release.set()
        blocker.result(WAIT_S)
