"""Microbatches as stream programs (pydflash/pipeline/native_microbatch.py, Lane.submit_program).

On CPU: the ops a padded copy is made of, run by a host interpreter of the op list,
write what `copy_padded` writes; malformed programs are refused with typed errors; and
the pipeline takes the Python path where no microbatch could qualify. On a GPU: a
pipeline whose microbatches run as programs trains as the Python path does."""

from __future__ import annotations

import ctypes
import random
import threading
import time
import weakref

import pytest
import torch

import pydflash
from pydflash._C import StreamOp as Op
from pydflash._C import StreamOpKind as Kind
from pydflash.graphs.buckets import copy_padded
from pydflash.pipeline.native_microbatch import NativeMicrobatches, copy_padded_ops, row_pitch
from pydflash.pipeline.stages import EagerDrafter
from pydflash.pipeline.stages.drafter_graphs import DrafterGraphs
from tests.test_drafter_graphs import WIDTH, Toy, masked_loss, microbatches


def run_on_host(ops: list[Op]) -> None:
    """Runs copies and fills on host memory, as csrc/core/stream_program.cpp issues them."""
    for op in ops:
        if op.kind == Kind.COPY:
            for row in range(op.height):
                ctypes.memmove(op.dst + row * op.dpitch, op.src + row * op.spitch, op.width)
        elif op.kind == Kind.FILL:
            for row in range(op.height):
                ctypes.memset(op.dst + row * op.dpitch, op.value, op.width)
        else:
            raise AssertionError(f"not a host op: {op}")


@pytest.mark.parametrize("seed", range(20))
def test_padded_copy_ops_write_what_copy_padded_writes(seed):
    rng = random.Random(seed)
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64])
    rows, length = rng.randint(1, 4), rng.randint(1, 9)
    b, t = rng.randint(1, rows), rng.randint(1, length)
    trailing = rng.choice([(), (3,), (2, 5)])
    one_dim = rng.random() < 0.25
    shape = (b,) if one_dim else (b, t, *trailing)
    x = (torch.randn(shape) * 100).to(dtype)
    # The source is either a batch of its own or the real corner of a larger static output.
    if not one_dim and rng.random() < 0.5:
        wider = torch.zeros(rows + 1, length + 2, *trailing, dtype=dtype)
        wider[:b, :t] = x
        source, src = wider, wider
    else:
        source, src = x.contiguous(), x
    static_shape = (rows,) if one_dim else (rows, length, *trailing)
    want = torch.full(static_shape, 7, dtype=dtype)
    copy_padded(want, x, 0)
    got = torch.full(static_shape, 7, dtype=dtype)
    ops: list[Op] = []
    copy_padded_ops(ops, got, src.data_ptr(), row_pitch(source), b, t)
    run_on_host(ops)
    assert torch.equal(got, want)


def test_malformed_programs_are_refused_with_typed_errors():
    with pydflash.Dispatcher(["cpu"]) as d:
        lane = d.lanes[0]
        buffer = torch.zeros(16, dtype=torch.uint8)
        p = buffer.data_ptr()
        copy = {"dst": p, "dpitch": 8, "src": p + 8, "spitch": 8, "width": 8, "height": 1}
        cases = [
            (3, TypeError, "sequence of _C.StreamOp"),
            ([(Kind.GRAPH, 1)], TypeError, "as a pydflash._C.StreamOp, got tuple"),
            ([Op(Kind.GRAPH, src="1")], TypeError, "stream op 0's src to be an int, got str"),
            ([Op(9)], ValueError, "kind from 0 to 5, got 9"),
            ([Op(-1)], ValueError, "kind from 0 to 5, got -1"),
            ([Op(Kind.GRAPH, dst=p, src=1)], ValueError, "a GRAPH op to leave dst at 0"),
            ([Op(Kind.WAIT_INPUT, value=1)], ValueError, "a WAIT_INPUT op to leave value at 0"),
            ([Op(Kind.COPY, **copy, value=7)], ValueError, "a COPY op to leave value at 0"),
            ([Op(Kind.FILL, dst=p, dpitch=8, value=256, width=8, height=1)], ValueError, "byte"),
            ([Op(Kind.COPY, **{**copy, "dpitch": 4, "height": 2})], ValueError, "pitch"),
            ([Op(Kind.COPY, **{**copy, "src": 0})], ValueError, "source address"),
            ([Op(Kind.FILL_I64, dst=p + 1, width=1, value=5)], ValueError, "aligned"),
            ([Op(Kind.RECORD)], ValueError, "event to record"),
            ([Op(Kind.WAIT_INPUT)], ValueError, "CPU lane"),  # well formed: refused for the lane
        ]
        for ops, error, match in cases:
            with pytest.raises(error, match=match):
                lane.submit_program(ops, buffer)
        with pytest.raises(TypeError, match="pydflash future or None"):
            lane._core.submit_program([Op(Kind.WAIT_INPUT)], None, object(), lane)


