"""The example's own-data path: DFlash's objective against a plain reference, JSONL files
(token ids, or chat messages through a tiny local tokenizer trained here), batching by
length, and the microbatches through the pipeline."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from examples.dflash import jsonl, objective
from examples.dflash.loops import Job, PipelineLoop, Placement, build_models, sequential_steps
from examples.dflash.models import (
    TINY_DRAFTER,
    TINY_TARGET,
    BlockDrafter,
    DrafterConfig,
    HybridTarget,
)

ROOT = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PLAIN_TEMPLATE = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# Renders an assistant turn that later turns follow without its reasoning, as Qwen3's does.
REWRITING_TEMPLATE = PLAIN_TEMPLATE.replace(
    "{% if m['role'] == 'assistant' %}{{ m['content'] }}",
    "{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ m['content'].split('</think>')[-1].strip() }}<|im_end|>"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}",
)
THINKING = [
    {"role": "user", "content": "what is two plus two"},
    {"role": "assistant", "content": "<think>let me see</think> four of course"},
    {"role": "user", "content": "and three plus three"},
    {"role": "assistant", "content": "six is the answer"},
]
CHATS = [
    [
        {"role": "system", "content": "you are terse"},
        {"role": "user", "content": "what is two plus two"},
        {"role": "assistant", "content": "four of course"},
        {"role": "user", "content": "and three plus three"},
        {"role": "assistant", "content": "six is the answer"},
    ],
    [
        {"role": "user", "content": "say hello to the world"},
        {"role": "assistant", "content": "hello world and hello you"},
    ],
]


# --- the objective ------------------------------------------------------------------------------
def reference_loss(logits, ids, anchors, loss_mask, anchor_mask, block, gamma):
    """DFlash's loss written out one label at a time (Note [DFlash objective])."""
    total = weight = 0.0
    batch, length = ids.shape
    for b in range(batch):
        for i in range(anchors.shape[1]):
            p = int(anchors[b, i])
            if not anchor_mask[b, i] or p + block > length:
                continue
            if not (loss_mask[b, p] and loss_mask[b, p + 1]):
                continue
            for k in range(1, block):
                if loss_mask[b, p + k]:
                    w = math.exp(-(k - 1) / gamma)
                    total += w * F.cross_entropy(logits[b, i, k - 1], ids[b, p + k])
                    weight += w
    return total / weight


def test_default_gamma_is_dflashs():
    assert objective.default_gamma(16) == 7 and objective.default_gamma(8) == 4
    assert DrafterConfig(block=16).gamma_ == 7 and DrafterConfig(block=16, gamma=3).gamma_ == 3
    torch.testing.assert_close(
        objective.position_weights(4, 2.0), torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)])
    )
    with pytest.raises(ValueError, match="expected gamma > 0"):
        DrafterConfig(gamma=0)


