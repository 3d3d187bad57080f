"""examples/train_dflash_online.py and its models: the gated delta rule against a naive
loop (and flash-linear-attention's kernel on a GPU), causality of the target and the
drafter, the three training loops agreeing, the CLI, and a DDP drafter under torchrun."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from examples.dflash import gated_delta
from examples.dflash.data import MarkovTokens
from examples.dflash.gated_delta import l2norm, torch_gated_delta_rule
from examples.dflash.loops import (
    Job,
    PipelineLoop,
    Placement,
    build_models,
    executor_steps,
    sequential_steps,
)
from examples.dflash.models import TINY_DRAFTER, TINY_TARGET, BlockDrafter, HybridTarget

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_dflash_online.py"
TINY_JOB = Job(TINY_TARGET, TINY_DRAFTER, seq=32, batch=2, accumulate=2, lr=3e-3, seed=0)


# --- the gated delta rule -------------------------------------------------------------------
def naive_gated_delta_rule(q, k, v, g, beta, scale=None, use_qk_l2norm=True):
    """The recurrence one position at a time, as written in the module docstring."""
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    batch, length, heads, dk = q.shape
    scale = dk**-0.5 if scale is None else scale
    h = q.new_zeros(batch, heads, dk, v.shape[-1])
    out = []
    for t in range(length):
        h = h * g[:, t].exp()[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", h, k[:, t]))
        h = h + k[:, t, :, :, None] * u[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", h, scale * q[:, t]))
    return torch.stack(out, dim=1)


def random_inputs(batch, length, heads, dk, dv, dtype=torch.float64, device="cpu", seed=0):
    """q, k, v, g (log decay, float32 unless float64) and beta, as the GDN layer makes them."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = randn(batch, length, heads, dk), randn(batch, length, heads, dk)
    v = randn(batch, length, heads, dv)
    g = torch.nn.functional.logsigmoid(randn(batch, length, heads) + 2)
    beta = torch.sigmoid(randn(batch, length, heads))
    g_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return (
        *(x.to(device, dtype) for x in (q, k, v)),
        g.to(device, g_dtype),
        beta.to(device, dtype),
    )


