"""TargetGraphs: bucketing, padding, fallbacks and the output ring
(pydflash/pipeline/stages/target_graphs.py).

The CPU tests run the bucketed path eagerly on CPU lanes; the GPU tests capture graphs."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch

import pydflash
from pydflash import GraphFallbackWarning, GraphMemoryError, TargetGraphs
from pydflash.graphs import nvml, policy
from pydflash.graphs.buckets import Bucket, batch_shape, choose_bucket, ladder


class CausalToy(torch.nn.Module):
    """Embedding, a running mean over positions and a linear map: causal, so right padding
    leaves the real positions' outputs unchanged."""

    def __init__(self, vocab=50, width=16, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, width, dtype=dtype)
        self.proj = torch.nn.Linear(width, width, dtype=dtype)

    def forward(self, batch):
        x = self.embed(batch["input_ids"])
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)
        running = x.cumsum(1) / steps[None, :, None]
        hidden = self.proj(running)
        return {"hidden": hidden, "input_ids": batch["input_ids"], "first": hidden[:, 0, 0]}


def ids_batch(b, t, vocab=50, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(1, vocab, (b, t), generator=g).to(device)}


@pytest.fixture
def cpu_lane():
    with pydflash.Dispatcher(devices=["cpu"]) as d:
        yield d.lanes[0]


# --- buckets -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "b, t, batch_sizes, expected",
    [
        (3, 100, None, Bucket(3, 128)),
        (3, 128, None, Bucket(3, 128)),
        (3, 129, None, Bucket(3, 256)),
        (3, 100, (2, 4, 8), Bucket(4, 128)),
        (8, 1000, (2, 4, 8), Bucket(8, 1024)),
        (9, 100, (2, 4, 8), None),
        (1, 2049, None, None),
    ],
)
def test_choose_bucket_takes_the_smallest_that_holds_the_batch(b, t, batch_sizes, expected):
    assert choose_bucket(b, t, (128, 256, 1024, 2048), batch_sizes) == expected


def test_the_default_ladder_splits_each_doubling():
    assert ladder(1, 128, 1024) == (128, 256, 512, 1024)
    assert ladder(4, 128, 1024) == (
        128,
        160,
        192,
        224,
        256,
        320,
        384,
        448,
        512,
        640,
        768,
        896,
        1024,
    )
    assert TargetGraphs(lambda batch: batch).lengths == ladder()
    assert TargetGraphs(lambda batch: batch, granularity=1).lengths[:3] == (128, 256, 512)


def test_the_default_ladder_wastes_at_most_a_tenth_on_evenly_spread_lengths():
    lengths = ladder()
    for low, high in [(200, 2048), (512, 2048), (1025, 8192)]:
        padded = sum(choose_bucket(1, t, lengths, None).length for t in range(low, high + 1))
        real = sum(range(low, high + 1))
        assert (padded - real) / padded <= 0.10


def test_batch_shape_requires_one_batch_and_length():
    assert batch_shape([torch.zeros(2, 5), torch.zeros(2), 3]) == (2, 5)
    with pytest.raises(ValueError, match=r"expected every tensor of the batch as \[2, 5"):
        batch_shape([torch.zeros(2, 5), torch.zeros(2, 6)])
    with pytest.raises(ValueError, match="at least one"):
        batch_shape([torch.zeros(2)])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"lengths": []}, ValueError, "lengths as positive ints"),
        ({"lengths": [0, 8]}, ValueError, "lengths as positive ints"),
        ({"lengths": 7}, TypeError, "lengths as an iterable"),
        ({"batch_sizes": [-1]}, ValueError, "batch_sizes"),
        ({"ring": -1}, ValueError, "ring >= 0"),
        ({"warmup": 1.5}, TypeError, "warmup to be an int"),
        ({"granularity": 0}, ValueError, "granularity >= 1"),
        ({"lengths": [8], "granularity": 2}, ValueError, "lengths or granularity"),
        ({"policy": "never"}, ValueError, "policy in"),
        ({"gpu_bound_ratio": -1.0}, ValueError, "gpu_bound_ratio > 0"),
        ({"on_full": "drop"}, ValueError, "on_full in"),
        ({"max_graphs": 0}, ValueError, "max_graphs >= 1"),
        ({"pad_value": "x"}, TypeError, "pad_value"),
    ],
)
def test_argument_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        TargetGraphs(lambda batch: batch, **kwargs)


