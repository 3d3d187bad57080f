"""DrafterGraphs: the padding contract, the static gradients, the step, fallbacks and
eviction (pydflash/pipeline/stages/drafter_graphs.py).

The CPU tests run the padded path eagerly on CPU lanes (there are no graphs on CPU): a
padded microbatch must give the loss and gradients of the unpadded one. The bookkeeping
of captured graphs (replay, eviction, memory cap, a changed hyperparameter) is tested on
CPU with a recording stand-in for the capture; the GPU tests capture real graphs."""

from __future__ import annotations

import copy
import random
import sys

import pytest
import torch
import torch.nn.functional as F

import pydflash
from pydflash import GraphFallbackWarning, GraphMemoryError
from pydflash.graphs import _cuda_capture, lane_cache, policy
from pydflash.graphs import lane_graph as graphs
from pydflash.pipeline.stages import EagerDrafter
from pydflash.pipeline.stages import drafter_graphs as dg
from pydflash.pipeline.stages.drafter_graphs import DrafterGraphs
from tests.test_graph_cache import FakeEvent

VOCAB, WIDTH = 11, 8


class Toy(torch.nn.Module):
    """A causal drafter: a running mean over positions, a linear head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)
        self.frozen = torch.nn.Linear(WIDTH, WIDTH).requires_grad_(False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, h.shape[1] + 1, device=h.device, dtype=h.dtype)
        running = self.frozen(h).cumsum(1) / steps[None, :, None]
        return self.head(torch.tanh(self.proj(running)))


def masked_loss(drafter, inputs, lengths=None):
    """Mean token cross entropy over the real positions (Note [Padding contract])."""
    logits = drafter(inputs["h"])
    ce = F.cross_entropy(logits.flatten(0, 1), inputs["y"].flatten(), reduction="none")
    ce = ce.view(inputs["y"].shape)
    if lengths is None:
        return ce.mean()
    real = torch.arange(ce.shape[1], device=ce.device)[None, :] < lengths[:, None]
    return (ce * real).sum() / real.sum()


def microbatches(count: int, seed: int = 0, lengths=(5, 9, 13, 16, 3, 7)) -> list[dict]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        b, t = rng.choice([1, 2, 3]), rng.choice(lengths)
        out.append(
            {
                "h": torch.randn(b, t, WIDTH, generator=g),
                "y": torch.randint(0, VOCAB, (b, t), generator=g),
            }
        )
    return out


@pytest.fixture
def lanes():
    dispatcher = pydflash.Dispatcher(["cpu"] * 2)
    yield dispatcher.lanes
    dispatcher.shutdown(cancel_futures=True)


def make(kind, lanes, n=1, *, clip=None, lr=0.05, loss=masked_loss, **kwargs):
    drafters = [Toy() for _ in range(n)]
    optimizers = [torch.optim.AdamW(d.parameters(), lr=lr) for d in drafters]
    stage = kind(
        lanes[:n],
        drafter=drafters if n > 1 else drafters[0],
        loss=loss,
        optimizer=optimizers if n > 1 else optimizers[0],
        accumulate=kwargs.pop("accumulate", 2),
        clip_grad_norm=clip,
        **kwargs,
    )
    return stage, drafters


def train_steps(stage, data, accumulate=2):
    """Drives the stage as Pipeline does with one replica; returns the losses."""
    lane = stage.lanes[0]
    lane.submit(stage.zero_grad, 0).result()
    losses = []
    for s in range(len(data) // accumulate):
        for x in data[s * accumulate : (s + 1) * accumulate]:
            # wait_stream: the loss is made on the lane's stream, and read on this one.
            losses.append(lane.submit(stage.train, 0, x, all_reduce=True).wait_stream())
        lane.submit(stage.step, s, 0, None).result()
    if lane.is_gpu:  # the parameters are read on this thread's stream next
        torch.cuda.synchronize(lane.device)
    return [float(x) for x in losses]


# Capturable optimizers compute on tensors (lr, bias corrections) where plain ones use
# Python floats: the same math, rounded differently.
CAPTURABLE = dict(rtol=1e-4, atol=1e-5)


def assert_same_training(a, b, *, rtol=1e-5, atol=1e-6):
    (losses_a, drafter_a), (losses_b, drafter_b) = a, b
    torch.testing.assert_close(losses_a, losses_b, rtol=rtol, atol=atol)
    for p, q in zip(drafter_a.parameters(), drafter_b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol)


# --- the padding contract ------------------------------------------------------------------
@pytest.mark.parametrize("clip", [None, 0.05])
def test_padded_microbatches_train_as_the_eager_drafter_does(lanes, clip):
    data = microbatches(12)
    eager, eager_drafters = make(EagerDrafter, lanes, clip=clip)
    graphs, graph_drafters = make(DrafterGraphs, lanes, clip=clip, lengths=(4, 8, 16))
    expected = train_steps(eager, data), eager_drafters[0]
    got = train_steps(graphs, data), graph_drafters[0]
    assert_same_training(got, expected)
    assert graphs.stats()["fallbacks"] == {}


def test_a_loss_that_ignores_lengths_is_not_padding_safe(lanes):
    # The contract is the loss's to keep: averaged over the padded shape, it differs.
    def shape_mean(drafter, inputs, lengths=None):
        return masked_loss(drafter, inputs)

    x = {"h": torch.randn(2, 5, WIDTH), "y": torch.randint(0, VOCAB, (2, 5))}
    unpadded = masked_loss(Toy(), x)
    for loss, equal in ((masked_loss, True), (shape_mean, False)):
        stage, _ = make(DrafterGraphs, lanes, lengths=(8,), accumulate=1, loss=loss)
        padded = lanes[0].submit(stage.train, 0, x, all_reduce=True).result()
        assert torch.allclose(padded, unpadded) == equal


def test_the_loss_sees_each_rows_real_length(lanes):
    seen = []

    def loss(drafter, inputs, lengths):
        seen.append((tuple(inputs["h"].shape), lengths.tolist()))
        return masked_loss(drafter, inputs, lengths)

    stage, _ = make(DrafterGraphs, lanes, lengths=(4, 8), batch_sizes=(2, 4), loss=loss)
    x = {"h": torch.randn(3, 5, WIDTH), "y": torch.randint(0, VOCAB, (3, 5))}
    lanes[0].submit(stage.train, 0, x, all_reduce=True).result()
    assert seen == [((4, 8, WIDTH), [5, 5, 5, 0])]


def test_gradients_are_static_views_into_one_flat_buffer(lanes):
    stage, (drafter,) = make(DrafterGraphs, lanes)
    grads = [p.grad for p in drafter.parameters() if p.requires_grad]
    flat = stage._replicas[0].flats[0]
    assert all(g.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for g in grads)
    assert flat.numel() == sum(g.numel() for g in grads)
    assert drafter.frozen.weight.grad is None
    train_steps(stage, microbatches(4))
    assert [p.grad for p in drafter.parameters() if p.requires_grad] == grads
    assert flat.abs().sum() == 0  # the step zeroed them
    drafter.zero_grad(set_to_none=True)  # a caller drops them: a run puts them back
    lanes[0].submit(stage.zero_grad, 0).result()
    assert all(p.grad is g for p, g in zip(drafter.parameters(), grads, strict=False))


# --- fallbacks -------------------------------------------------------------------------------
def test_a_microbatch_above_the_largest_bucket_runs_eagerly_and_warns_once(lanes):
    data = microbatches(4, lengths=(12, 16))
    eager, eager_drafters = make(EagerDrafter, lanes)
    graphs, graph_drafters = make(DrafterGraphs, lanes, lengths=(4, 8))
    expected = train_steps(eager, data), eager_drafters[0]
    with pytest.warns(
        GraphFallbackWarning, match=r"runs eagerly \(too long\): a microbatch of \d+ x 1[26]"
    ) as w:
        got = train_steps(graphs, data), graph_drafters[0]
    assert len([x for x in w if issubclass(x.category, GraphFallbackWarning)]) == 1
    assert_same_training(got, expected)
    stats = graphs.stats()
    assert stats["fallbacks"]["too long"]["count"] == 4
    assert stats["lanes"][lanes[0].label]["eager_runs"] == 4


def test_argument_errors(lanes):
    with pytest.raises(ValueError, match="on_full in"):
        make(DrafterGraphs, lanes, on_full="drop")
    with pytest.raises(ValueError, match="lengths as positive ints"):
        make(DrafterGraphs, lanes, lengths=[0])
    with pytest.raises(TypeError, match="pad_value"):
        make(DrafterGraphs, lanes, pad_value="x")


# --- captured graphs, with a recording stand-in for the capture on CPU ------------------------
class RecordedGraph:
    """Runs what was recorded on each replay, writing its output into the static one."""

    def __init__(self, run, out):
        self.run, self.out = run, out

    def replay(self):
        value = self.run()
        if value is not None:  # the step graph has no output
            self.out.copy_(value)


def capturable_on_cpu(monkeypatch):
    """torch's optimizers refuse capturable=True for CPU tensors (the devices that
    `torch.optim.optimizer._get_capturable_supported_devices` lists); the CPU tests add
    "cpu" to that list in every optimizer module, so the capturable code paths that a
    captured step takes on a GPU (tensor lr, steps as tensors) run here too."""
    for name, module in list(sys.modules.items()):
        real = getattr(module, "_get_capturable_supported_devices", None)
        if name.startswith("torch.optim") and real is not None:

            def with_cpu(supports_xla=True, real=real):
                return [*real(supports_xla), "cpu"]

            monkeypatch.setattr(module, "_get_capturable_supported_devices", with_cpu)


@pytest.fixture
def recorded(monkeypatch):
    """CPU lanes behave as capturing lanes: the capture warms up, then keeps the callable
    instead of a graph (running nothing, as a capture does), and pools report 1000 bytes
    per graph."""
    made = []

    def capture_graph(fn, lane, *, pool, warmup, **_):
        for _ in range(warmup):
            fn()
        out = torch.zeros(())  # a capture runs nothing: the output is a placeholder
        made.append(RecordedGraph(fn, out))
        return graphs.Captured(made[-1], out)

    monkeypatch.setattr(graphs, "capture_graph", capture_graph)
    monkeypatch.setattr(lane_cache, "_new_pool", lambda: "pool")
    monkeypatch.setattr(lane_cache, "pool_bytes", lambda pool, device: 1000 * len(made))
    monkeypatch.setattr(dg, "_captures", lambda lane: True)
    monkeypatch.setattr(lane_cache, "PROBE_AT", 0)  # no CUDA events to time eager calls
    capturable_on_cpu(monkeypatch)
    return made


def test_replayed_buckets_and_step_train_as_the_eager_drafter_does(lanes, recorded):
    data = microbatches(12)
    eager, eager_drafters = make(EagerDrafter, lanes, clip=0.05)
    graphs, graph_drafters = make(DrafterGraphs, lanes, clip=0.05, lengths=(4, 8, 16))
    expected = train_steps(eager, data), eager_drafters[0]
    got = train_steps(graphs, data), graph_drafters[0]
    assert_same_training(got, expected, **CAPTURABLE)
    stats = graphs.stats()["lanes"][lanes[0].label]
    buckets = {
        (x["h"].shape[0], 4 if x["h"].shape[1] <= 4 else 8 if x["h"].shape[1] <= 8 else 16)
        for x in data
    }
    assert stats["captures"] == len(buckets) + 1  # each bucket once, and the step
    assert stats["replays"] == len(data) + 5  # and the step graph, from the second step
    assert (stats["step"], stats["step_eager_runs"], stats["step_replays"]) == ("graph", 1, 5)


@pytest.mark.parametrize(
    ("host_ms", "busy", "captured"), [(1.0, None, True), (0.1, None, False), (1.0, 0.99, False)]
)
def test_auto_policy_judges_the_optimizer_step_as_a_bucket(
    lanes, recorded, monkeypatch, host_ms, busy, captured
):
    """Note [A policy for the whole step]: every eager call of this stage ran 0.5 ms on the
    GPU and took the host `host_ms` to launch, on a device NVML read `busy`. The step, from
    the third, is timed twice, then captured only where its launch limits it (Note
    [Capturing a training step]); a GPU-bound step, or one on a busy device, stays eager."""
    monkeypatch.setattr(lane_cache, "PROBE_AT", 2)
    clock = iter(range(0, 10**6))
    monkeypatch.setattr(policy, "perf_counter", lambda: next(clock) * host_ms / 1000)
    monkeypatch.setattr(_cuda_capture, "timing_events", lambda: (FakeEvent(0.0), FakeEvent(0.5)))
    monkeypatch.setattr(_cuda_capture, "device_busy", lambda device: busy)
    stage, _ = make(DrafterGraphs, lanes, lengths=(16,), accumulate=1)
    train_steps(stage, microbatches(8), accumulate=1)
    stats = stage.stats()
    lane = stats["lanes"][lanes[0].label]
    # Steps 1-2 eager, 3-4 timed, from 5 the graph.
    expected = ("graph", 4, 4) if captured else ("eager", 8, 0)
    assert (lane["step"], lane["step_eager_runs"], lane["step_replays"]) == expected
    judged = [e["bucket"] for e in stats["eager_buckets"]]
    assert (dg.STEP in judged) is not captured


def test_least_recently_used_graphs_are_evicted(lanes, recorded):
    stage, _ = make(DrafterGraphs, lanes, lengths=(4, 8, 16), max_graphs=2, accumulate=1)
    shapes = [(1, 3), (1, 7), (1, 3), (1, 15), (1, 7)]
    data = [
        {"h": torch.randn(b, t, WIDTH), "y": torch.randint(0, VOCAB, (b, t))} for b, t in shapes
    ]
    for x in data:
        lanes[0].submit(stage.train, 0, x, all_reduce=True).result()
    stats = stage.stats()["lanes"][lanes[0].label]
    # 4 and 8 captured; 4 used again; 16 evicts 8; 8 evicts 4.
    assert stats["buckets"] == [(1, 16), (1, 8)]
    assert (stats["captures"], stats["evictions"], stats["replays"]) == (4, 2, 5)


@pytest.mark.parametrize("on_full", ["eager", "raise"])
def test_the_memory_cap_refuses_a_capture(lanes, recorded, on_full):
    stage, _ = make(DrafterGraphs, lanes, lengths=(4, 8), max_pool_bytes=1500, on_full=on_full)
    small = {"h": torch.randn(1, 3, WIDTH), "y": torch.randint(0, VOCAB, (1, 3))}
    large = {"h": torch.randn(1, 7, WIDTH), "y": torch.randint(0, VOCAB, (1, 7))}
    lanes[0].submit(stage.train, 0, small, all_reduce=True).result()
    if on_full == "raise":
        with pytest.raises(GraphMemoryError, match="max_pool_bytes=1500"):
            lanes[0].submit(stage.train, 0, large, all_reduce=True).result()
        return
    with pytest.warns(GraphFallbackWarning, match="max_pool_bytes=1500"):
        lanes[0].submit(stage.train, 0, large, all_reduce=True).result()
    lanes[0].submit(stage.train, 0, large, all_reduce=True).result()  # eager, no new capture
    stats = stage.stats()
    assert stats["lanes"][lanes[0].label]["buckets"] == [(1, 4)]
    assert stats["fallbacks"]["memory cap"]["count"] == 2


def test_a_scheduled_tensor_lr_reaches_the_captured_step(lanes, recorded):
    data = microbatches(12)
    runs = []
    for kind in (EagerDrafter, DrafterGraphs):
        drafter = Toy()
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
        stage = kind(
            lanes[:1],
            drafter=drafter,
            loss=masked_loss,
            optimizer=optimizer,
            accumulate=2,
            scheduler=scheduler,
            **({"lengths": (4, 8, 16)} if kind is DrafterGraphs else {}),
        )
        runs.append((train_steps(stage, data), drafter))
    assert_same_training(runs[1], runs[0], **CAPTURABLE)


def test_a_changed_plain_hyperparameter_makes_the_step_eager(lanes, recorded):
    stage, _ = make(DrafterGraphs, lanes, lengths=(16,))
    optimizer = stage.training.optimizers[0]
    data = microbatches(8)
    train_steps(stage, data[:4])
    optimizer.param_groups[0]["weight_decay"] = 0.5
    with pytest.warns(GraphFallbackWarning, match="not a tensor changed"):
        train_steps(stage, data[4:])
    stats = stage.stats()
    assert (stats["lanes"][lanes[0].label]["step_eager_runs"]) == 3  # the first and the last two
    assert stats["fallbacks"]["hyperparameter"]["count"] == 2


# --- every torch optimizer with `capturable` (Note [Capturable optimizers]) ----------------
OPTIMIZERS = {
    "Adam": lambda ps: torch.optim.Adam(ps, lr=0.05),
    "Adam fused": lambda ps: torch.optim.Adam(ps, lr=0.05, fused=True),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
    "AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, fused=True),
    "AdamW foreach amsgrad": lambda ps: torch.optim.AdamW(ps, lr=0.05, foreach=True, amsgrad=True),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=0.05),
    "ASGD": lambda ps: torch.optim.ASGD(ps, lr=0.05),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=0.05),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=0.05),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01),
    "Rprop": lambda ps: torch.optim.Rprop(ps, lr=0.01),
    "Adadelta": lambda ps: torch.optim.Adadelta(ps, lr=0.5),
}


def test_every_torch_optimizer_with_capturable_is_listed():
    """A torch release that adds `capturable` to another optimizer fails here first."""
    import inspect

    with_option = {
        name
        for name, cls in vars(torch.optim).items()
        if isinstance(cls, type)
        and issubclass(cls, torch.optim.Optimizer)
        and "capturable" in inspect.signature(cls.__init__).parameters
    }
    assert with_option == {name.split()[0] for name in OPTIMIZERS}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_make_capturable_configures_each_optimizer_and_its_steps_are_unchanged(kind, monkeypatch):
    capturable_on_cpu(monkeypatch)
    torch.manual_seed(0)
    reference, made = Toy(), Toy()
    made.load_state_dict(reference.state_dict())
    plain, optimizer = OPTIMIZERS[kind](reference.parameters()), OPTIMIZERS[kind](made.parameters())
    plain.step()  # no gradients yet: state stays empty, as a first step may leave it
    data = microbatches(4, seed=7)
    for model, opt in ((reference, plain), (made, optimizer)):
        loss = masked_loss(model, data[0])
        loss.backward()
        opt.step()  # the state exists before make_capturable, as after a checkpoint load
        opt.zero_grad()
    hypers = dg.make_capturable(optimizer, torch.device("cpu"))
    for group in optimizer.param_groups:
        assert group["capturable"] is True
        lr = group["lr"]
        assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float32 and lr.numel() == 1
    assert [h[2] for h in hypers] == [g["lr"] for g in optimizer.param_groups]
    assert all(
        v.dtype == torch.float32
        for st in optimizer.state.values()
        for k, v in st.items()
        if k == "step"
    )
    for x in data[1:]:
        for model, opt in ((reference, plain), (made, optimizer)):
            masked_loss(model, x).backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(made.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, **CAPTURABLE)
    assert dg.host_state(optimizer, torch.device("cpu")) is None


def test_host_state_names_what_a_replay_would_leave_behind():
    drafter = Toy()
    adagrad = torch.optim.Adagrad(drafter.parameters(), lr=0.1)  # its step count on the host
    masked_loss(drafter, microbatches(1)[0]).backward()
    adagrad.step()
    assert "state['step'] on cpu" in dg.host_state(adagrad, torch.device("cuda:0"))
    sgd = torch.optim.SGD(drafter.parameters(), lr=0.1, momentum=0.9)
    sgd.step()
    assert dg.host_state(sgd, torch.device("cpu")) is None
    sgd.state[drafter.head.weight]["count"] = 3  # a Python number a replay cannot advance
    assert "on the host (int)" in dg.host_state(sgd, torch.device("cpu"))
    adam = torch.optim.Adam(drafter.parameters(), capturable=False)
    assert "capturable=False" in dg.host_state(adam, torch.device("cpu"))


def test_an_optimizer_with_host_state_steps_eagerly_and_buckets_keep_replaying(lanes, recorded):
    drafter = Toy()
    stage = DrafterGraphs(
        lanes[:1],
        drafter=drafter,
        loss=masked_loss,
        optimizer=torch.optim.SGD(drafter.parameters(), lr=0.1),
        accumulate=2,
        lengths=(16,),
        policy="graphs",
    )
    stage.training.optimizers[0].state[drafter.head.weight]["count"] = 0  # host state
    data = microbatches(8)
    with pytest.warns(GraphFallbackWarning, match="optimizer not capturable") as warned:
        train_steps(stage, data)
    assert len([w for w in warned if "not capturable" in str(w.message)]) == 1
    stats = stage.stats()
    lane = stats["lanes"][lanes[0].label]
    assert (lane["step"], lane["step_eager_runs"], lane["step_replays"]) == ("eager", 4, 0)
    assert lane["replays"] == 8  # every microbatch, the capturing ones too
    assert lane["capture_attempts"] == len(lane["buckets"])  # the step was never tried
    assert stats["fallbacks"]["optimizer not capturable"]["count"] == 3


# --- replicas -------------------------------------------------------------------------------
def test_two_replicas_sum_their_flat_gradients(lanes):
    data = microbatches(8)
    eager, _ = make(EagerDrafter, lanes, n=2)
    graphs, drafters = make(DrafterGraphs, lanes, n=2)
    for stage in (eager, graphs):
        for r in range(2):
            stage.lanes[r].submit(stage.zero_grad, r).result()
        for s in range(4):
            futures = [
                stage.lanes[r].submit(stage.train, r, data[2 * s + r], all_reduce=True)
                for r in range(2)
            ]
            [f.result() for f in futures]
            total = stage.lanes[0].submit(stage.reduce, s, [None, None]).result()
            for r in range(2):
                stage.lanes[r].submit(stage.step, s, r, (total, None)).result()
    for p, q in zip(drafters[0].parameters(), drafters[1].parameters(), strict=True):
        assert torch.equal(p, q)
    for p, q in zip(drafters[0].parameters(), eager.training.drafters[0].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# --- in a pipeline ---------------------------------------------------------------------------
def identity_target(batch):
    return batch


@pytest.mark.parametrize("n_drafters", [1, 2])
def test_a_pipeline_with_graph_drafters_trains_as_with_eager_ones(n_drafters):
    data = microbatches(12, seed=5)
    results = []
    for kind in (EagerDrafter, DrafterGraphs):
        with pydflash.Dispatcher(["cpu"] * (1 + n_drafters)) as d:
            stage, drafters = make(kind, d.lanes[1:], n=n_drafters, clip=0.5, accumulate=2)
            pipe = pydflash.Pipeline(
                d.lanes[:1], d.lanes[1:], target=identity_target, drafter=stage, accumulate=2
            )
            losses = [x for step in pipe.run(data) for x in step.losses()]
            assert pipe.stats()["steps"] == 6
            results.append((losses, drafters[0]))
    assert_same_training(results[1], results[0])


def test_a_pipeline_refuses_training_arguments_beside_a_stage(lanes):
    stage, _ = make(DrafterGraphs, lanes[1:], accumulate=2)
    kwargs = dict(target=identity_target, drafter=stage)
    with pytest.raises(ValueError, match="expected no loss, optimizer"):
        pydflash.Pipeline(
            lanes[:1], lanes[1:], **kwargs, accumulate=2, loss=masked_loss, optimizer=stage
        )
    with pytest.raises(ValueError, match="expected accumulate=2"):
        pydflash.Pipeline(lanes[:1], lanes[1:], **kwargs, accumulate=4)
    with pytest.raises(ValueError, match="lanes as the pipeline's drafter lanes"):
        pydflash.Pipeline(lanes[1:], lanes[:1], **kwargs, accumulate=2)


def test_step_losses_are_read_once_when_asked(lanes):
    stage, _ = make(DrafterGraphs, lanes[1:], accumulate=2)
    pipe = pydflash.Pipeline(
        lanes[:1], lanes[1:], target=identity_target, drafter=stage, accumulate=2
    )
    (step,) = list(pipe.run(microbatches(2)))
    first = step.losses()
    assert all(isinstance(x, float) for x in first) and len(first) == 2
    assert step.losses() == first and step.loss() == sum(first) / 2


# --- on a GPU --------------------------------------------------------------------------------
@pytest.fixture
def gpu_lanes():
    dispatcher = pydflash.Dispatcher(["cuda:0"] * 2)
    yield dispatcher.lanes
    dispatcher.shutdown(cancel_futures=True)


def on_gpu(data: list[dict]) -> list[dict]:
    return [{k: t.cuda() for k, t in x.items()} for x in data]


def make_gpu(kind, lanes, *, loss=masked_loss, scheduler=None, optimizer=None, **kwargs):
    torch.manual_seed(0)  # the eager and the graph stage start from the same drafter
    drafter = Toy().cuda()
    make_optimizer = optimizer or (lambda ps: torch.optim.AdamW(ps, lr=0.05))
    optimizer = make_optimizer(drafter.parameters())
    stage = kind(
        lanes[:1],
        drafter=drafter,
        loss=loss,
        optimizer=optimizer,
        accumulate=2,
        scheduler=None if scheduler is None else scheduler(optimizer),
        **kwargs,
    )
    return stage, drafter


GRAPHS = dict(lengths=(4, 8, 16), policy="graphs")  # keep every graph, however fast
# Against eager: padding, and capturable AdamW's tensor arithmetic, round differently;
# Adam's m / sqrt(v) magnifies that where a gradient is near zero. Updates are ~0.05.


@pytest.mark.gpu
@pytest.mark.parametrize("clip", [None, 0.05])
def test_gpu_replayed_steps_train_as_the_eager_drafter_does(gpu_lanes, clip):
    data = on_gpu(microbatches(16, seed=2))
    eager, eager_drafter = make_gpu(EagerDrafter, gpu_lanes, clip_grad_norm=clip)
    graphs_, graph_drafter = make_gpu(DrafterGraphs, gpu_lanes, clip_grad_norm=clip, **GRAPHS)
    expected = train_steps(eager, data), eager_drafter
    got = train_steps(graphs_, data), graph_drafter
    assert_same_training(got, expected, rtol=1e-3, atol=1e-4)
    stats = graphs_.stats()
    lane = stats["lanes"][gpu_lanes[0].label]
    buckets = {
        (x["h"].shape[0], 4 if x["h"].shape[1] <= 4 else 8 if x["h"].shape[1] <= 8 else 16)
        for x in data
    }
    assert sorted(lane["buckets"]) == sorted(buckets)
    assert (lane["step"], lane["step_eager_runs"], lane["step_replays"]) == ("graph", 1, 7)
    assert stats["fallbacks"] == {}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_gpu_each_capturable_optimizer_replays_its_step_as_eager_steps(gpu_lanes, kind):
    data = on_gpu(microbatches(12, seed=5))
    eager, eager_drafter = make_gpu(EagerDrafter, gpu_lanes, optimizer=OPTIMIZERS[kind])
    graphs_, graph_drafter = make_gpu(
        DrafterGraphs, gpu_lanes, optimizer=OPTIMIZERS[kind], **GRAPHS
    )
    expected = train_steps(eager, data), eager_drafter
    got = train_steps(graphs_, data), graph_drafter
    assert_same_training(got, expected, rtol=1e-3, atol=1e-4)
    stats = graphs_.stats()
    lane = stats["lanes"][gpu_lanes[0].label]
    assert (lane["step"], lane["step_eager_runs"], lane["step_replays"]) == ("graph", 1, 5)
    assert lane["capture_failures"] == 0 and stats["fallbacks"] == {}


@pytest.mark.gpu
def test_gpu_an_optimizer_with_host_state_steps_eagerly_beside_replayed_buckets(gpu_lanes):
    adagrad = lambda ps: torch.optim.Adagrad(ps, lr=0.1)  # noqa: E731 - its step count on the host
    data = on_gpu(microbatches(8, seed=6))
    eager, eager_drafter = make_gpu(EagerDrafter, gpu_lanes, optimizer=adagrad)
    graphs_, graph_drafter = make_gpu(DrafterGraphs, gpu_lanes, optimizer=adagrad, **GRAPHS)
    expected = train_steps(eager, data), eager_drafter
    with pytest.warns(GraphFallbackWarning, match="optimizer not capturable"):
        got = train_steps(graphs_, data), graph_drafter
    assert_same_training(got, expected, rtol=1e-3, atol=1e-4)
    lane = graphs_.stats()["lanes"][gpu_lanes[0].label]
    assert (lane["step"], lane["step_replays"]) == ("eager", 0)
    assert lane["replays"] > 0 and lane["capture_failures"] == 0


@pytest.mark.gpu
def test_gpu_a_dropped_only_bucket_gives_its_pool_bytes_back(gpu_lanes, monkeypatch):
    """Issue 31: the policy dropped a lane's only bucket graph and its pool kept 13.6 GB.
    A forward that keeps the GPU busy is dropped as GPU-bound; its pool must hold 0 bytes
    after, while the step graph, in a pool of its own, keeps replaying. gpu_bound_ratio=0.01
    lets its warm-up pass (its launch took over 1 % of its GPU time) so that it is captured,
    and drops its graph (no faster than 1 % of the eager call)."""
    from pydflash.graphs.pools import pool_bytes

    width = 4096
    weight = torch.randn(width, width, device="cuda") / width**0.5

    def heavy(drafter, inputs, lengths=None):
        x = inputs["h"].new_zeros(inputs["h"].shape[0], 2048, width)
        for _ in range(8):
            x = torch.tanh(x @ weight)
        return masked_loss(drafter, inputs, lengths) + 0 * x.sum()

    # The device busy with it, NVML would keep it eager (tested in test_graph_cache.py).
    monkeypatch.setattr(_cuda_capture, "device_busy", lambda device: None)
    stage, _ = make_gpu(DrafterGraphs, gpu_lanes, loss=heavy, lengths=(16,), gpu_bound_ratio=0.01)
    g = torch.Generator().manual_seed(8)
    # One bucket, 2 x 16, seen often enough to be timed eagerly, captured, timed and
    # dropped. A timing is read once the GPU has passed it: each step ends synchronized,
    # so the next step's first call reads it (a GPU running behind would leave it unread).
    data = [
        {
            "h": torch.randn(2, 16, WIDTH, generator=g),
            "y": torch.randint(0, VOCAB, (2, 16), generator=g),
        }
        for _ in range(16)
    ]
    data = on_gpu(data)
    for step in range(0, len(data), 2):
        train_steps(stage, data[step : step + 2])
    cache = stage._graphs.lane(gpu_lanes[0])
    stats = stage.stats()
    lane = stats["lanes"][gpu_lanes[0].label]
    assert [(e["bucket"], e["graph_ms"] is None) for e in stats["eager_buckets"]] == [
        ((2, 16), False)
    ]
    assert lane["buckets"] == [] and lane["pools_released"] >= 1 and lane["released_bytes"] > 0
    (step_pool,) = cache.pools.values()
    assert lane["pool_bytes"] == pool_bytes(step_pool.handle, gpu_lanes[0].device_index)
    assert lane["step"] == "graph"
    assert cache.retiring == []  # the bucket pool measured 0 bytes after it was given back


@pytest.mark.gpu
def test_gpu_a_scheduled_lr_reaches_the_captured_step(gpu_lanes):
    data = on_gpu(microbatches(16, seed=3))
    schedule = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # noqa: E731
    eager, eager_drafter = make_gpu(EagerDrafter, gpu_lanes, scheduler=schedule)
    graphs_, graph_drafter = make_gpu(DrafterGraphs, gpu_lanes, scheduler=schedule, **GRAPHS)
    expected = train_steps(eager, data), eager_drafter
    got = train_steps(graphs_, data), graph_drafter
    assert_same_training(got, expected, rtol=1e-3, atol=1e-4)
    assert graphs_.stats()["lanes"][gpu_lanes[0].label]["step_replays"] == 7


@pytest.mark.gpu
def test_gpu_a_loss_that_syncs_runs_eagerly_and_says_why(gpu_lanes):
    def syncing(drafter, inputs, lengths=None):
        loss = masked_loss(drafter, inputs, lengths)
        assert loss.item() > 0  # a host sync: cannot be captured
        return loss

    data = on_gpu(microbatches(4, seed=4))
    eager, eager_drafter = make_gpu(EagerDrafter, gpu_lanes, loss=syncing)
    graphs_, graph_drafter = make_gpu(DrafterGraphs, gpu_lanes, loss=syncing, **GRAPHS)
    expected = train_steps(eager, data), eager_drafter
    with pytest.warns(GraphFallbackWarning, match="runs eagerly"):
        got = train_steps(graphs_, data), graph_drafter
    assert_same_training(got, expected, rtol=1e-3, atol=1e-4)
    assert "capture failed" in graphs_.stats()["fallbacks"]


@pytest.mark.gpu
def test_gpu_least_recently_used_graphs_are_evicted(gpu_lanes):
    stage, _ = make_gpu(DrafterGraphs, gpu_lanes, max_graphs=1, **GRAPHS)
    for t in (3, 7, 3):
        x = {
            "h": torch.randn(1, t, WIDTH, device="cuda"),
            "y": torch.randint(0, VOCAB, (1, t), device="cuda"),
        }
        gpu_lanes[0].submit(stage.train, 0, x, all_reduce=True).result()
    lane = stage.stats()["lanes"][gpu_lanes[0].label]
    assert (lane["buckets"], lane["captures"], lane["evictions"]) == ([(1, 4)], 3, 2)


@pytest.mark.gpu
def test_gpu_the_example_drafter_in_bf16_matches_eager_on_variable_lengths(gpu_lanes):
    from examples.dflash.loops import drafter_loss
    from examples.dflash.models import TINY_DRAFTER, TINY_TARGET, BlockDrafter

    torch.manual_seed(0)
    target = TINY_TARGET.build()
    reference = BlockDrafter(target, TINY_DRAFTER)
    g = torch.Generator().manual_seed(0)
    data = []
    for t in (20, 32, 27, 32, 12, 30, 32, 17):
        data.append(
            {
                "features": torch.randn(2, t, target.feature_dim, generator=g).cuda(),
                "input_ids": torch.randint(0, TINY_TARGET.vocab, (2, t), generator=g).cuda(),
            }
        )
    runs = []
    for kind, extra in (
        (EagerDrafter, {}),
        (DrafterGraphs, dict(lengths=(16, 32), policy="graphs")),
    ):
        drafter = copy.deepcopy(reference).cuda()
        optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
        stage = kind(
            gpu_lanes[:1],
            drafter=drafter,
            loss=drafter_loss,
            optimizer=optimizer,
            accumulate=2,
            **extra,
        )
        runs.append((train_steps(stage, data), drafter))
    # bf16 autocast: the padded and unpadded passes round differently.
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=2e-2, atol=1e-3)
    assert stage.stats()["fallbacks"] == {}