def test_cpu_pipelines_take_the_python_path():
    with pydflash.Dispatcher(["cpu"] * 2) as d:
        drafter = Toy()
        stage = DrafterGraphs(
            d.lanes[1:],
            drafter=drafter,
            loss=masked_loss,
            optimizer=torch.optim.AdamW(drafter.parameters()),
            accumulate=2,
        )
        target = pydflash.TargetGraphs(lambda batch: batch)
        assert NativeMicrobatches.of([target], d.lanes[:1], stage, d.lanes[1:], 2) is None
        pipe = pydflash.Pipeline(
            d.lanes[:1], d.lanes[1:], target=target, drafter=stage, accumulate=2
        )
        list(pipe.run(microbatches(4)))
        assert pipe.stats()["native_microbatches"] == 0


def test_only_graph_stages_that_pad_with_zeros_qualify():
    class GpuLane:
        is_gpu = True

    lanes = [GpuLane(), GpuLane()]

    def graph_drafter(cpu, pad_value=0):
        drafter = Toy()
        return DrafterGraphs(
            [cpu],
            drafter=drafter,
            loss=masked_loss,
            optimizer=torch.optim.AdamW(drafter.parameters()),
            accumulate=2,
            pad_value=pad_value,
        )

    with pydflash.Dispatcher(["cpu"]) as d:
        drafter = graph_drafter(d.lanes[0])
        target = pydflash.TargetGraphs(lambda batch: batch)
        assert NativeMicrobatches.of([target], lanes[:1], drafter, lanes[1:], 2) is not None
        eager = EagerDrafter.__new__(EagerDrafter)
        assert NativeMicrobatches.of([target], lanes[:1], eager, lanes[1:], 2) is None
        assert NativeMicrobatches.of([lambda b: b], lanes[:1], drafter, lanes[1:], 2) is None
        padded = pydflash.TargetGraphs(lambda batch: batch, pad_value={"y": -100})
        assert NativeMicrobatches.of([padded], lanes[:1], drafter, lanes[1:], 2) is None
        zeros = graph_drafter(d.lanes[0], pad_value={"h": 0.0, "y": 0})
        assert NativeMicrobatches.of([target], lanes[:1], zeros, lanes[1:], 2) is not None
        nonzero = graph_drafter(d.lanes[0], pad_value={"h": 0.0, "y": -1})
        assert NativeMicrobatches.of([target], lanes[:1], nonzero, lanes[1:], 2) is None


# --- on a GPU --------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", ["target_graphs", "drafter_graphs"])
def test_each_graph_stage_describes_a_native_launch(stage):
    # What a stage's entry gives BucketedGraphs.native_launch fills a NativeLaunch with no
    # field left over: on a GPU a second `_describe` in one module once shadowed it.
    import importlib
    from types import SimpleNamespace

    from pydflash.graphs.bucketed import NativeLaunch

    module = importlib.import_module(f"pydflash.pipeline.stages.{stage}")
    x = torch.zeros(2, 4)
    static = (
        module._Static(inputs=[x], lengths=torch.zeros(2), fresh=False)
        if stage == ("drafter_graphs")
        else module._Static(
            inputs=[x], bucket=(2, 4), out_spec=None, out_leaves=[x], out_cuts=[0], out_signature=()
        )
    )
    entry = SimpleNamespace(data=static, outputs=x)
    launch = NativeLaunch(0, *module._launch_parts(entry), keep=entry, count=lambda: None)
    assert launch.inputs == [x] and launch.keep is entry