@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
@pytest.mark.parametrize("length", [1, 7, 37, 64])
@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_chunked_gated_delta_rule_matches_the_naive_loop(chunk_size, length, use_qk_l2norm):
    inputs = random_inputs(2, length, 3, 8, 5, seed=length)
    expected = naive_gated_delta_rule(*inputs, use_qk_l2norm=use_qk_l2norm)
    got = torch_gated_delta_rule(*inputs, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_chunked_gated_delta_rule_gradients_match_the_naive_loop():
    inputs = [x.requires_grad_(True) for x in random_inputs(2, 21, 2, 6, 4, seed=3)]
    weights = torch.randn(2, 21, 2, 4, dtype=torch.float64)
    (naive_gated_delta_rule(*inputs) * weights).sum().backward()
    expected = [x.grad.clone() for x in inputs]
    for x in inputs:
        x.grad = None
    (torch_gated_delta_rule(*inputs, chunk_size=8) * weights).sum().backward()
    for got, want in zip((x.grad for x in inputs), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_gated_delta_rule_rejects_mismatched_shapes():
    q, k, v, g, beta = random_inputs(1, 4, 2, 8, 8)
    with pytest.raises(ValueError, match=r"expected q, k \[B, T, H, K\]"):
        torch_gated_delta_rule(q, k[:, :3], v, g, beta)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_linear_attention_kernel_matches_the_torch_version():
    kernel = gated_delta.fla_kernel()
    if kernel is None:
        pytest.skip("flash-linear-attention is not installed")
    q, k, v, g, beta = random_inputs(2, 300, 4, 64, 64, dtype=torch.bfloat16, device="cuda", seed=5)
    fla_out, _ = kernel(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(
        gated_delta.gated_delta_rule(q, k, v, g, beta), fla_out, rtol=0, atol=0
    )
    reference = torch_gated_delta_rule(q, k, v, g, beta)  # float32 inside, bf16 out
    torch.testing.assert_close(fla_out.float(), reference.float(), rtol=2e-2, atol=2e-2)


# --- the models ---------------------------------------------------------------------------------
def test_target_is_causal_and_returns_the_capture_layers():
    torch.manual_seed(0)
    target = HybridTarget(TINY_TARGET).eval()
    ids = torch.randint(0, TINY_TARGET.vocab, (2, 20))
    features = target(ids)
    assert features.shape == (2, 20, len(TINY_TARGET.capture_layers) * TINY_TARGET.dim)
    changed = ids.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % TINY_TARGET.vocab
    after = target(changed)
    torch.testing.assert_close(after[:, :12], features[:, :12], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(after[:, 12:], features[:, 12:])


def test_target_uses_both_layer_kinds():
    kinds = [type(layer.mixer).__name__ for layer in HybridTarget(TINY_TARGET).layers]
    assert kinds == ["GatedDeltaNet", "GatedDeltaNet", "GatedDeltaNet", "GatedAttention"]


def test_drafter_sees_context_before_its_anchor_and_only_its_block():
    torch.manual_seed(0)
    target = HybridTarget(TINY_TARGET).eval()
    drafter = BlockDrafter(target, TINY_DRAFTER)
    ids = torch.randint(0, TINY_TARGET.vocab, (1, 20))
    with torch.no_grad():
        features = target(ids)
        logits = drafter.predict(features, ids)
        anchors = drafter.anchors(20, ids.device).tolist()
        assert anchors == [0, 4, 8, 12, 16]
        assert logits.shape == (1, 5, TINY_DRAFTER.block - 1, TINY_TARGET.vocab)
        later = features.clone()
        later[:, 8:] += 1.0  # at anchor 8 and after (Note [Context before the anchor])
        moved = drafter.predict(later, ids)
        torch.testing.assert_close(moved[:, :3], logits[:, :3])  # anchors 0, 4, 8
        assert not torch.allclose(moved[:, 3:], logits[:, 3:])
        before_anchor = features.clone()
        before_anchor[:, 7] += 1.0
        assert not torch.allclose(drafter.predict(before_anchor, ids)[:, 2], logits[:, 2])
        # Block tokens other than the anchor are masks: the true tokens there do not leak.
        hidden = ids.clone()
        hidden[:, 9:12] = (hidden[:, 9:12] + 1) % TINY_TARGET.vocab
        torch.testing.assert_close(drafter.predict(features, hidden)[:, 2], logits[:, 2])


def test_drafter_trains_only_its_own_weights():
    target = HybridTarget(TINY_TARGET)
    drafter = BlockDrafter(target, TINY_DRAFTER)
    frozen = {n for n, p in drafter.named_parameters() if not p.requires_grad}
    assert frozen == {"embed.weight", "lm_head.weight"}
    assert torch.equal(drafter.embed.weight, target.embed.weight)


def test_markov_data_is_a_function_of_seed_and_index():
    data = MarkovTokens(64, 16, 3, seed=4)
    again = MarkovTokens(64, 16, 3, seed=4)
    assert torch.equal(data.batch(7)["input_ids"], again.batch(7)["input_ids"])
    assert not torch.equal(data.batch(7)["input_ids"], data.batch(8)["input_ids"])
    ids = data.batch(0)["input_ids"]
    assert ids.shape == (3, 16) and ids.min() >= 0 and ids.max() < 64
    for row in ids:  # every transition is one the chain allows
        for a, b in itertools.pairwise(row.tolist()):
            assert b in data.successors[a].tolist()


def test_placement_parses_devices_and_ratio():
    assert Placement.parse(["cpu"], "1:1") == Placement(("cpu",), ("cpu",))
    three = Placement.parse(["cuda:0", "cuda:1", "cuda:2"], "2:1")
    assert three == Placement(("cuda:0", "cuda:1"), ("cuda:2",))
    with pytest.raises(ValueError, match="expected 1 or 3 devices for ratio 2:1, got 2"):
        Placement.parse(["cpu", "cpu"], "2:1")
    with pytest.raises(ValueError, match="expected a ratio like 2:1"):
        Placement.parse(["cpu"], "2-1")


# --- the loops ------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", ["1:1", "2:1", "2:2"])
def test_sequential_executor_and_pipeline_losses_are_equal_on_cpu(ratio):
    placement = Placement.parse(["cpu"], ratio)
    data = MarkovTokens(TINY_TARGET.vocab, TINY_JOB.seq, TINY_JOB.batch, seed=1)
    batches = data.batches(0, 6 * TINY_JOB.accumulate)
    reference = [
        f()
        for f in sequential_steps(
            build_models(TINY_JOB, Placement.parse(["cpu"], "1:1")),
            Placement.parse(["cpu"], "1:1"),
            TINY_JOB,
            batches,
            6,
        )
    ]
    executor = [
        f()
        for f in executor_steps(
            build_models(TINY_JOB, placement), placement, TINY_JOB, batches, 6, depth=3
        )
    ]
    loop = PipelineLoop(build_models(TINY_JOB, placement), placement, TINY_JOB, depth=3)
    try:
        pipelined = [f() for f in loop.steps(batches, 6)]
    finally:
        loop.close()
    assert executor == reference
    assert pipelined == reference
    assert reference[-1] != reference[0]


# --- the script -----------------------------------------------------------------------------
def run_script(
    *args: str, outside: Path, nproc: int | None = None, as_module: bool = False
) -> subprocess.CompletedProcess:
    """Runs the example as its README says, on the installed pydflash with nothing added
    to the environment: by path from `outside` (a folder outside the checkout, so only the
    script's own folder is on sys.path), under torchrun with `nproc`, or with `as_module`
    as `python -m examples.train_dflash_online` from the checkout's root."""
    if as_module:
        command, cwd = [sys.executable, "-m", "examples.train_dflash_online", *args], ROOT
    else:
        command, cwd = [sys.executable, str(SCRIPT), *args], outside
        if nproc is not None:
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(nproc),
                *command[1:],
            ]
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.mark.timeout(300)
def test_the_tiny_example_trains_and_writes_a_loss_curve(tmp_path):
    result = run_script(
        "--tiny",
        "--steps",
        "24",
        "--log-every",
        "8",
        "--out",
        str(tmp_path),
        "--trace",
        str(tmp_path / "trace.json"),
        outside=tmp_path,
    )
    lines = result.stdout.splitlines()
    logs = [line for line in lines if line.startswith("pipeline step")]
    assert [line.split()[2] for line in logs] == ["8/24", "16/24", "24/24"]
    assert all("loss" in line and "tokens/s" in line for line in logs)
    png = (tmp_path / "loss_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "summary.json").read_text())
    losses = summary["loss_per_step"]
    assert len(losses) == 24
    assert sum(losses[-4:]) < sum(losses[:4])  # it learns the chain
    stats = summary["pipeline"]
    assert stats["hidden_bytes_peak"] <= 2 * stats["hidden_bytes_per_microbatch"]  # depth 2
    spans = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    labels = {e["name"] for e in spans if e["ph"] == "X"}
    assert {"_run_target", "MicrobatchSubmitter._drafter_task", "Pipeline._step_task"} <= labels


@pytest.mark.timeout(300)
@pytest.mark.parametrize("as_module", [False, True], ids=["script", "module"])
def test_check_mode_finds_the_pipeline_equal_to_the_sequential_loop(tmp_path, as_module):
    result = run_script(
        "--tiny",
        "--check",
        "--steps",
        "6",
        "--devices",
        "cpu",
        "--ratio",
        "2:1",
        "--no-plot",
        "--out",
        str(tmp_path),
        outside=tmp_path,
        as_module=as_module,
    )
    assert "check passed: pipeline losses equal the sequential loop's exactly" in result.stdout


@pytest.mark.timeout(300)
def test_check_mode_finds_graph_drafters_equal_to_the_sequential_loop(tmp_path):
    # On CPU lanes DrafterGraphs takes its padded path: equal up to float32 rounding.
    result = run_script(
        "--tiny",
        "--check",
        "--drafter-graphs",
        "--steps",
        "6",
        "--devices",
        "cpu",
        "--no-plot",
        "--out",
        str(tmp_path),
        outside=tmp_path,
    )
    assert "check passed: pipeline losses vs the sequential loop" in result.stdout
    assert "within the float32 tolerance" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["drafter_graphs"]["padding_waste"] > 0  # 32 tokens padded to 128


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flags", [(), ("--drafter-graphs",)], ids=["eager", "drafter-graphs"])
def test_torchrun_trains_one_ddp_drafter_across_two_processes(tmp_path, flags):
    # With --drafter-graphs the stage all-reduces its flat gradients over gloo in its step.
    steps, world = 4, 2
    run_script(
        *flags,
        "--tiny",
        "--steps",
        str(steps),
        "--devices",
        "cpu",
        "--no-plot",
        "--out",
        str(tmp_path),
        "--save-drafter",
        str(tmp_path / "drafter.pt"),
        nproc=world,
        outside=tmp_path,
    )
    names = ("summary.json", "summary.rank1.json")
    ranks = [json.loads((tmp_path / name).read_text()) for name in names]
    assert [r["world"] for r in ranks] == [world, world]
    assert ranks[0]["drafter_sha256"] == ranks[1]["drafter_sha256"]  # one drafter
    # The same training in one process: every rank's microbatches, one accumulation.
    # The script's LR decays over --steps.
    job = dataclasses.replace(TINY_JOB, accumulate=TINY_JOB.accumulate * world, decay_steps=steps)
    placement = Placement.parse(["cpu"], "1:1")
    models = build_models(job, placement)
    data = MarkovTokens(TINY_TARGET.vocab, job.seq, job.batch, seed=0)
    reference = [
        f()
        for f in sequential_steps(
            models, placement, job, data.batches(0, steps * job.accumulate), steps
        )
    ]
    trained = torch.load(tmp_path / "drafter.pt")
    for name, p in models.drafters[0].named_parameters():
        if p.requires_grad:
            # Padded (graph drafters), rounding differs: Adam's m / sqrt(v) magnifies it
            # where a gradient is near zero.
            atol = 5e-5 if flags else 1e-5
            torch.testing.assert_close(trained[name], p.detach(), rtol=1e-4, atol=atol)
    # Rank r's first microbatches are r, r + world: losses from the same initial weights.
    for rank, summary in enumerate(ranks):
        first = reference[0][rank::world]
        torch.testing.assert_close(summary["losses"][0], first, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fails", [False, True], ids=["trains", "raises"])
def test_ddp_drafters_are_freed_before_the_process_group_is_destroyed(tmp_path, monkeypatch, fails):
    # A DDP reducer releases the group with the GIL held, and gloo's destructor joins
    # workers that may need the GIL (process_group's docstring): a rare hang under torchrun,
    # so this checks the order instead. One process stands in for rank 0 of two.
    from examples import train_dflash_online as script

    alive: weakref.WeakSet = weakref.WeakSet()

    class TrackedDDP(torch.nn.parallel.DistributedDataParallel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            alive.add(self)

    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    init, destroy = torch.distributed.init_process_group, torch.distributed.destroy_process_group
    at_destroy = []

    def destroy_and_count():
        at_destroy.append(len(alive))
        destroy()

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", TrackedDDP)
    monkeypatch.setattr(
        torch.distributed,
        "init_process_group",
        lambda backend: init(backend, store=store, rank=0, world_size=1),
    )
    monkeypatch.setattr(torch.distributed, "destroy_process_group", destroy_and_count)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    if fails:  # the failed frames keep their locals in the traceback
        monkeypatch.setattr(script, "write_results", lambda *a: 1 / 0)
    argv = ["--tiny", "--steps", "2", "--devices", "cpu", "--no-plot", "--out", str(tmp_path)]
    with pytest.raises(ZeroDivisionError) if fails else contextlib.nullcontext():
        assert script.main(argv) == 0
    assert at_destroy == [0]
    assert not torch.distributed.is_initialized()
