"""pydflash.pipeline on CPU lanes: the same losses as a plain loop, the prefetch bound,
clean failure in every stage, and the graph-target hook."""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time

import pytest
import torch

import pydflash
from pydflash.errors import PipelineError
from pydflash.pipeline import Pipeline, StepResult
from pydflash.pipeline import microbatch as microbatch_module
from pydflash.pipeline._failures import STAGES
from pydflash.pipeline.stages import GraphTarget, TargetStage
from pydflash.pipeline.stages import drafter as drafter_module

WAIT_S = 30.0  # bound on waits that must end well before it; only a bug reaches it
_INIT_LOCK = threading.Lock()  # module init draws from torch's global RNG


# --- a small target, drafter and data ------------------------------------------------------
def make_target() -> torch.nn.Module:
    with _INIT_LOCK:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh()).requires_grad_(False)


def make_drafter() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    with _INIT_LOCK:
        torch.manual_seed(1)
        drafter = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 5)
        )
    return drafter, torch.optim.AdamW(drafter.parameters(), lr=1e-2)


def make_data(n: int, seed: int = 2) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "x": torch.randn(6, 8, generator=g),
            "y": torch.randint(0, 5, (6,), generator=g),
            "i": torch.tensor(i),
        }
        for i in range(n)
    ]


class Target:
    def __init__(self) -> None:
        self.model = make_target()

    def __call__(self, batch: dict) -> dict:
        return {"h": self.model(batch["x"]), "y": batch["y"], "i": batch["i"]}


def drafter_loss(drafter: torch.nn.Module, inputs: dict) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(drafter(inputs["h"]), inputs["y"])


def sequential(data: list, accumulate: int, steps: int | None = None):
    """The plain loop the pipeline must match."""
    target = Target()
    drafter, optimizer = make_drafter()
    losses = []
    n_steps = len(data) // accumulate if steps is None else steps
    for s in range(n_steps):
        for batch in data[s * accumulate : (s + 1) * accumulate]:
            with torch.no_grad():
                inputs = target(batch)
            loss = drafter_loss(drafter, inputs)
            (loss / accumulate).backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, drafter


@pytest.fixture
def lanes():
    dispatcher = pydflash.Dispatcher(["cpu"] * 4)
    yield dispatcher.lanes
    dispatcher.shutdown(cancel_futures=True)


def build(lanes, n_targets=1, n_drafters=1, *, target=None, loss=drafter_loss, **kwargs):
    pairs = [make_drafter() for _ in range(n_drafters)]
    pipe = Pipeline(
        lanes[:n_targets],
        lanes[n_targets : n_targets + n_drafters],
        target=Target() if target is None else target,
        drafter=[d for d, _ in pairs] if n_drafters > 1 else pairs[0][0],
        loss=loss,
        optimizer=[o for _, o in pairs] if n_drafters > 1 else pairs[0][1],
        **kwargs,
    )
    return pipe, [d for d, _ in pairs]


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def assert_idle(lanes) -> None:
    """Nothing runs now, and nothing but cancelled tasks is queued."""
    for lane in lanes:
        assert lane.stats()["running"] == 0, lane.stats()
    for lane in lanes:
        lane.submit(lambda: None).result(WAIT_S)  # after the cancelled tasks are dropped
        assert lane.load() == 0, lane.stats()