def test_a_non_callable_target_is_a_type_error():
    with pytest.raises(TypeError, match="expected a callable target"):
        TargetGraphs(3)


# --- the bucketed path on a CPU lane -------------------------------------------------------
def test_padded_outputs_equal_eager_and_are_cut_back(cpu_lane):
    model = CausalToy()
    target = TargetGraphs(model, lengths=(16, 64), batch_sizes=(4,))
    for b, t in [(1, 5), (3, 16), (4, 40)]:
        batch = ids_batch(b, t, seed=t)
        out = target.submit(cpu_lane, batch).result()
        with torch.no_grad():
            expected = model(batch)
        assert out["hidden"].shape == (b, t, 16) and out["hidden"].is_contiguous()
        torch.testing.assert_close(out["hidden"], expected["hidden"], rtol=1e-6, atol=1e-6)
        assert torch.equal(out["input_ids"], batch["input_ids"])
        assert out["first"].shape == (b,)


def test_padding_uses_pad_value_per_key(cpu_lane):
    seen = []

    def fn(batch):
        seen.append({k: v.clone() for k, v in batch.items()})
        return batch["ids"] * 1

    target = TargetGraphs(fn, lengths=(4,), pad_value={"ids": 7, "mask": 0})
    batch = {"ids": torch.ones(1, 2, dtype=torch.long), "mask": torch.ones(1, 2, dtype=torch.long)}
    out = target.submit(cpu_lane, batch).result()
    assert seen[0]["ids"].tolist() == [[1, 1, 7, 7]]
    assert seen[0]["mask"].tolist() == [[1, 1, 0, 0]]
    assert out.tolist() == [[1, 1]]