def gpu_batches(count: int, seed: int) -> list[dict]:
    """Pinned host batches of a few lengths (so buckets repeat), and one above the largest
    bucket, which takes the Python path between programs."""
    data = microbatches(count, seed=seed, lengths=(5, 9, 13, 16))
    data[count // 2] = microbatches(1, seed=seed + 1, lengths=(40,))[0]
    return [{k: v.pin_memory() for k, v in x.items()} for x in data]


def graph_pipeline(lanes, accumulate: int, clip: float | None = None):
    """(pipeline, drafter stage, drafter): a graph target (a frozen projection) on lanes[0]
    and a graph drafter on lanes[1], buckets of 8, 16 and 32 kept whatever their speed."""
    torch.manual_seed(0)
    project = torch.nn.Linear(WIDTH, WIDTH).cuda().requires_grad_(False)

    def target(batch):
        return {"h": torch.tanh(project(batch["h"])), "y": batch["y"]}

    drafter = Toy().cuda()
    buckets = dict(lengths=(8, 16, 32), policy="graphs")
    stage = DrafterGraphs(
        lanes[1:],
        drafter=drafter,
        loss=masked_loss,
        optimizer=torch.optim.AdamW(drafter.parameters(), lr=0.05),
        accumulate=accumulate,
        clip_grad_norm=clip,
        **buckets,
    )
    targets = pydflash.TargetGraphs(target, **buckets)
    pipe = pydflash.Pipeline(
        lanes[:1], lanes[1:], target=targets, drafter=stage, accumulate=accumulate
    )
    return pipe, stage, drafter


def train_pipeline(batches: list[dict], native: bool, accumulate: int = 4):
    with pydflash.Dispatcher(["cuda:0"] * 2) as d:
        pipe, stage, drafter = graph_pipeline(d.lanes, accumulate, clip=0.5)
        if not native:
            pipe._submitter.native = None  # every microbatch in Python
        losses = [x for step in pipe.run(batches) for x in step.losses()]
        torch.cuda.synchronize()
        return losses, drafter, pipe.stats(), stage.stats()


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::pydflash.GraphFallbackWarning")  # the batch above 32
def test_gpu_programs_train_as_the_python_path_does():
    batches = gpu_batches(48, seed=3)
    losses, drafter, stats, stage_stats = train_pipeline(batches, native=True)
    want_losses, want_drafter, want_stats, _ = train_pipeline(batches, native=False)
    assert want_stats["native_microbatches"] == 0
    assert stats["native_microbatches"] > len(batches) // 2, stats
    assert stats["steps"] == want_stats["steps"] == len(batches) // 4
    (lane,) = stage_stats["lanes"].values()
    assert lane["replays"] >= stats["native_microbatches"]
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
    for p, q in zip(drafter.parameters(), want_drafter.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_gpu_a_program_after_a_cancelled_task_issues_nothing():
    with pydflash.Dispatcher(["cuda:0"]) as d:
        lane = d.lanes[0]
        gate = threading.Event()
        lane.submit(gate.wait)
        queued = lane.submit(lambda: None)
        assert queued.cancel()
        dst, src = torch.zeros(4, device="cuda"), torch.ones(4, device="cuda")
        ops = [
            Op(
                Kind.COPY,
                dst=dst.data_ptr(),
                dpitch=16,
                src=src.data_ptr(),
                spitch=16,
                width=16,
                height=1,
            )
        ]
        after_cancelled = lane.submit_program(ops, (dst, src), after=queued)
        gate.set()
        with pytest.raises(pydflash.InputFailedError, match="cancelled"):
            after_cancelled.result()
        lane.submit_program([Op(Kind.FILL_I64, dst=dst.data_ptr(), width=2, value=7)], dst).result()
        torch.cuda.synchronize()
        assert dst.view(torch.int64).tolist() == [7, 7]  # the copy never ran
        lane.submit_program(ops, (dst, src)).result()
        torch.cuda.synchronize()
        assert dst.tolist() == [1.0] * 4


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::pydflash.GraphFallbackWarning")
def test_gpu_leaving_a_native_run_early_leaves_the_pipeline_usable():
    batches = gpu_batches(24, seed=4)
    with pydflash.Dispatcher(["cuda:0"] * 2) as d:
        pipe, _, _ = graph_pipeline(d.lanes, accumulate=2)
        for step in pipe.run(batches):
            if step.step == 6:
                break  # queued programs are cancelled; those after them fail on their input
        assert pipe.stats()["native_microbatches"] > 0
        steps = [step.loss() for step in pipe.run(batches[:8])]
        assert len(steps) == 4 and all(torch.isfinite(torch.tensor(steps)))


@pytest.mark.gpu
def test_gpu_programs_without_a_keepalive_drop_their_references_without_the_gil():
    # Note [Deferred decrefs]: the worker buries each program's references and releases
    # them in batches of 64, or when it next leaves the interpreter.
    with pydflash.Dispatcher(["cuda:0"]) as d:
        lane = d.lanes[0]
        dst = torch.zeros(2, dtype=torch.int64, device="cuda")
        refs = []
        for i in range(150):
            future = lane.submit_program([Op(Kind.FILL_I64, dst=dst.data_ptr(), width=2, value=i)])
            future.result()
            refs.append(weakref.ref(future))
            del future
        assert sum(r() is not None for r in refs) <= 64  # drained twice meanwhile
        lane.submit(lambda: None).result()  # leaving the interpreter after it drains the rest
        deadline = time.monotonic() + 5
        while any(r() is not None for r in refs) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(r() is None for r in refs)
        torch.cuda.synchronize()
        assert dst.tolist() == [149, 149]