@pytest.mark.parametrize("gamma", [None, 1.5])
def test_drafter_loss_is_the_published_objective(gamma):
    torch.manual_seed(0)
    target = HybridTarget(TINY_TARGET).eval().requires_grad_(False)
    cfg = DrafterConfig(layers=1, heads=2, head_dim=16, block=4, anchors=5, gamma=gamma)
    drafter = BlockDrafter(target, cfg)
    ids = torch.randint(0, TINY_TARGET.vocab, (2, 24))
    loss_mask = torch.zeros(2, 24, dtype=torch.long)
    loss_mask[0, 6:14] = loss_mask[0, 17:] = 1  # two assistant turns
    loss_mask[1, 10:] = 1
    # Anchors include ones the objective drops: a prompt token (3), a token whose next is
    # a prompt token (13), a block past the end (22) and a filler at a supervised position
    # (anchor_mask 0).
    anchors = torch.tensor([[3, 6, 10, 13, 18], [10, 11, 15, 22, 12]])
    anchor_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    features = target(ids)
    logits = drafter.predict(features, ids, anchors)
    want = reference_loss(logits, ids, anchors, loss_mask, anchor_mask, 4, cfg.gamma_)
    pad = torch.zeros(2, 19, dtype=torch.long)  # anchor and anchor_mask travel as [B, T]
    got = drafter(
        features,
        ids,
        torch.cat([anchors, pad], 1),
        loss_mask=loss_mask,
        anchor_mask=torch.cat([anchor_mask, pad], 1),
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Right padding with lengths (the padding contract) changes nothing.
    padded = F.pad(ids, (0, 8))
    lengths = torch.tensor([24, 24])
    same = drafter(
        target(padded),
        padded,
        torch.cat([anchors, pad, pad[:, :8]], 1),
        lengths,
        loss_mask=F.pad(loss_mask, (0, 8), value=1),  # past lengths even a 1 counts nothing
        anchor_mask=torch.cat([anchor_mask, pad, pad[:, :8]], 1),
    )
    torch.testing.assert_close(same, got, rtol=1e-5, atol=1e-6)


def test_unsupervised_labels_inside_a_kept_block_add_nothing():
    torch.manual_seed(1)
    target = HybridTarget(TINY_TARGET).eval().requires_grad_(False)
    drafter = BlockDrafter(target, TINY_DRAFTER)  # every block-th position is an anchor
    ids = torch.randint(0, TINY_TARGET.vocab, (1, 16))
    mask = torch.ones(1, 16, dtype=torch.long)
    mask[0, 6] = 0  # anchor 4's third label, and nothing else
    features = target(ids)
    changed = ids.clone()
    changed[0, 6] = (ids[0, 6] + 1) % TINY_TARGET.vocab  # its label changes
    with torch.no_grad():
        a = drafter(features, ids, loss_mask=mask)
        b = drafter(features, changed, loss_mask=mask)
    torch.testing.assert_close(a, b)
    logits = drafter.predict(features, ids)
    want = reference_loss(
        logits, ids, drafter.anchors(16, "cpu")[None], mask, torch.ones(1, 4), 4, 2.5
    )
    torch.testing.assert_close(a, want, rtol=1e-5, atol=1e-6)


# --- a tiny local tokenizer ---------------------------------------------------------------------
def make_tokenizer(path: Path, template: str) -> Path:
    """A word-level tokenizer trained here on the chats, saved as a transformers one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.WordLevelTrainer(special_tokens=specials)
    text = [m["content"] + " " + m["role"] for chat in [*CHATS, THINKING] for m in chat]
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = template
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {
        name: jsonl.load_tokenizer(make_tokenizer(root / name, template))
        for name, template in (
            ("generation", CHAT_TEMPLATE),
            ("plain", PLAIN_TEMPLATE),
            ("rewriting", REWRITING_TEMPLATE),
        )
    }


def assistant_text(tokenizer, sample: jsonl.Sample) -> str:
    return tokenizer.decode([t for t, m in zip(sample.ids, sample.mask, strict=True) if m])


def test_chat_masks_cover_the_assistant_turns_with_either_template(tokenizers):
    encoders = {
        name: jsonl.ChatEncoder(tok) for name, tok in tokenizers.items() if name != "rewriting"
    }
    assert encoders["generation"].method == "generation"
    assert encoders["plain"].method == "prefix"
    for chat in CHATS:
        by_generation = encoders["generation"].encode(chat)
        by_prefix = encoders["plain"].encode(chat)
        assert by_prefix == by_generation  # the same ids, the same mask
        text = assistant_text(tokenizers["plain"], by_prefix)
        want = " ".join(m["content"] + " <|im_end|>" for m in chat if m["role"] == "assistant")
        assert text.split() == want.split()
    # The content search (a template that rewrites earlier turns) finds the same tokens.
    plain = encoders["plain"]
    text = plain.render(CHATS[0])
    enc = plain.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = plain._content_spans(CHATS[0], text, enc)
    assert spans == plain._prefix_spans(CHATS[0], text)


def test_a_template_that_rewrites_earlier_turns_supervises_what_it_renders(tokenizers):
    chat = jsonl.ChatEncoder(tokenizers["rewriting"])
    assert chat.method == "prefix" and chat._prefix_spans(THINKING, chat.render(THINKING)) is None
    sample = chat.encode(THINKING)
    assert chat.searched == 1
    text = assistant_text(tokenizers["rewriting"], sample)
    assert text.split() == [
        "four",
        "of",
        "course",
        "<|im_end|>",
        "six",
        "is",
        "the",
        "answer",
        "<|im_end|>",
    ]
    assert tokenizers["rewriting"].decode(sample.ids).count("think") == 0


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_read_jsonl_takes_both_formats_and_cuts_long_samples(tmp_path, tokenizers):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 1, 1, 1]},
            "",
            {"input_ids": [7, 8, 9]},
            {"messages": CHATS[1]},
        ],
    )
    samples = jsonl.read_jsonl(path, tokenizers["plain"], max_length=4)
    assert samples[0] == jsonl.Sample((1, 2, 3, 4), (0, 0, 1, 1))
    assert samples[1] == jsonl.Sample((7, 8, 9), (1, 1, 1))
    whole = jsonl.ChatEncoder(tokenizers["plain"]).encode(CHATS[1])
    assert samples[2] == jsonl.Sample(whole.ids[:4], whole.mask[:4])


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([], "no samples (the file is empty)"),
        ([{"input_ids": [1, 2]}, "{oops"], ":2: not JSON"),
        ([{"input_ids": [1, -2]}], ':1: expected "input_ids" as a list of non-negative ints'),
        ([{"input_ids": [1, 2], "loss_mask": [1]}], ':1: expected "loss_mask" as 2 zeros and ones'),
        ([{"text": "hi"}], """:1: expected "input_ids" or "messages", got keys ['text']"""),
        ([{"messages": CHATS[0]}], ":1: chat messages need a tokenizer"),
        ([{"messages": [{"role": "user"}]}], ':1: expected "messages" as a list'),
        ([{"input_ids": [1]}, {"input_ids": [3, 64]}], ":2: token id 64 is outside the target's"),
    ],
)
def test_read_jsonl_names_the_bad_line(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(jsonl.DataError, match=re.escape(message)):
        jsonl.read_jsonl(path, vocab=64)


def test_missing_file_is_a_data_error(tmp_path):
    with pytest.raises(jsonl.DataError, match="no such file"):
        jsonl.read_jsonl(tmp_path / "nope.jsonl")


# --- batches by length --------------------------------------------------------------------------
def random_samples(n: int, seed: int = 0, vocab: int = 64) -> list[jsonl.Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(12, 60, (1,), generator=g))
        prompt = int(torch.randint(1, length // 2, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        out.append(jsonl.Sample(tuple(ids), (0,) * prompt + (1,) * (length - prompt)))
    return out


def test_length_buckets_hold_every_sample_once_per_epoch_with_little_padding():
    samples = random_samples(64)
    data = jsonl.LengthBuckets(samples, 4, seed=3, multiple=4, window=8, anchors=3, block=4)
    seen = sorted(i for group in data.epoch(0) for i in group)
    assert seen == list(range(64))
    assert data.epoch(1) != data.epoch(0)
    unsorted = jsonl.LengthBuckets(samples, 4, seed=3, multiple=4, window=1)
    assert data.padding_waste() < unsorted.padding_waste() / 2
    assert data.padding_waste() < 0.15
    lengths = set()
    for index in range(data.per_epoch):
        batch = data.batch(index)
        members = data.members(index)
        length = batch["input_ids"].shape[1]
        lengths.add(length)
        assert length % 4 == 0 and length == data.padded_length(members)
        for row, s in enumerate(members):
            assert batch["input_ids"][row, : len(s.ids)].tolist() == list(s.ids)
            assert batch["loss_mask"][row].tolist() == list(s.mask) + [0] * (length - len(s.ids))
            n = int(batch["anchor_mask"][row].sum())
            assert n == 3 and batch["anchor_mask"][row, :n].all()
            anchors = batch["anchors"][row, :n].tolist()
            assert anchors == sorted(set(anchors))
            for p in anchors:  # a whole block after it, the token and the next supervised
                assert p + 4 <= len(s.ids) and s.mask[p] and s.mask[p + 1]
    assert len(lengths) > 3  # the microbatches vary in length
    again = jsonl.LengthBuckets(samples, 4, seed=3, multiple=4, window=8, anchors=3, block=4)
    assert all(torch.equal(again.batch(9)[k], data.batch(9)[k]) for k in data.batch(9))


def test_a_short_sample_gets_fewer_anchors():
    short = jsonl.Sample((1, 2, 3, 4, 5, 6, 7), (0, 0, 1, 1, 1, 1, 1))
    data = jsonl.LengthBuckets([short], 1, anchors=8, block=4)
    batch = data.batch(0)
    assert batch["anchor_mask"][0].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert batch["anchors"][0, :2].tolist() == [2, 3]
    assert jsonl.trainable([short, jsonl.Sample((1, 2, 3), (1, 1, 1))], 4) == [short]


@pytest.mark.parametrize("drafter_graphs", [False, True], ids=["eager", "drafter-graphs"])
@pytest.mark.parametrize("anchors", [None, 3])
def test_variable_length_microbatches_through_the_pipeline_equal_the_sequential_loop(
    anchors, drafter_graphs
):
    samples = jsonl.trainable(random_samples(40, seed=5), TINY_DRAFTER.block)
    drafter = DrafterConfig(layers=1, heads=2, head_dim=16, block=4, anchors=anchors)
    job = Job(TINY_TARGET, drafter, seq=64, batch=2, accumulate=2, lr=3e-3, samples=samples)
    data = job.data(seed=0)
    batches = data.batches(0, 5 * job.accumulate)
    assert len({b["input_ids"].shape[1] for b in batches}) > 1
    one = Placement.parse(["cpu"], "1:1")
    reference = [f() for f in sequential_steps(build_models(job, one), one, job, batches, 5)]
    placement = Placement.parse(["cpu"], "2:1")
    models = build_models(job, placement)
    loop = PipelineLoop(models, placement, job, depth=3, drafter_graphs=drafter_graphs)
    try:
        pipelined = [f() for f in loop.steps(batches, 5)]
    finally:
        loop.close()
    assert reference[-1] != reference[0]
    if not drafter_graphs:
        assert pipelined == reference
        return
    # Padded to the stage's length buckets (the loss mask and anchors too): the padding
    # contract holds with a loss mask, up to float32 rounding.
    assert loop.drafter_graph_stats()["padding_waste"] > 0
    torch.testing.assert_close(pipelined, reference, rtol=1e-4, atol=0)


@pytest.mark.timeout(300)
def test_the_script_trains_on_chat_data_with_the_target_models_tokenizer(tmp_path):
    """The README's command: a local checkpoint with its tokenizer, and a chat JSONL."""
    from examples.dflash.hf import HFTargetConfig

    model = tmp_path / "model"
    torch.manual_seed(3)
    HFTargetConfig.load("qwen3-next-tiny").build().model.save_pretrained(model)
    make_tokenizer(model, PLAIN_TEMPLATE)
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in [*CHATS, THINKING] * 3])
    result = subprocess.run(
        [
            sys.executable, str(ROOT / "examples" / "train_dflash_online.py"), "--tiny",
            "--target-model", str(model), "--data", str(data), "--seq", "64", "--steps", "3",
            "--check", "--devices", "cpu", "--no-plot", "--out", str(tmp_path / "out"),
        ],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "check passed: pipeline losses equal the sequential loop's exactly" in result.stdout
    assert f"{data}: 9 samples, 4 microbatches per epoch, padding" in result.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["data"] == str(data) and summary["gamma"] == 2.5 and summary["steps"] == 3