def test_a_batch_above_the_largest_bucket_runs_eagerly_and_warns_once(cpu_lane):
    model = CausalToy()
    target = TargetGraphs(model, lengths=(8,))
    batch = ids_batch(2, 20)
    with pytest.warns(GraphFallbackWarning, match=r"2 x 20 is above the largest bucket \(8\)"):
        out = target.submit(cpu_lane, batch).result()
    with torch.no_grad():
        torch.testing.assert_close(out["hidden"], model(batch)["hidden"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target.submit(cpu_lane, ids_batch(2, 30)).result()  # no second warning
    stats = target.stats()
    assert stats["lanes"][cpu_lane.label]["eager_runs"] == 2
    assert stats["fallbacks"]["too long"]["count"] == 2


def test_fallbacks_are_counted_per_kind_with_the_latest_detail(cpu_lane):
    """One entry per kind, however many shapes fall back: the record does not grow with
    the shapes seen, and the warning comes once per kind."""
    target = TargetGraphs(lambda batch: batch["input_ids"] * 1, lengths=(8,))
    with pytest.warns(GraphFallbackWarning) as caught:
        for t in range(9, 41):
            target.submit(cpu_lane, ids_batch(1, t)).result()
    assert len([w for w in caught if issubclass(w.category, GraphFallbackWarning)]) == 1
    fallbacks = target.stats()["fallbacks"]
    assert list(fallbacks) == ["too long"]
    assert fallbacks["too long"]["count"] == 32
    assert "1 x 40 is above the largest bucket" in fallbacks["too long"]["latest"]


# One kernel each (x * 1): on a GPU a capture of views alone would record an empty graph.
UNCUTTABLE = {
    "transpose": lambda batch: (batch["x"] * 1).t(),  # [Tb, Bb]: no cut takes padding out
    "flatten": lambda batch: (batch["x"] * 1).flatten(),  # [Bb * Tb]
}


@pytest.mark.parametrize("kind", sorted(UNCUTTABLE))
def test_outputs_that_cannot_be_cut_back_run_eagerly_with_a_warning(cpu_lane, kind):
    """Issue 35: b.t() gave (4, 2) where eager gives (3, 2), b.flatten() (8,) for (6,)."""
    fn = UNCUTTABLE[kind]
    target = TargetGraphs(fn, lengths=(4,))
    batch = {"x": torch.arange(6.0).view(2, 3)}
    with pytest.warns(GraphFallbackWarning, match=r"\(uncut output\).*cannot be cut out"):
        out = target.submit(cpu_lane, batch).result()
    assert torch.equal(out, fn(batch))
    again = {"x": torch.arange(4.0).view(2, 2)}
    assert torch.equal(target.submit(cpu_lane, again).result(), fn(again))  # no new warning
    stats = target.stats()
    assert stats["fallbacks"]["uncut output"]["count"] == 2
    assert stats["lanes"][cpu_lane.label]["eager_runs"] == 2


def test_stats_report_the_padding_waste(cpu_lane):
    target = TargetGraphs(lambda batch: batch["input_ids"] * 1, lengths=(8, 16))
    assert target.stats()["padding_waste"] == 0.0
    target.submit(cpu_lane, ids_batch(1, 5)).result()  # 8 processed, 3 of them padding
    target.submit(cpu_lane, ids_batch(1, 16)).result()
    stats = target.stats()
    assert stats["padding_waste"] == pytest.approx(3 / 24)
    assert stats["eager_buckets"] == [] and stats["policy"] == "auto"


def test_eager_policy_runs_every_batch_unpadded(cpu_lane):
    shapes = []

    def fn(batch):
        shapes.append(tuple(batch["input_ids"].shape))
        return batch["input_ids"] * 1

    target = TargetGraphs(fn, lengths=(8, 16), policy="eager")
    for t in (5, 11):
        target.submit(cpu_lane, ids_batch(2, t)).result()
    assert shapes == [(2, 5), (2, 11)]
    stats = target.stats()
    assert stats["padding_waste"] == 0.0 and stats["fallbacks"] == {}
    assert stats["lanes"][cpu_lane.label]["eager_runs"] == 2


def test_target_graphs_is_not_a_captured_graph():
    """TargetGraphs is a stage with submit(); it has no run() that GraphTarget would take
    for a captured graph's."""
    assert not hasattr(TargetGraphs, "run")
    with pytest.raises(TypeError, match="captured graph with a run"):
        pydflash.pipeline.stages.GraphTarget(TargetGraphs(lambda batch: batch))


def test_warmup_runs_every_length_bucket_at_the_example_batch(cpu_lane):
    shapes = []

    def fn(batch):
        shapes.append(tuple(batch["ids"].shape))
        return batch["ids"] * 1

    target = TargetGraphs(fn, lengths=(4, 8, 16), pad_value={"ids": 3})
    target.warmup([cpu_lane], {"ids": torch.ones(2, 10, dtype=torch.long)})
    assert shapes == [(2, 4), (2, 8), (2, 16)]
    target.warmup(cpu_lane, {"ids": torch.ones(2, 10, dtype=torch.long)}, shapes=[(1, 8)])
    assert shapes[-1] == (1, 8)


def test_a_task_failure_reaches_the_caller(cpu_lane):
    def broken(batch):
        raise ValueError("bad target")

    with pytest.raises(ValueError, match="bad target"):
        TargetGraphs(broken).submit(cpu_lane, ids_batch(1, 4)).result()


def test_a_nested_batch_is_a_type_error(cpu_lane):
    # Issue 35: torch's "Internal error" from reading a nested tensor's shape.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.nested says it is a prototype
        nested = torch.nested.nested_tensor([torch.ones(3, dtype=torch.long)] * 2)
    target = TargetGraphs(CausalToy(), lengths=(16,), batch_sizes=(4,))
    with pytest.raises(TypeError, match=r"^expected a batch of dense .*got a nested tensor"):
        target.submit(cpu_lane, {"input_ids": nested}).result(10)


def test_release_of_a_cpu_result_is_a_no_op(cpu_lane):
    target = TargetGraphs(CausalToy())
    out = target.submit(cpu_lane, ids_batch(1, 4)).result()
    target.release(out)  # nothing to give back
    assert target.recycles


def test_pipeline_with_a_bucketed_target_matches_the_eager_target():
    """On CPU lanes the padded path must train exactly as the eager target does."""
    from pydflash import Pipeline

    def train(target_for):
        torch.manual_seed(1)
        model = CausalToy()
        drafter = torch.nn.Linear(16, 50)
        opt = torch.optim.SGD(drafter.parameters(), lr=0.1)

        def loss(d, inputs):
            logits = d(inputs["hidden"])
            return torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), inputs["input_ids"].flatten()
            )

        batches = [ids_batch(2, t, seed=t) for t in (5, 9, 12, 7, 16, 3)]
        with pydflash.Dispatcher(devices=["cpu", "cpu"]) as d:
            pipe = Pipeline(
                d.lanes[:1],
                d.lanes[1:],
                target=target_for(model),
                drafter=drafter,
                loss=loss,
                optimizer=opt,
                accumulate=2,
            )
            return [step.losses() for step in pipe.run(batches)]

    eager = train(lambda model: model)
    bucketed = train(lambda model: TargetGraphs(model, lengths=(8, 16)))
    assert eager == bucketed