# --- same losses as the loop -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("n_targets", "n_drafters", "accumulate", "depth"),
    [(1, 1, 1, 1), (1, 1, 4, 2), (2, 1, 4, 3), (3, 1, 2, 4), (1, 2, 2, 3), (2, 2, 2, 2)],
)
def test_losses_and_weights_match_the_sequential_loop_exactly(
    lanes, n_targets, n_drafters, accumulate, depth
):
    data = make_data(24)
    expected, reference = sequential(data, accumulate)
    pipe, drafters = build(lanes, n_targets, n_drafters, accumulate=accumulate, depth=depth)
    results = list(pipe.run(data))
    assert [r.step for r in results] == list(range(24 // accumulate))
    assert [list(r.microbatches) for r in results] == [
        list(range(s * accumulate, (s + 1) * accumulate)) for s in range(len(results))
    ]
    assert [loss for r in results for loss in r.losses()] == expected
    for drafter in drafters:
        assert params_equal(drafter, reference)
    stats = pipe.stats()
    assert (stats["steps"], stats["microbatches"], stats["hidden_bytes_held"]) == (
        len(results),
        24,
        0,
    )
    assert_idle(lanes)


def test_random_configurations_match_the_sequential_loop_exactly(lanes):
    rng = random.Random(11)
    data = make_data(12)
    references = {a: sequential(data, a) for a in (1, 2, 3, 4, 6)}
    for _ in range(30):
        n_targets, n_drafters = rng.choice([(1, 1), (2, 1), (3, 1), (1, 2), (2, 2), (1, 3)])
        accumulate = n_drafters if n_drafters > 1 else rng.choice([1, 2, 3, 4, 6])
        depth = rng.randint(1, 5)
        expected, reference = references[accumulate]
        pipe, drafters = build(lanes, n_targets, n_drafters, accumulate=accumulate, depth=depth)
        config = (n_targets, n_drafters, accumulate, depth)
        assert [x for r in pipe.run(data) for x in r.losses()] == expected, config
        assert all(params_equal(d, reference) for d in drafters), config


def test_replicas_with_several_microbatches_each_agree_up_to_summation_order(lanes):
    data = make_data(24)
    expected, reference = sequential(data, 4)
    pipe, drafters = build(lanes, 2, 2, accumulate=4, depth=3)
    losses = [loss for r in pipe.run(data) for loss in r.losses()]
    assert losses[:4] == expected[:4]  # before the first step the weights are the same
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    assert params_equal(drafters[0], drafters[1])  # replicas apply one summed gradient
    for p, q in zip(drafters[0].parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_steps_limit_and_partial_trailing_step(lanes):
    data = make_data(10)
    pipe, _ = build(lanes, accumulate=4)
    assert [r.step for r in pipe.run(data, steps=1)] == [0]
    pipe2, drafters = build(lanes, accumulate=4)
    results = list(pipe2.run(data))  # 10 microbatches: two whole steps, two left over
    assert [r.step for r in results] == [0, 1]
    expected, reference = sequential(data, 4)
    assert [loss for r in results for loss in r.losses()] == expected
    assert params_equal(drafters[0], reference)


def test_a_later_run_continues_after_leaving_the_loop_early(lanes):
    data = make_data(24)
    expected, reference = sequential(data, 2)
    pipe, drafters = build(lanes, 2, 1, accumulate=2, depth=4)
    first = pipe.run(data)
    seen = next(first).losses()
    first.close()  # leaves the loop: queued microbatches are cancelled
    assert_idle(lanes)
    applied = pipe.stats()["steps"]  # steps whose microbatches had all trained still apply
    assert applied >= 1
    rest = list(pipe.run(data[applied * 2 :]))
    assert rest[0].step == applied
    assert seen == expected[:2]
    assert [loss for r in rest for loss in r.losses()] == expected[applied * 2 :]
    assert params_equal(drafters[0], reference)


def test_two_pipelines_driven_from_threads_on_a_barrier_match_the_loop():
    data = make_data(16)
    expected, reference = sequential(data, 2)
    n_threads, rounds = 3, 4
    barrier = threading.Barrier(n_threads)
    dispatchers = [pydflash.Dispatcher(["cpu"] * 2) for _ in range(n_threads)]

    def drive(index: int) -> list[bool]:
        outcomes = []
        for _ in range(rounds):
            pipe, drafters = build(dispatchers[index].lanes, accumulate=2, depth=2)
            barrier.wait(WAIT_S)
            losses = [loss for r in pipe.run(data) for loss in r.losses()]
            outcomes.append(losses == expected and params_equal(drafters[0], reference))
        return outcomes

    try:
        with concurrent.futures.ThreadPoolExecutor(n_threads) as pool:
            results = list(pool.map(drive, range(n_threads)))
    finally:
        for dispatcher in dispatchers:
            dispatcher.shutdown()
    assert results == [[True] * rounds] * n_threads


# --- prefetch depth and the bytes held -------------------------------------------------------
class Recorder:
    """A target and loss that record, for each target start, how many drafter
    microbatches had finished."""

    def __init__(self) -> None:
        self.target = Target()
        self.lock = threading.Lock()
        self.finished = 0
        self.finished_at_target_start: dict[int, int] = {}
        self.started = {}

    def started_event(self, k: int) -> threading.Event:
        with self.lock:
            return self.started.setdefault(k, threading.Event())

    def run_target(self, batch: dict) -> dict:
        k = int(batch["i"])
        with self.lock:
            self.finished_at_target_start[k] = self.finished
        self.started_event(k).set()
        return self.target(batch)

    def loss(self, drafter, inputs) -> torch.Tensor:
        value = drafter_loss(drafter, inputs)
        with self.lock:
            self.finished += 1
        return value


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_target_never_runs_more_than_depth_ahead(lanes, depth):
    rec = Recorder()
    pipe, _ = build(lanes, 2, 1, target=rec.run_target, loss=rec.loss, accumulate=2, depth=depth)
    list(pipe.run(make_data(20)))
    for k, finished in rec.finished_at_target_start.items():
        assert finished >= k - depth + 1, (k, finished)
    stats = pipe.stats()
    per_microbatch = stats["hidden_bytes_per_microbatch"]
    assert per_microbatch == 6 * 16 * 4 + 6 * 8 + 8  # h (float32), y and i (int64)
    assert per_microbatch <= stats["hidden_bytes_peak"] <= depth * per_microbatch


def test_the_hidden_byte_ledger_stays_within_the_window_over_a_long_run(lanes):
    # The ledger keeps an entry only for microbatches in the window, not one for every
    # microbatch that left.
    depth, n = 2, 300
    pipe, _ = build(lanes, depth=depth)
    data = make_data(8)
    for _ in pipe.run(data[i % len(data)] for i in range(n)):
        assert pipe._tracker.hidden_entries() <= depth
    stats = pipe.stats()
    assert stats["microbatches"] == n and stats["hidden_bytes_held"] == 0
    assert pipe._tracker.hidden_entries() == 0


def test_target_runs_ahead_while_the_drafter_trains(lanes):
    rec = Recorder()

    def loss(drafter, inputs):
        if int(inputs["i"]) == 0:  # fails the test unless target 2 runs while this trains
            assert rec.started_event(2).wait(WAIT_S), "the target did not run ahead"
        return rec.loss(drafter, inputs)

    pipe, _ = build(lanes, 1, 1, target=rec.run_target, loss=loss, accumulate=2, depth=3)
    list(pipe.run(make_data(8)))
    stats = pipe.stats()
    # Targets 0 and 1 were held together with 0 still training.
    assert 2 * stats["hidden_bytes_per_microbatch"] <= stats["hidden_bytes_peak"]
    assert stats["hidden_bytes_peak"] <= 3 * stats["hidden_bytes_per_microbatch"]


# --- failures ---------------------------------------------------------------------------------
class Boom(Exception):
    pass


def failing_data(data: list, at: int):
    for i, batch in enumerate(data):
        if i == at:
            raise Boom(f"no batch {i}")
        yield batch


class FailingOptimizer(torch.optim.SGD):
    def __init__(self, params, at_step: int) -> None:
        super().__init__(params, lr=0.1)
        self.at_step, self.steps = at_step, 0

    def step(self, closure=None):
        if self.steps == self.at_step:
            raise Boom(f"step {self.steps}")
        self.steps += 1
        return super().step(closure)


def run_failing(lanes, stage: str, at: int, *, accumulate=2, depth=3, n_drafters=1):
    """Runs a pipeline whose `stage` fails at microbatch (or step) `at`; returns the error
    and the microbatch indices the loss saw."""
    target = Target()
    seen = []

    def run_target(batch):
        if stage == "target" and int(batch["i"]) == at:
            raise Boom(f"target {at}")
        return target(batch)

    def loss(drafter, inputs):
        k = int(inputs["i"])
        seen.append(k)
        if stage == "drafter" and k == at:
            raise Boom(f"drafter {at}")
        if stage == "drafter-shape" and k == at:
            return drafter(inputs["h"]).sum(dim=1)
        return drafter_loss(drafter, inputs)

    data = make_data(16)
    batches = failing_data(data, at) if stage == "data" else data
    pairs = [make_drafter() for _ in range(n_drafters)]
    optimizers = [o for _, o in pairs]
    if stage == "optimizer":
        optimizers[-1] = FailingOptimizer(pairs[-1][0].parameters(), at)
    pipe = Pipeline(
        lanes[:1],
        lanes[1 : 1 + n_drafters],
        target=run_target,
        drafter=[d for d, _ in pairs],
        loss=loss,
        optimizer=optimizers,
        accumulate=accumulate,
        depth=depth,
    )
    with pytest.raises(PipelineError) as info:
        for _ in pipe.run(batches):
            pass
    assert_idle(lanes)
    return info.value, seen, pipe


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("stage", "at", "lane", "cause"),
    [
        ("data", 5, None, "no batch 5"),
        ("target", 3, "lane 0 (cpu)", "target 3"),
        ("drafter", 4, "lane 1 (cpu)", "drafter 4"),
        ("drafter-shape", 2, "lane 1 (cpu)", "expected loss() to return a scalar tensor"),
        ("optimizer", 1, "lane 1 (cpu)", "step 1"),
    ],
)
def test_a_failing_stage_raises_pipeline_error_naming_it(lanes, stage, at, lane, cause):
    error, seen, pipe = run_failing(lanes, stage, at)
    expected_stage = stage.split("-")[0]
    assert error.stage == expected_stage and expected_stage in STAGES
    assert error.lane == lane
    assert error.microbatch == (None if stage == "optimizer" else at)
    assert f"{expected_stage} stage failed" in str(error)
    if lane is not None:
        assert lane in str(error)
    if stage == "optimizer":
        assert f"of step {at}" in str(error)
    else:
        assert f"microbatch {at}" in str(error)
    assert cause in str(error.__cause__)
    if stage == "optimizer":
        assert pipe.stats()["steps"] == at
    else:
        assert pipe.stats()["steps"] <= at // 2  # the failing microbatch's step never applies
    if stage == "target":
        assert at not in seen
    with pytest.raises(PipelineError, match="stopped after a failure") as again:
        pipe.run(make_data(2))
    assert again.value.__cause__ is error


@pytest.mark.timeout(60)
def test_a_failing_transfer_names_the_drafter_lane(lanes, monkeypatch):
    real = microbatch_module.hand_to_lane
    calls = []

    def handoff(value, src, event, dst):
        calls.append(1)
        if len(calls) == 3:
            raise Boom("copy")
        return real(value, src, event, dst)

    monkeypatch.setattr(microbatch_module, "hand_to_lane", handoff)
    error, _, _ = run_failing(lanes, "none", -1)
    assert (error.stage, error.microbatch, error.lane) == ("transfer", 2, "lane 1 (cpu)")
    assert isinstance(error.__cause__, Boom)


@pytest.mark.timeout(60)
def test_a_failing_reduction_stops_every_replica(lanes, monkeypatch):
    real = drafter_module.hand_to_lane

    def handoff(value, src, event, dst):
        if isinstance(value, list):  # the replicas' gradients
            raise Boom("reduce")
        return real(value, src, event, dst)

    monkeypatch.setattr(drafter_module, "hand_to_lane", handoff)
    error, _, pipe = run_failing(lanes, "none", -1, n_drafters=2)
    assert (error.stage, error.microbatch, error.lane) == ("reduce", None, "lane 1 (cpu)")
    assert "of step 0" in str(error)
    assert pipe.stats()["steps"] == 0


@pytest.mark.timeout(60)
def test_queued_work_is_cancelled_when_a_target_fails(lanes):
    target = Target()
    failing = threading.Event()
    seen = []

    def run_target(batch):
        if int(batch["i"]) == 2:
            failing.set()
            raise Boom("target 2")
        return target(batch)

    def loss(drafter, inputs):
        k = int(inputs["i"])
        seen.append(k)
        if k == 0:
            # Hold microbatch 0 until the pipeline has cancelled what was queued behind it.
            assert failing.wait(WAIT_S)
            deadline = time.monotonic() + WAIT_S
            while pipe.stats()["cancelled"] == 0:
                assert time.monotonic() < deadline, "queued work was not cancelled"
                time.sleep(0.001)
        return drafter_loss(drafter, inputs)

    drafter, optimizer = make_drafter()
    before = [p.clone() for p in drafter.parameters()]
    pipe = Pipeline(
        lanes[:1],
        lanes[1:2],
        target=run_target,
        drafter=drafter,
        loss=loss,
        optimizer=optimizer,
        accumulate=4,
        depth=4,
    )
    with pytest.raises(PipelineError) as info:
        list(pipe.run(make_data(16)))
    assert (info.value.stage, info.value.microbatch) == ("target", 2)
    assert seen == [0]  # microbatch 1 was queued behind 0 and cancelled
    assert pipe.stats()["cancelled"] >= 1
    # No step:
    assert all(torch.equal(p, q) for p, q in zip(drafter.parameters(), before, strict=True))
    assert_idle(lanes)


@pytest.mark.timeout(120)
def test_random_failures_always_stop_cleanly(lanes):
    rng = random.Random(7)
    stages = ["data", "target", "drafter", "optimizer"]
    for _ in range(40):
        stage = rng.choice(stages)
        at = rng.randrange(0, 6 if stage == "optimizer" else 14)
        depth, n_drafters = rng.randint(1, 4), rng.choice([1, 2])
        error, _, _ = run_failing(lanes, stage, at, depth=depth, n_drafters=n_drafters)
        assert error.stage == stage
        assert error.microbatch == (None if stage == "optimizer" else at)
        assert isinstance(error.__cause__, Boom)


# --- the graph-target hook --------------------------------------------------------------------
class FakeCapturedGraph:
    """Stands in for pydflash.graphs.CapturedGraph on a CPU lane: every replay writes
    into the same static output, as a CUDA graph does."""

    def __init__(self, lane, model) -> None:
        self.lane, self.model = lane, model
        self.static = {
            "h": torch.zeros(6, 16),
            "y": torch.zeros(6, dtype=torch.long),
            "i": torch.zeros((), dtype=torch.long),
        }

    def _replay(self, x, y, i):
        with torch.no_grad():
            self.static["h"].copy_(self.model(x))
            self.static["y"].copy_(y)
            self.static["i"].copy_(i)
        return self.static

    def run(self, x, y, i):
        return self.lane.submit(self._replay, x, y, i)


def test_graph_target_clones_static_outputs_before_the_next_replay(lanes):
    data = make_data(16)
    expected, reference = sequential(data, 2)
    graph = FakeCapturedGraph(lanes[0], make_target())
    stage = GraphTarget(graph, inputs=lambda b: (b["x"], b["y"], b["i"]))
    pipe, drafters = build(lanes, 1, 1, target=stage, accumulate=2, depth=4)
    assert [loss for r in pipe.run(data) for loss in r.losses()] == expected
    assert params_equal(drafters[0], reference)


def test_graph_target_must_run_on_its_own_lane(lanes):
    stage = GraphTarget(FakeCapturedGraph(lanes[0], make_target()))
    with pytest.raises(ValueError, match="the graph's own lane"):
        build(lanes[1:], 1, 1, target=stage)
    with pytest.raises(TypeError, match="run"):
        GraphTarget(object())


def test_a_custom_target_stage_is_used_as_given(lanes):
    class Doubling(TargetStage):
        def submit(self, lane, batch):
            target = Target()
            return lane.submit(lambda: {**target(batch), "h": 2 * target(batch)["h"]})

    seen = []

    def loss(drafter, inputs):
        seen.append(inputs["h"])
        return drafter_loss(drafter, inputs)

    pipe, _ = build(lanes, target=Doubling(), loss=loss)
    list(pipe.run(make_data(2)))
    model = make_target()
    assert torch.equal(seen[0], 2 * model(make_data(1)[0]["x"]))


# --- threads and input checks -----------------------------------------------------------------
def test_backward_runs_on_the_drafter_lane_thread(lanes):
    threads = {}

    def record_backward(grad):
        threads["backward"] = threading.get_ident()

    def loss(drafter, inputs):
        threads["forward"] = threading.get_ident()
        h = inputs["h"].clone().requires_grad_(True)
        h.register_hook(record_backward)
        return drafter_loss(drafter, {**inputs, "h": h})

    pipe, _ = build(lanes, loss=loss)
    list(pipe.run(make_data(1)))
    assert threads["backward"] == threads["forward"] != threading.get_ident()


def test_the_callers_intra_op_thread_count_applies_on_the_lanes(lanes):
    seen = []
    previous = torch.get_num_threads()
    target = Target()

    def run_target(batch):
        seen.append(("target", torch.get_num_threads()))
        return target(batch)

    def loss(drafter, inputs):
        seen.append(("drafter", torch.get_num_threads()))
        return drafter_loss(drafter, inputs)

    pipe, _ = build(lanes, target=run_target, loss=loss)
    list(pipe.run(make_data(1)))  # the lanes start torch with the current count
    seen.clear()
    torch.set_num_threads(previous + 1)
    try:
        list(pipe.run(make_data(1)))
    finally:
        torch.set_num_threads(previous)
    assert seen == [("target", previous + 1), ("drafter", previous + 1)]


def test_step_result_reports_the_mean_loss(lanes):
    pipe, _ = build(lanes, accumulate=2)
    (result,) = pipe.run(make_data(2))
    assert isinstance(result, StepResult)
    assert result.loss() == sum(result.losses()) / 2


def test_a_pipeline_runs_one_loop_at_a_time(lanes):
    pipe, _ = build(lanes)
    first = pipe.run(make_data(4))
    next(first)
    with pytest.raises(PipelineError, match="already running"):
        next(pipe.run(make_data(4)))
    first.close()


def test_one_module_or_optimizer_given_for_two_replicas_is_refused(lanes):
    # Replicas share nothing: one module (or optimizer) given twice would train as two
    # replicas on the same weights and return wrong losses.
    drafter, optimizer = make_drafter()
    other, other_opt = make_drafter()
    args = {"target": Target(), "loss": drafter_loss, "accumulate": 2}
    given = [
        ({"drafter": [drafter, drafter], "optimizer": [optimizer, other_opt]}, "drafter"),
        ({"drafter": [drafter, other], "optimizer": [optimizer, optimizer]}, "optimizer"),
    ]
    for kwargs, name in given:
        with pytest.raises(ValueError) as refused:
            Pipeline(lanes[:1], lanes[1:3], **args, **kwargs)
        assert str(refused.value) == (
            f"expected a distinct {name} per drafter lane, got the same {name} for drafter "
            "lanes 0 and 1"
        )


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"accumulate": 0}, ValueError, "expected accumulate >= 1, got 0"),
        ({"accumulate": 1.5}, TypeError, "expected accumulate to be an int, got float"),
        ({"accumulate": 10**30}, ValueError, f"expected accumulate <= {2**63 - 1}, got 1000"),
        ({"depth": 0}, ValueError, "expected depth >= 1, got 0"),
        ({"clip_grad_norm": -1.0}, ValueError, "expected clip_grad_norm > 0 or None"),
        ({"loss": 3}, TypeError, "expected a callable loss"),
        ({"target": 3}, TypeError, "expected target to be a callable or TargetStage"),
        ({"target": [Target(), Target()]}, ValueError, "expected 1 targets"),
        ({"drafter": "x"}, TypeError, "expected drafter to be a torch.nn.Module"),
        ({"optimizer": None}, TypeError, "expected optimizer to be a torch.optim.Optimizer"),
    ],
)
def test_bad_arguments_raise_typed_errors(lanes, kwargs, error, message):
    drafter, optimizer = make_drafter()
    args = {"target": Target(), "drafter": drafter, "loss": drafter_loss, "optimizer": optimizer}
    args.update(kwargs)
    with pytest.raises(error, match=message):
        Pipeline(lanes[:1], lanes[1:2], **args)


