"""DFlash at Qwen3-8B's scale, on the CPU: the fused head + cross entropy against the plain
one, the data's anchors, the drafter's grouped block attention, its parameter count, a
training step at small shapes, and the bench section's CPU path."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench import dflash_scale
from bench.common import Context
from examples.dflash.data import MarkovTokens
from examples.dflash.fused_loss import linear_cross_entropy
from examples.dflash.loops import Job, Placement
from examples.dflash.models import (
    DFLASH_B16,
    TINY_TARGET,
    BlockAttention,
    BlockDrafter,
    DrafterConfig,
    HybridTarget,
    apply_rotary,
    drafter_parameters,
    query_groups,
    rotary,
)

SMALL = DrafterConfig(layers=2, heads=4, kv_heads=2, head_dim=16, block=4, anchors=6, group=2)


# --- the fused loss ---------------------------------------------------------------------------
@pytest.mark.parametrize("train_head", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_fused_loss_equals_the_plain_loss_in_fp64(chunk, train_head):
    g = torch.Generator().manual_seed(chunk)
    rows, dim, vocab = 45, 12, 70
    hidden = torch.randn(rows, dim, generator=g, dtype=torch.float64, requires_grad=True)
    head = (3 * torch.randn(vocab, dim, generator=g, dtype=torch.float64)).requires_grad_(
        train_head
    )
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[[2, 9, 30]] = -100
    weights = torch.rand(rows, generator=g, dtype=torch.float64)

    fused = linear_cross_entropy(hidden, head, labels, weights, chunk=chunk)
    fused.backward(torch.tensor(0.75, dtype=torch.float64))
    grads = hidden.grad.clone(), head.grad.clone() if train_head else None
    hidden.grad = None
    head.grad = None
    plain = F.cross_entropy(hidden @ head.T, labels, reduction="none", ignore_index=-100)
    plain = (plain * weights).sum()
    plain.backward(torch.tensor(0.75, dtype=torch.float64))

    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-10, atol=1e-12)
    assert grads[0][[2, 9, 30]].abs().max() == 0  # ignored rows get no gradient
    if train_head:
        torch.testing.assert_close(grads[1], head.grad, rtol=1e-10, atol=1e-12)


def test_fused_loss_in_fp32_is_close_to_fp64_and_survives_far_logits():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(33, 8, generator=g)
    head = 40 * torch.randn(50, 8, generator=g)  # logit gaps of hundreds: p underflows
    labels = torch.randint(0, 50, (33,), generator=g)
    h32 = hidden.clone().requires_grad_()
    fused = linear_cross_entropy(h32, head, labels, chunk=10)
    fused.backward()
    h64 = hidden.double().requires_grad_()
    plain = F.cross_entropy(h64 @ head.double().T, labels, reduction="sum")
    plain.backward()
    assert torch.isfinite(fused)
    torch.testing.assert_close(fused.double(), plain, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(h32.grad.double(), h64.grad, rtol=1e-4, atol=1e-4)


def test_fused_loss_checks_its_arguments():
    h, w, y = torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="expected hidden"):
        linear_cross_entropy(h, torch.zeros(5, 3), y)
    with pytest.raises(ValueError, match="expected labels"):
        linear_cross_entropy(h, w, y[:2])
    with pytest.raises(ValueError, match="chunk"):
        linear_cross_entropy(h, w, y, chunk=0)


# --- anchors from the data --------------------------------------------------------------------
def test_anchors_are_reproducible_fixed_in_count_and_leave_a_whole_block():
    data = MarkovTokens(64, 40, 3, seed=5, anchors=9, block=8)
    again = MarkovTokens(64, 40, 3, seed=5, anchors=9, block=8)
    batch = data.batch(2)
    assert torch.equal(batch["anchors"], again.batch(2)["anchors"])
    assert not torch.equal(batch["anchors"], data.batch(3)["anchors"])
    # The tokens do not depend on whether anchors are drawn.
    assert torch.equal(batch["input_ids"], MarkovTokens(64, 40, 3, seed=5).batch(2)["input_ids"])
    assert batch["anchors"].shape == (3, 40)
    for row in batch["anchors"]:
        anchors = row[:9]
        assert len(set(anchors.tolist())) == 9
        assert torch.equal(anchors, anchors.sort().values)
        assert anchors.min() >= 0 and anchors.max() <= 40 - 8
        assert row[9:].eq(0).all()
    # Sampling does not touch torch's global RNG.
    state = torch.get_rng_state()
    data.batch(4)
    assert torch.equal(state, torch.get_rng_state())


def test_anchor_counts_are_checked():
    with pytest.raises(ValueError, match="anchors <="):
        MarkovTokens(64, 16, 2, anchors=14, block=4)
    with pytest.raises(ValueError, match="block"):
        MarkovTokens(64, 16, 2, anchors=3)
    assert (
        MarkovTokens(64, 16, 2, anchors=13, block=4)
        .batch(0)["anchors"][:, :13]
        .sort(1)
        .values.tolist()
        == [list(range(13))] * 2
    )


# --- the drafter ------------------------------------------------------------------------------
def _drafter(cfg: DrafterConfig = SMALL) -> tuple[HybridTarget, BlockDrafter]:
    torch.manual_seed(0)
    target = HybridTarget(TINY_TARGET).eval().requires_grad_(False)
    return target, BlockDrafter(target, cfg)


def test_grouped_block_attention_equals_one_group_over_all_blocks():
    target, drafter = _drafter()
    batch = MarkovTokens(TINY_TARGET.vocab, 30, 2, seed=3, anchors=6, block=4).batch(0)
    ids, anchors = batch["input_ids"], batch["anchors"]
    features = target(ids)
    out = {}
    for group in (1, 2, 3, 6, 32):  # 6 and 32: one group of every block (the plain layout)
        drafter.cfg = dataclasses.replace(SMALL, group=group, context_copies=1e9)
        assert query_groups(drafter.cfg, 6, 30) == 6 // group if group <= 6 else 1
        out[group] = drafter.predict(features, ids, anchors)
    for group in (1, 2, 3, 32):
        torch.testing.assert_close(out[group], out[6], rtol=1e-5, atol=1e-5)


def test_query_groups_shrink_as_the_context_grows():
    cfg = dataclasses.replace(DFLASH_B16, block=8, anchors=512)  # 16 groups of 32 blocks at most
    assert [query_groups(cfg, 512, t) for t in (256, 550, 768, 4500, 8192, 32768)] == [
        16,
        8,  # 2 * 4096 / 550 = 14.9: the largest divisor of 16 within it
        8,
        1,
        1,
        1,
    ]
    assert query_groups(dataclasses.replace(cfg, context_copies=1e9), 512, 32768) == 16


def _old_attention(attn, x, context, anchors, block):
    """The drafter's attention as first written: every block against [context; every
    block] with a boolean mask, through SDPA's math path, key/value heads repeated."""
    batch, queries = x.shape[:2]
    length = context.shape[1]
    x_pos = (anchors[:, :, None] + torch.arange(block)).view(batch, -1)
    x_rot = rotary(x_pos, attn.head_dim, x.dtype)
    ctx_rot = rotary(torch.arange(length).expand(batch, -1), attn.head_dim, x.dtype)
    q = attn.q_proj(x).view(batch, queries, attn.heads, attn.head_dim)
    q = apply_rotary(attn.q_norm(q), *x_rot).transpose(1, 2)
    k_ctx, v_ctx = attn._keys_values(context, ctx_rot)
    k_x, v_x = attn._keys_values(x, x_rot)
    rep = attn.heads // attn.kv_heads
    k, v = (
        torch.cat(pair, dim=1).transpose(1, 2).repeat_interleave(rep, dim=1)
        for pair in ((k_ctx, k_x), (v_ctx, v_x))
    )
    query_anchor = anchors.repeat_interleave(block, dim=1)
    sees_context = torch.arange(length) < query_anchor[..., None]
    block_of = torch.arange(queries) // block
    same_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)
    mask = torch.cat([sees_context, same_block], dim=-1)[:, None]
    with sdpa_kernel(SDPBackend.MATH):
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return attn.out_proj(o.transpose(1, 2).reshape(batch, queries, -1))