# --- on the GPU ----------------------------------------------------------------------------
gpu = pytest.mark.gpu


@pytest.fixture
def gpu_lanes():
    with pydflash.Dispatcher(devices=[0, 0]) as d:
        yield d.lanes


def _slow_consumer_check(lane, target, future, expected_sum, spin_ns):
    """On `lane`: waits for the target's result on the lane stream, stalls the stream,
    then sums the result; gives the result back after the sum."""
    out = future.result()
    future.wait_stream()
    pydflash._C.busy_wait(torch.cuda.current_stream().cuda_stream, spin_ns)
    total = out["hidden"].double().sum()
    done = torch.cuda.Event()
    done.record()
    target.release(out, done)
    return total, expected_sum


@gpu
def test_gpu_bucket_outputs_equal_eager_in_bf16(gpu_lanes):
    model = CausalToy(width=64, dtype=torch.bfloat16).cuda()
    target = TargetGraphs(model, lengths=(64, 256), policy="graphs")
    lane = gpu_lanes[0]
    for b, t in [(2, 50), (2, 64), (3, 200), (2, 17)]:
        batch = ids_batch(b, t, device="cuda", seed=t)
        out = target.submit(lane, batch).wait_stream()
        with torch.no_grad():
            expected = model(batch)
        torch.testing.assert_close(out["hidden"], expected["hidden"], rtol=1.6e-2, atol=1e-2)
        assert out["hidden"].shape == (b, t, 64)
        target.release(out)
    stats = target.stats()["lanes"][lane.label]
    assert stats["captures"] == 2 and stats["replays"] == 4 and stats["eager_runs"] == 0
    assert stats["pool_bytes"] > 0


@gpu
@pytest.mark.parametrize("kind", sorted(UNCUTTABLE))
def test_gpu_outputs_that_cannot_be_cut_back_run_eagerly_and_free_the_graph(gpu_lanes, kind):
    fn = UNCUTTABLE[kind]
    target = TargetGraphs(fn, lengths=(4,), policy="graphs")
    lane = gpu_lanes[0]
    batch = {"x": torch.arange(6.0, device="cuda").view(2, 3)}
    with pytest.warns(GraphFallbackWarning, match="uncut output"):
        out = target.submit(lane, batch).wait_stream()
    assert torch.equal(out, fn(batch))
    stats = target.stats()["lanes"][lane.label]
    assert stats["buckets"] == [] and stats["captures"] == 1 and stats["dropped"] == 1
    assert stats["pool_bytes"] == 0