def test_bad_lanes_and_replicas_raise_typed_errors(lanes):
    drafter, optimizer = make_drafter()
    args = {"target": Target(), "drafter": drafter, "loss": drafter_loss, "optimizer": optimizer}
    with pytest.raises(ValueError, match="at least one lane in target_lanes"):
        Pipeline([], lanes[1:2], **args)
    with pytest.raises(TypeError, match="expected drafter_lanes to be pydflash lanes, got a str"):
        Pipeline(lanes[:1], ["cpu"], **args)
    with pytest.raises(ValueError, match="distinct drafter lanes"):
        Pipeline(
            lanes[:1],
            [lanes[1], lanes[1]],
            **{**args, "drafter": [drafter] * 2, "optimizer": [optimizer] * 2, "accumulate": 2},
        )
    with pytest.raises(ValueError, match="one drafter per drafter lane"):
        Pipeline(lanes[:1], lanes[1:3], **{**args, "accumulate": 2})
    other, other_opt = make_drafter()
    with pytest.raises(ValueError, match="multiple of the 2 drafter lanes, got 3"):
        Pipeline(
            lanes[:1],
            lanes[1:3],
            **{
                **args,
                "drafter": [drafter, other],
                "optimizer": [optimizer, other_opt],
                "accumulate": 3,
            },
        )
    with pytest.raises(ValueError, match="optimizer 0 over drafter 0's parameters"):
        Pipeline(
            lanes[:1],
            lanes[1:3],
            **{
                **args,
                "drafter": [drafter, other],
                "optimizer": [other_opt, optimizer],
                "accumulate": 2,
            },
        )
    small = torch.nn.Linear(16, 5)
    small_opt = torch.optim.SGD(small.parameters(), lr=1)
    with pytest.raises(ValueError, match="replicas of one shape"):
        Pipeline(
            lanes[:1],
            lanes[1:3],
            **{
                **args,
                "drafter": [drafter, small],
                "accumulate": 2,
                "optimizer": [optimizer, small_opt],
            },
        )
    pipe = Pipeline(lanes[:1], lanes[1:2], **args)
    with pytest.raises(TypeError, match="expected an iterable of batches, got int"):
        pipe.run(3)
    with pytest.raises(ValueError, match="expected steps >= 1, got 0"):
        pipe.run([], steps=0)