@pytest.mark.parametrize("length", [9, 17, 30, 64])
@pytest.mark.parametrize("copies", [1.0, 2.0, 1e9])  # from the plain layout to every group
def test_block_attention_equals_the_plain_boolean_mask_forward_and_backward(length, copies):
    cfg = dataclasses.replace(SMALL, anchors=4, context_copies=copies, group=1)
    _, drafter = _drafter(cfg)
    drafter.double()
    torch.manual_seed(length)
    batch = MarkovTokens(TINY_TARGET.vocab, length, 2, seed=length, anchors=4, block=4).batch(0)
    ids, anchors = batch["input_ids"], batch["anchors"][:, :4]
    features = torch.randn(2, length, drafter.fc.in_features, dtype=torch.float64)
    grads = []
    for old in (False, True):
        attention = BlockAttention.forward
        if old:

            def attention(attn, x, context, layout):
                return _old_attention(attn, x, context, anchors, cfg.block)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(BlockAttention, "forward", attention)
            drafter.zero_grad()
            loss = drafter(features, ids, anchors)
            loss.backward()
        grads.append([loss] + [p.grad.clone() for p in drafter.parameters() if p.requires_grad])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("copies", [1.0, 1e9])  # the plain layout and every group
def test_a_block_sees_the_context_before_its_anchor_and_not_at_it(copies):
    # Note [Context before the anchor]: the feature at the anchor's own position does not
    # exist when drafting, so no prediction may depend on it; the one before it does.
    cfg = dataclasses.replace(SMALL, context_copies=copies)
    target, drafter = _drafter(cfg)
    batch = MarkovTokens(TINY_TARGET.vocab, 30, 2, seed=5, anchors=6, block=4).batch(0)
    ids, anchors = batch["input_ids"], batch["anchors"][:, :6]
    features = target(ids).detach()
    p = int(anchors[0, 0])
    assert p > 0 and int(anchors[0, 1]) > p  # the first block's anchor, not the last one's
    logits = drafter.predict(features, ids, anchors)
    for position, changes in ((p, False), (p - 1, True)):
        moved = features.clone()
        moved[0, position] += 1.0
        first_block = drafter.predict(moved, ids, anchors)[0, 0]
        assert (not torch.allclose(first_block, logits[0, 0])) is changes, position