@gpu
def test_gpu_hf_model_buckets_equal_eager(gpu_lanes):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()

    def forward(batch):
        out = model(input_ids=batch["input_ids"], output_hidden_states=True, use_cache=False)
        return torch.cat([out.hidden_states[1], out.hidden_states[2]], dim=-1)

    target = TargetGraphs(forward, lengths=(128, 256), policy="graphs")
    for t in (100, 256, 130):
        batch = ids_batch(2, t, vocab=128, device="cuda", seed=t)
        out = target.submit(gpu_lanes[0], batch).wait_stream()
        with torch.no_grad():
            expected = forward(batch)
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    assert target.stats()["lanes"][gpu_lanes[0].label]["eager_runs"] == 0


def _host_sync(batch):
    x = batch["input_ids"].float()
    if x.sum().item() < 0:  # a host sync: not capturable
        x = -x
    return x * 2 + (batch["input_ids"] > 25)


def _data_dependent(batch):
    x = batch["input_ids"]
    chosen = torch.nonzero(x > 25)  # MoE-style routing: a data-dependent shape
    out = x.float() * 2
    out[chosen[:, 0], chosen[:, 1]] += 1
    return out


def _plain(batch):
    out = batch["input_ids"].float() * 2
    out[batch["input_ids"] > 25] += 1
    return out


@gpu
@pytest.mark.parametrize(
    "fn, reason",
    [
        (_host_sync, "capture failed"),
        (_data_dependent, "capture failed"),
        (_plain, "above the largest bucket"),
    ],
)
def test_gpu_every_fallback_runs_eagerly_with_the_right_result(gpu_lanes, fn, reason):
    target = TargetGraphs(fn, lengths=(32,), policy="graphs")  # a capture at the first call
    t = 40 if fn is _plain else 20
    batch = ids_batch(2, t, device="cuda")
    with pytest.warns(GraphFallbackWarning, match=reason):
        out = target.submit(gpu_lanes[0], batch).wait_stream()
    expected = batch["input_ids"].float() * 2 + (batch["input_ids"] > 25)
    assert torch.equal(out, expected)
    # The lane still works, and a second batch of that bucket goes eagerly without capture.
    out = target.submit(gpu_lanes[0], batch).wait_stream()
    assert torch.equal(out, expected)
    stats = target.stats()["lanes"][gpu_lanes[0].label]
    assert stats["eager_runs"] == 2 and stats["replays"] == 0


@gpu
def test_gpu_least_recently_used_graphs_are_evicted(gpu_lanes):
    target = TargetGraphs(CausalToy().cuda(), lengths=(8, 16, 32), max_graphs=2, policy="graphs")
    lane = gpu_lanes[0]
    for t in (8, 16, 8, 32):  # 16 is the least recently used when 32 comes
        target.release(target.submit(lane, ids_batch(1, t, device="cuda")).wait_stream())
    stats = target.stats()["lanes"][lane.label]
    assert stats["evictions"] == 1 and sorted(stats["buckets"]) == [(1, 8), (1, 32)]
    out = target.submit(lane, ids_batch(1, 16, device="cuda", seed=3)).wait_stream()
    with torch.no_grad():
        expected = target.fn(ids_batch(1, 16, device="cuda", seed=3))["hidden"]
    torch.testing.assert_close(out["hidden"], expected)
    assert target.stats()["lanes"][lane.label]["captures"] == 4


@gpu
def test_gpu_memory_cap_refuses_or_falls_back(gpu_lanes):
    batch = ids_batch(2, 16, device="cuda")
    capped = TargetGraphs(
        CausalToy().cuda(), lengths=(16,), max_pool_bytes=1, on_full="raise", policy="graphs"
    )
    with pytest.raises(GraphMemoryError, match="max_pool_bytes=1"):
        capped.submit(gpu_lanes[0], batch).result()
    fallback = TargetGraphs(CausalToy().cuda(), lengths=(16,), max_pool_bytes=1, policy="graphs")
    with pytest.warns(GraphFallbackWarning, match="max_pool_bytes=1"):
        out = fallback.submit(gpu_lanes[0], batch).wait_stream()
    with torch.no_grad():
        torch.testing.assert_close(out["hidden"], fallback.fn(batch)["hidden"])
    assert fallback.stats()["lanes"][gpu_lanes[0].label]["buckets"] == []


