"""bench.seed_workload: its length distributions, its FLOP count against torch's counter,
the section's CPU path (the code the H200 runs, at tiny shapes), and on a GPU the long
workload trained through the pipeline against the sequential loop."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest
import torch

from bench import limits, run, seed_workload
from bench.common import Context
from bench.seed_workload import Options
from bench.seed_workload_common import failed_row, free
from bench.seed_workload_flops import drafter_flops, target_flops, target_shape
from bench.seed_workload_lengths import (
    Lengths,
    VariedSetup,
    Workload,
    recipe_layers,
    varied_batches,
)
from bench.seed_workload_loops import LOOPS, Bench
from bench.seed_workload_memory import memory, memory_rows
from examples.dflash import loops
from examples.dflash.loops import (
    Job,
    PipelineLoop,
    Placement,
    build_models,
    drafter_loss,
    sequential_steps,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_length_distributions_are_the_stated_ones():
    long, chat = Lengths("long", 768, 8192), Lengths("chat", 320, 2048, 520)  # Workload.gpu's
    assert long.expected() == pytest.approx(4512, abs=8)  # ~4.5 k, as the 27 B recipe's
    assert chat.expected() == pytest.approx(550, abs=15)
    for lengths in (long, chat):
        for count in (4, 8, 12, 50):  # the realized mean of any window is the stated one
            drawn = lengths.draw(count, seed=1)
            assert len(drawn) == count and lengths.low <= min(drawn)
            assert max(drawn) <= lengths.high and all(n % 64 == 0 for n in drawn)
            assert statistics.mean(drawn) == pytest.approx(lengths.expected(), abs=32)
        assert lengths.draw(50, seed=1) == lengths.draw(50, seed=1)
        assert lengths.draw(50, seed=2) != lengths.draw(50, seed=1)  # shuffled by the seed
        assert sorted(lengths.draw(50, seed=2)) == sorted(lengths.draw(50, seed=1))
    assert max(long.draw(50, seed=1)) >= 8192 - 128 and max(chat.draw(200, seed=1)) > 1024


def test_timed_windows_are_stratified_on_their_own():
    workload = Workload.cpu()
    job = Job(workload.target, next(iter(workload.drafters.values())), 96, 2, 4, 1e-3)
    long = workload.lengths["long"]
    setup = VariedSetup(job, Placement(("cpu",), ("cpu",)), 2, 2, 1, False)
    setup.lengths = long
    batches = setup.batches(2 * 3 * 4)  # two repetitions of a warm-up step and two timed
    seen = [b["input_ids"].shape[1] for b in batches]
    for rep in (0, 12):
        warm, timed = seen[rep : rep + 4], seen[rep + 4 : rep + 12]
        assert statistics.mean(warm) == pytest.approx(long.expected(), abs=8)
        assert statistics.mean(timed) == pytest.approx(long.expected(), abs=8)
    assert [b["input_ids"].shape[1] for b in setup.timed()] == seen[4:12]


def test_capture_layers_follow_the_recipe():
    assert recipe_layers(64) == (5, 19, 33, 47, 61)
    assert recipe_layers(16) == (1, 5, 8, 12, 15)


@pytest.mark.parametrize("length", [24, 40, 96])
def test_counted_drafter_flops_match_torch_s_counter(length):
    """Note [Counted FLOPs]: the drafter's forward and backward from its shapes, against
    torch.utils.flop_counter on the same call (matmuls and attention)."""
    workload = Workload.cpu()
    job = Job(workload.target, next(iter(workload.drafters.values())), length, 2, 1, 1e-3)
    models = build_models(job, Placement(("cpu",), ("cpu",)))
    batch = job.data(0).batch(0)
    with torch.no_grad():
        inputs = {**batch, "features": models.targets[0](batch["input_ids"])}
    drafter = models.drafters[0]
    counted = limits.count_flops(lambda: drafter_loss(drafter, inputs).backward())
    assert drafter_flops(drafter, 2, length) == pytest.approx(counted, rel=0.02)
    shape = target_shape(models.targets[0])
    linear = 2 * 2 * length * shape[0]  # the target's linear layers, the bulk of its FLOPs
    assert target_flops(shape, 2, length) > linear > 0


def test_section_runs_every_row_on_cpu_and_writes_the_memory_plot(tmp_path):
    options = Options(everything=True, lengths=(32, 128), b16=True, chat=False, out=str(tmp_path))
    path = tmp_path / "r.json"
    code = run.main(
        ["--quick", "--sections", "seed_workload", "--json", str(path)],
        options={"seed_workload": options},
    )
    assert code == 0
    result = json.loads(path.read_text())
    assert result["sections"]["seed_workload"]["status"] == "ok"
    rows = {r["name"]: r for r in result["rows"]}
    assert not any(name.startswith("chat") for name in rows)
    for what, gamma in (("long, block 4, 8 anchors", 2.5), ("long, block 8, 4 anchors", 4)):
        for loop in LOOPS:
            row = rows[f"{what}: {loop}, samples/s"]
            assert row["value"] > 0 and row["extra"]["tokens_per_s"] > row["value"]
            assert f"exp(-(k-1)/{gamma:g}) at block" in row["note"]  # the objective it trains
            assert "no loss mask" in row["note"]
    fp8 = rows["long, block 4, 8 anchors, fp8 target: pipeline, eager stages, samples/s"]
    assert fp8["value"] > 0 and fp8["extra"]["target_variant"] == "fp8"
    mean = rows[f"long, block 4, 8 anchors: {LOOPS[0]}, samples/s"]["extra"]
    assert mean["mean_length"] == pytest.approx(Workload.cpu().lengths["long"].expected(), abs=4)
    for batch in (1, 2):
        assert rows[f"bf16 target: largest length that fits at batch {batch}"]["value"] == 128
    assert rows["fp8 target: largest length that fits at batch 2"]["value"] == 128
    assert rows["drafter stage alone at 2 x 256, ms per step"]["value"] > 0
    curves = json.loads((tmp_path / "seed_memory_vs_length.json").read_text())
    assert [(p["length"], p["batch"]) for p in curves["bf16"]] == [
        (n, b) for n in (32, 128) for b in (1, 2)
    ]
    assert list(curves) == ["fp8", "fp8, pipeline", "bf16"]
    [point] = curves["fp8, pipeline"]
    assert point["loop"] == "pipeline" and point["samples_per_s"] > 0
    partial = json.loads((tmp_path / "seed_workload.partial.json").read_text())
    assert [r["name"] for r in partial] == [r["name"] for r in result["rows"]]
    assert (tmp_path / "seed_memory_vs_length.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", ["bf16", "fp8+fla"])
def test_long_workload_trains_through_the_pipeline_as_the_sequential_loop_on_a_gpu(variant):
    """The long workload at the 23 B target's width (8 of its 64 layers), block 8 with 512
    anchors, lengths up to 16 k: the pipeline's losses are the sequential loop's, with the
    bf16 target and with the fastest opt-in one (FP8 linear layers, FLA's fused kernels)."""
    pytest.importorskip("transformers")
    fp8, fused = seed_workload.TARGETS[variant]
    if fp8 and torch.cuda.get_device_capability(0) < (9, 0):
        pytest.skip("FP8 GEMMs with row-wise scales need compute capability 9.0")
    if fused:
        pytest.importorskip("fla")
    workload = Workload.gpu(layers=8)
    target = dataclasses.replace(workload.target, fp8=fp8, fused=fused)
    drafter = workload.drafters["block 8, 512 anchors"]
    job = Job(target, drafter, 16384, batch=2, accumulate=2, lr=1e-4)
    lengths = dataclasses.replace(workload.lengths["long"], high=16384)
    batches = varied_batches(job, lengths, 3 * job.accumulate)
    assert max(b["input_ids"].shape[1] for b in batches) > 8192
    placement = Placement(("cuda:0",), ("cuda:0",))
    losses = {}
    for name in ("sequential", "pipeline"):
        models = build_models(job, placement)
        if name == "sequential":
            steps = sequential_steps(models, placement, job, batches, 3)
            losses[name] = [step() for step in steps]
        else:
            loop = PipelineLoop(models, placement, job, depth=2)
            try:
                losses[name] = [step() for step in loop.steps(batches, 3)]
            finally:
                loop.close()
        del models
        free()
    assert all(torch.isfinite(torch.tensor(s)).all() for s in losses.values())
    torch.testing.assert_close(losses["pipeline"], losses["sequential"], rtol=2e-3, atol=2e-3)


def test_over_the_budget_the_rest_are_rows_that_say_so_and_a_failure_its_first_line():
    options = Options(everything=True, lengths=(32,), b16=False, budget=0.0)
    ctx = Context(
        quick=True, gpus=0, progress=lambda message: None, options={"seed_workload": options}
    )
    rows = {r.name: r for r in seed_workload.run(ctx)}
    first = "long, block 4, 8 anchors"
    assert rows[f"{first}: sequential loop, samples/s"].value > 0  # the bf16 rows run first
    for name in (
        f"{first}, fp8 target: pipeline, eager stages, samples/s",
        "bf16 target: memory at 1 x 32",
        f"{first}: pipeline, graph stages, samples/s",
    ):
        assert rows[name].value is None and "over the --budget" in rows[name].note
    error = RuntimeError("CUDA error: operation not permitted when stream is capturing\nSearch")
    row = failed_row("x", error)
    assert (
        row.note
        == "failed: RuntimeError: CUDA error: operation not permitted when stream is capturing"
    )


def test_an_out_of_memory_point_is_recorded_and_the_next_ones_still_run(monkeypatch):
    workload = Workload.cpu()
    job = Job(workload.target, next(iter(workload.drafters.values())), 64, 1, 1, 1e-3)
    placement = Placement(("cpu",), ("cpu",))
    ctx = Context(quick=True, gpus=0, progress=lambda message: None)
    bench = Bench(ctx, build_models(job, placement), job, placement)
    plain = loops.sequential_steps

    def short_memory(models, placement, job, data, steps):
        if job.seq == 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        yield from plain(models, placement, job, data, steps)

    monkeypatch.setattr(loops, "sequential_steps", short_memory)
    points = memory(bench, (32, 64, 96), (1,))
    assert [("oom" in p, "samples_per_s" in p) for p in points] == [
        (False, True),
        (True, False),
        (False, True),
    ]
    assert points[1]["oom"].startswith("OutOfMemoryError: CUDA out of memory")
    rows = memory_rows(points, "bf16 target", False, {})
    fits = {r.name: r.value for r in rows}
    assert fits["bf16 target: largest length that fits at batch 1"] == 96
    assert fits["bf16 target: memory at 1 x 64"] is None