def test_drafter_loss_is_the_plain_weighted_cross_entropy():
    target, drafter = _drafter()
    batch = MarkovTokens(TINY_TARGET.vocab, 30, 2, seed=3, anchors=6, block=4).batch(0)
    ids, anchors = batch["input_ids"], batch["anchors"]
    features = target(ids)
    logits = drafter.predict(features, ids, anchors)
    labels = ids.gather(1, (anchors[:, :6, None] + torch.arange(1, 4)).view(2, -1)).view(2, 6, 3)
    weights = torch.exp(-torch.arange(3.0) / SMALL.gamma_)  # DFlash's decay, gamma 2.5 at block 4
    plain = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none")
    plain = (plain.view(2, 6, 3) * weights).sum() / (weights.sum() * 12)
    torch.testing.assert_close(drafter(features, ids, anchors), plain, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="expected anchors"):
        drafter(features, ids)


def test_parameter_count_follows_the_shapes():
    dim, features, vocab = 64, 3 * 64, 100
    counts = drafter_parameters(SMALL, dim, features, vocab)
    inner, kv, hidden = SMALL.heads * SMALL.head_dim, SMALL.kv_heads * SMALL.head_dim, 3 * dim
    layer = dim * inner + dim * 2 * kv + inner * dim + 3 * dim * hidden + 2 * dim + 2 * 16
    assert counts["trainable"] == features * dim + 2 * dim + SMALL.layers * layer + dim
    assert counts["frozen"] == 2 * vocab * dim
    # The published recipe on Qwen3-8B (five capture layers): 1.05 B trainable.
    full = drafter_parameters(DFLASH_B16, 4096, 5 * 4096, 151936)
    print(f"DFlash b16 on Qwen3-8B: {full}")
    assert 1.04e9 < full["trainable"] < 1.06e9


def test_drafter_config_checks():
    with pytest.raises(ValueError, match="kv_heads"):
        DrafterConfig(heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="anchors"):
        DrafterConfig(anchors=0)


def test_a_small_dflash_step_trains_end_to_end_through_the_example(tmp_path):
    from examples import train_dflash_online

    argv = ["--tiny", "--anchors", "5", "--block", "4", "--steps", "2", "--check"]
    argv += ["--out", str(tmp_path), "--no-plot", "--drafter-layers", "2"]
    assert train_dflash_online.main(argv) == 0


# --- the bench section ------------------------------------------------------------------------
def _ctx() -> Context:
    return Context(quick=True, gpus=0, progress=lambda line: None)