@gpu
def test_gpu_ring_never_hands_out_a_buffer_still_being_read(gpu_lanes):
    """The consumer stalls its stream before reading each result; the target lane runs
    far ahead. A ring buffer reused before the consumer's read would change the sums."""
    model = CausalToy(width=64).cuda()
    target = TargetGraphs(model, lengths=(32,), ring=2, policy="graphs")
    producer, consumer = gpu_lanes
    batches = [ids_batch(2, 32, device="cuda", seed=k) for k in range(24)]
    with torch.no_grad():
        expected = [model(b)["hidden"].double().sum() for b in batches]
    target.warmup([producer], batches[0])
    checks = []
    for k, batch in enumerate(batches):
        future = target.submit(producer, batch)
        checks.append(
            consumer.submit(_slow_consumer_check, consumer, target, future, expected[k], 2_000_000)
        )
    results = [f.wait_stream() for f in checks]
    for total, want in results:
        torch.testing.assert_close(total, want)
    stats = target.stats()["lanes"][producer.label]
    assert stats["replays"] == len(batches) + 1
    assert stats["ring_misses"] < len(batches)  # the ring was really reused


@gpu
def test_gpu_two_lanes_capture_one_bucket_in_turn(gpu_lanes):
    model = CausalToy(width=32).cuda()
    target = TargetGraphs(model, lengths=(64,), policy="graphs")
    start = threading.Barrier(2)
    batch = ids_batch(4, 60, device="cuda")

    def go(lane):
        start.wait()
        return target.submit(lane, batch).wait_stream()

    outs = [None, None]
    threads = [
        threading.Thread(target=lambda i=i: outs.__setitem__(i, go(gpu_lanes[i]))) for i in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    torch.cuda.synchronize()
    with torch.no_grad():
        expected = model(batch)["hidden"]
    for out in outs:
        torch.testing.assert_close(out["hidden"], expected)
    stats = target.stats()["lanes"]
    assert [s["captures"] for s in stats.values()] == [1, 1]


def _syncs_at(length):
    """A forward whose bucket of `length` cannot be captured: it synchronises the device."""

    def forward(batch):
        x = batch["input_ids"].float()
        if x.shape[1] == length:
            torch.cuda.synchronize()
        return x * 2 + 1

    return forward


@gpu
@pytest.mark.parametrize("failing", ["synchronize", "item"])
def test_gpu_a_failed_capture_leaves_the_lane_able_to_capture(gpu_lanes, failing):
    """A capture that fails inside the forward runs that batch eagerly; replays of the
    bucket captured before it and a capture of another bucket afterwards, into the same
    pool, still work (they raised "already recording to mempool_id" before)."""
    if failing == "synchronize":
        forward = _syncs_at(32)
    else:

        def forward(batch):
            x = batch["input_ids"].float()
            if x.shape[1] == 32 and x.sum().item() < 0:  # a host sync inside the capture
                x = -x
            return x * 2 + 1

    target = TargetGraphs(forward, lengths=(16, 32, 64), policy="graphs")
    lane = gpu_lanes[0]
    for t in (16, 30, 16, 60, 30):
        batch = ids_batch(2, t, device="cuda", seed=t)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GraphFallbackWarning)
            out = target.submit(lane, batch).wait_stream()
        assert torch.equal(out, batch["input_ids"].float() * 2 + 1)
        target.release(out)
    stats = target.stats()
    lane_stats = stats["lanes"][lane.label]
    assert sorted(lane_stats["buckets"]) == [(2, 16), (2, 64)]
    assert lane_stats["captures"] == 2 and lane_stats["replays"] == 3
    assert stats["fallbacks"]["capture failed"]["count"] == 2
    assert not torch.cuda.is_current_stream_capturing()


def _gpu_bound(weight):
    def forward(batch):
        x = batch["x"]
        for _ in range(4):
            x = x @ weight
        return x

    return forward


def _launch_bound(batch):
    x = batch["x"]
    for _ in range(100):
        x = x + 1
    return x