# --- GPU lanes (run with `pytest -m gpu` on a CUDA machine) ---------------------------------
def gpu_pairs() -> list:
    pairs = [pytest.param(("cuda:0", "cuda:0"), id="one-gpu-two-lanes")]
    pairs.append(
        pytest.param(
            ("cuda:0", "cuda:1"),
            id="two-gpus",
            marks=pytest.mark.skipif(
                torch.cuda.device_count() < 2, reason="needs two CUDA devices"
            ),
        )
    )
    return pairs


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("devices", gpu_pairs())
def test_gpu_handoff_is_ordered_after_the_targets_kernels(devices):
    """The target queues 2 ms of busy GPU work before it writes its output; a drafter
    reading without the event wait would see the buffer before the write."""
    n = 1 << 22
    dispatcher = pydflash.Dispatcher(list(devices))
    t_lane, d_lane = dispatcher.lanes

    def run_target(batch):
        out = torch.empty(n, device=t_lane.device)
        pydflash._C.busy_wait(torch.cuda.current_stream().cuda_stream, 2_000_000, 1)
        out.fill_(float(batch["i"]))
        return {"h": out, "i": batch["i"]}

    weight = torch.nn.Linear(1, 1, bias=False, device=d_lane.device)
    torch.nn.init.ones_(weight.weight)

    def loss(model, inputs):  # exactly 0 when every element holds the microbatch's index
        error = (inputs["h"] - inputs["i"].to(inputs["h"].dtype)).abs().max()
        return model(error.reshape(1, 1)).sum()

    pipe = Pipeline(
        [t_lane],
        [d_lane],
        target=run_target,
        drafter=weight,
        loss=loss,
        optimizer=torch.optim.SGD(weight.parameters(), lr=0.0),
        accumulate=2,
        depth=3,
    )
    try:
        losses = [x for r in pipe.run(make_data(16)) for x in r.losses()]
    finally:
        dispatcher.shutdown()
    assert losses == [0.0] * 16
    stats = pipe.stats()
    copies = 2 if devices[0] != devices[1] else 1  # the target's result, and its copy
    assert stats["hidden_bytes_per_microbatch"] == copies * (4 * n + 8)  # h and i
    assert stats["hidden_bytes_peak"] <= 3 * stats["hidden_bytes_per_microbatch"]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("devices", gpu_pairs())
def test_gpu_pipeline_matches_the_sequential_loop(devices):
    target_device, drafter_device = devices
    data = make_data(16)
    target = make_target().to(target_device)
    drafter, reference = make_drafter()[0].to(drafter_device), make_drafter()[0].to(drafter_device)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    expected = []
    for s in range(8):
        for batch in data[2 * s : 2 * s + 2]:
            with torch.no_grad():
                h = target(batch["x"].to(target_device)).to(drafter_device)
            loss = drafter_loss(reference, {"h": h, "y": batch["y"].to(drafter_device)})
            (loss / 2).backward()
            expected.append(loss.item())
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    def run_target(batch):
        return {"h": target(batch["x"]), "y": batch["y"]}

    dispatcher = pydflash.Dispatcher(list(devices))
    try:
        pipe = Pipeline(
            dispatcher.lanes[:1],
            dispatcher.lanes[1:],
            target=run_target,
            drafter=drafter,
            loss=drafter_loss,
            optimizer=optimizer,
            accumulate=2,
            depth=3,
        )
        losses = [x for r in pipe.run(data) for x in r.losses()]
    finally:
        dispatcher.shutdown()
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    for p, q in zip(drafter.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