def test_section_on_cpu_reports_its_rows_as_not_run_but_counts_parameters():
    pytest.importorskip("transformers")
    rows = dflash_scale.run(_ctx())
    count, *rest = rows
    assert count.name == "drafter parameters, trainable" and 1.04e9 < count.value < 1.06e9
    assert "exp(-(k-1)/7) at block 16; no loss mask" in count.note  # the objective it trains
    assert rest and all(r.value is None and "needs a GPU" in r.note for r in rest)
    assert {r.target for r in rest} >= {"value >= 0.435", "value >= 8", "<= 1.05"}


def test_section_measures_at_small_shapes_on_cpu_lanes():
    pytest.importorskip("transformers")
    from examples.dflash.hf import HFTargetConfig, dflash_layers

    torch.set_num_threads(1)
    job = Job(HFTargetConfig.load("qwen3-tiny", dflash_layers(6, 2)), SMALL, 24, 2, 2, 1e-3)
    scale = dflash_scale.Scale(job, Placement(("cpu",), ("cpu",)), steps=1, reps=1, warmup=1)
    rows = {r.name: r for r in dflash_scale.measure(_ctx(), scale)}
    assert rows["drafter step alone, per sample"].value > 0
    assert rows["drafter step alone, per sample"].extra["flops_per_step"] > 0
    assert rows["target prefill alone, tokens/s"].value > 0
    assert rows["pipeline, one GPU, samples/s"].value > 0
    assert rows["pipeline step vs executor loop"].baseline > 0
    rate, step = dflash_scale.data_parallel_rate(scale, ["cpu", "cpu"])
    assert rate > 0 and step > 0


def test_section_torchrun_path_trains_ddp_drafters_on_cpu():
    pytest.importorskip("transformers")
    from examples.dflash.hf import HFTargetConfig, dflash_layers
    from examples.dflash.models import DRAFTERS

    job = Job(
        HFTargetConfig.load("qwen3-tiny", dflash_layers(6, 1)), DRAFTERS["tiny"], 16, 2, 2, 1e-3
    )
    scale = dflash_scale.Scale(job, Placement(("cpu",), ("cpu",)), steps=1, reps=1, warmup=1)
    assert dflash_scale.torchrun_time(scale, 2, steps=2) > 0


# --- on a GPU ---------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_loss_on_gpu_in_bf16_is_close_to_the_plain_loss():
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(3000, 256, device="cuda", generator=g).bfloat16().requires_grad_()
    head = (torch.randn(20000, 256, device="cuda", generator=g) / 16).bfloat16()
    labels = torch.randint(0, 20000, (3000,), device="cuda", generator=g)
    fused = linear_cross_entropy(hidden, head, labels, chunk=1024)
    fused.backward()
    grad, hidden.grad = hidden.grad.float(), None
    plain = F.cross_entropy(hidden.float() @ head.float().T, labels, reduction="sum")
    plain.backward()
    torch.testing.assert_close(fused.float(), plain, rtol=2e-3, atol=0)
    torch.testing.assert_close(grad, hidden.grad.float(), rtol=5e-2, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_drafter_attention_runs_fused_kernels_on_gpu_and_matches_one_group():
    """The masked block attention must not need SDPA's math fallback (slow, and memory
    for every score): forward and backward run with the math backend turned off."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = dataclasses.replace(DFLASH_B16, layers=1, heads=8, kv_heads=2, anchors=64)
    target = HybridTarget(dataclasses.replace(TINY_TARGET, dim=512)).cuda()
    drafter = BlockDrafter(target, cfg).cuda()
    drafter.embed.bfloat16()
    drafter.lm_head.bfloat16()
    batch = MarkovTokens(TINY_TARGET.vocab, 768, 2, seed=3, anchors=64, block=16).batch(0)
    ids, anchors = batch["input_ids"].cuda(), batch["anchors"].cuda()
    features = torch.randn(2, 768, target.feature_dim, device="cuda", dtype=torch.bfloat16)
    fused = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
    with sdpa_kernel(fused), torch.autocast("cuda", torch.bfloat16):
        loss = drafter(features, ids, anchors)
        loss.backward()
        grouped = drafter.predict(features, ids, anchors).float()
        drafter.cfg = dataclasses.replace(cfg, group=64)  # one group: the plain layout
        plain = drafter.predict(features, ids, anchors).float()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in drafter.parameters() if p.requires_grad)
    torch.testing.assert_close(grouped, plain, rtol=2e-2, atol=2e-2)