@gpu
def test_gpu_auto_policy_runs_a_gpu_bound_bucket_eagerly_and_keeps_a_launch_bound_one(gpu_lanes):
    lane = gpu_lanes[0]
    weight = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) / 90
    heavy = TargetGraphs(_gpu_bound(weight), lengths=(2048,))
    light = TargetGraphs(_launch_bound, lengths=(64,))
    x_heavy = torch.randn(1, 2000, 8192, device="cuda", dtype=torch.bfloat16)
    x_light = torch.randn(2, 60, 8, device="cuda")
    for _ in range(5):
        got = heavy.submit(lane, {"x": x_heavy}).wait_stream()
        torch.testing.assert_close(got, _gpu_bound(weight)({"x": x_heavy}), rtol=2e-2, atol=2e-2)
        heavy.release(got)
    torch.cuda.synchronize()
    # The light forward alone: on a device its matmuls keep busy, NVML says so and it
    # would be judged GPU-bound too (the next test).
    assert _until_the_device_idles(0)
    for _ in range(5):
        light.release(light.submit(lane, {"x": x_light}).wait_stream())
    torch.cuda.synchronize()
    (judged,) = heavy.stats()["eager_buckets"]
    # Judged by its warm-up (Note [A policy for the whole step]): its 4 matmuls launch in
    # far less than the GPU runs them, so it is never captured.
    assert judged["bucket"] == (1, 2048) and judged["graph_ms"] is None
    assert judged["host_ms"] < 0.9 * judged["eager_ms"], judged
    heavy_lane = heavy.stats()["lanes"][lane.label]
    assert heavy_lane["buckets"] == [] and heavy_lane["eager_runs"] >= 4
    assert heavy_lane["capture_attempts"] == 0 and heavy_lane["pool_bytes"] == 0
    assert heavy.stats()["padding_waste"] < 48 / 2048  # the eager runs are unpadded
    assert light.stats()["eager_buckets"] == []
    light_lane = light.stats()["lanes"][lane.label]  # 3 eager calls, the last two timed
    assert (light_lane["eager_runs"], light_lane["replays"]) == (3, 2), light_lane


def _until_the_device_idles(device, timeout=5.0):
    """Waits until NVML's sample period (1/6 s to 1 s) shows `device` busy less than
    DEVICE_BUSY; True then, or where NVML cannot say."""
    deadline = time.monotonic() + timeout
    while (share := nvml.busy_share(device)) is not None and share >= policy.DEVICE_BUSY:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@gpu
def test_gpu_auto_policy_captures_nothing_on_a_device_another_lane_keeps_busy(gpu_lanes):
    """Note [A policy for the whole step]: a launch-bound forward on a device that the
    other lane keeps running a kernel: NVML counts the device busy the whole time, saved
    launches could not shorten anything, and the forward runs eagerly, never captured."""
    if nvml.busy_share(0) is None:
        pytest.skip("needs NVML (the driver's libnvidia-ml)")
    busy, lane = gpu_lanes
    spin_ns = 4_000_000_000
    busy.submit(lambda: pydflash._C.busy_wait(torch.cuda.current_stream().cuda_stream, spin_ns))
    deadline = time.monotonic() + 3
    while nvml.busy_share(0) < policy.DEVICE_BUSY and time.monotonic() < deadline:
        time.sleep(0.05)
    light = TargetGraphs(_launch_bound, lengths=(64,))
    x = torch.randn(2, 60, 8, device="cuda")
    for _ in range(5):
        light.release(light.submit(lane, {"x": x}).wait_stream())
    torch.cuda.synchronize()  # the spin ends
    (judged,) = light.stats()["eager_buckets"]
    assert "of NVML's last sample period" in judged["reason"], judged
    assert judged["host_ms"] >= 0.9 * judged["eager_ms"], judged  # launch-bound by itself
    light_lane = light.stats()["lanes"][lane.label]
    assert (light_lane["capture_attempts"], light_lane["eager_runs"]) == (0, 5), light_lane
