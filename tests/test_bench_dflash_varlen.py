"""bench/dflash_varlen.py on CPU lanes: its microbatches, its rows at tiny sizes, and that
the default GPU run leaves it to --full."""

from __future__ import annotations

import statistics

import pytest
import torch

from bench import dflash_varlen as dv
from bench.common import Context


def _ctx(gpus: int = 0, **options) -> Context:
    opts = {dv.SECTION: dv.Options(**options)} if options else {}
    return Context(quick=True, gpus=gpus, progress=lambda line: None, options=opts)


def test_the_lengths_are_ten_from_320_to_1024_with_a_mean_near_575():
    assert len(dv.LENGTHS) == 10 and (min(dv.LENGTHS), max(dv.LENGTHS)) == (320, 1024)
    assert 565 <= statistics.mean(dv.LENGTHS) <= 585


def test_each_microbatch_takes_a_drawn_length_with_the_drafters_anchors():
    pytest.importorskip("transformers")
    (plan,) = dv.plans(_ctx(), dv.Options())
    batches = dv.microbatches(plan, 40)
    lengths = [b["input_ids"].shape[1] for b in batches]
    assert set(lengths) == set(plan.lengths)  # 40 draws from 4 lengths reach each
    for b in batches:
        assert b["anchors"].shape == b["input_ids"].shape
        assert int(b["anchors"].max()) <= b["input_ids"].shape[1] - plan.job.drafter.block
    again = dv.microbatches(plan, 40)
    assert all(
        torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches, again, strict=True)
    )


def test_rows_at_tiny_sizes_on_cpu_lanes():
    pytest.importorskip("transformers")
    torch.set_num_threads(1)
    rows = {r.name.split(": ", 1)[1]: r for r in dv.run(_ctx(steps=1, warmup=1))}
    assert rows["eager stages, samples/s"].value > 0
    for kind in ("eager", "graph"):  # the objective trained: the tiny drafter's, block 4
        assert "exp(-(k-1)/2.5) at block 4; no loss mask" in rows[f"{kind} stages, samples/s"].note
    graphs = rows["graph stages, samples/s"]
    eager = [rows[f"eager stages{again}, samples/s"].value for again in ("", " again")]
    assert graphs.value > 0 and graphs.baseline == pytest.approx(sum(eager) / 2)
    assert rows["eager stages again, samples/s"].baseline == eager[0]
    assert rows["graph stages, first 1 steps"].baseline > 0
    run = rows["graph stages, samples/s over the run"]
    assert run.value > 0 and run.baseline > 0 and run.target == "ratio >= 1.0"
    assert "all 2 steps" in run.note
    drafter = rows["drafter graph stage, capture seconds"].extra
    assert drafter["step"] == ["eager"]  # CPU lanes capture nothing
    assert {"capture_attempts", "pool_gb", "policy_choices"} <= set(drafter)
    assert "graph stages, GPU busy" not in rows  # the profiler's device activity: GPU only


def test_the_default_gpu_run_leaves_the_section_to_full():
    (row,) = dv.run(_ctx(gpus=1))
    assert row.value is None and "--full" in row.note


def test_each_kind_trains_a_fresh_drafter_of_the_same_weights_eager_on_both_sides(monkeypatch):
    pytest.importorskip("transformers")
    torch.set_num_threads(1)
    made = []

    class Recording(dv.PipelineLoop):
        def __init__(self, models, *args, graphs=False, **kwargs):
            drafter = models.drafters[0]
            weights = torch.cat([p.detach().flatten() for p in drafter.parameters()])
            state = dict(models.optimizers[0].state)
            made.append((graphs, drafter, models.targets[0], weights, state))
            super().__init__(models, *args, graphs=graphs, **kwargs)

    monkeypatch.setattr(dv, "PipelineLoop", Recording)
    dv.run(_ctx(steps=1, warmup=1))
    # The untimed warm start, then eager, graph and eager stages again.
    assert [graphs for graphs, *_ in made] == [False, False, True, False]
    drafters = [drafter for _, drafter, *_ in made]
    assert len({id(d) for d in drafters}) == 4  # none inherits another's optimizer or gradients
    assert len({id(target) for _, _, target, *_ in made}) == 1
    assert all(torch.equal(made[0][3], weights) for *_, weights, _ in made)
    assert all(not state for *_, state in made)  # no optimizer stepped before its run
