"""A user's own training data: a local JSONL file, batched by length.

Each line is one sample, in one of two formats:

    {"input_ids": [151644, 872, ...], "loss_mask": [0, 0, ..., 1, 1]}
    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}

The first is already tokenized; `loss_mask` (1 on supervised tokens) is optional and
defaults to every token. The second goes through a local tokenizer's chat template, and
only the assistant turns are supervised (`ChatEncoder`). Blank lines are skipped; a line
that is neither format stops the run with the file and line (`DataError`).

Note [Length buckets]: microbatches hold `batch` whole samples, padded on the right to
the longest of them (rounded up to `multiple`). Each epoch shuffles the samples, sorts
them by length within windows of `window` microbatches, cuts the windows into
microbatches and shuffles those: samples of similar length share a microbatch, so
little is padding, and the order still changes every epoch. Packing several samples
into one row would waste nothing, but needs per-sequence boundaries in every attention
and recurrence of the target (a gated-delta-rule state must not run across samples)
and in the drafter's context; bucketing keeps one sample per row, so the target and the
drafter run unchanged. `LengthBuckets.padding_waste` reports what it costs. Microbatch
`index` is a pure function of (seed, index), as `MarkovTokens`' are: any process, loop
or resumed run sees the same data.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import torch


class DataError(ValueError):
    """A data file the example cannot use; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class Sample:
    ids: tuple[int, ...]
    mask: tuple[int, ...]  # 1 where the token is supervised


# --- chat messages ------------------------------------------------------------------------------
GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


def load_tokenizer(path: Path) -> Any:
    """A local tokenizer (`AutoTokenizer.from_pretrained(path, local_files_only=True)`)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError("chat messages need transformers: pip install 'pydflash[hf]'") from None
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot load a tokenizer from {path}: {exc}") from None


class ChatEncoder:
    """Chat messages to token ids and a mask of the assistant's tokens.

    Where the chat template marks the assistant's text with `{% generation %}`,
    transformers returns the mask itself (`return_assistant_tokens_mask`). Most
    templates (Qwen's, Llama's) have no such markers; for them each assistant turn is
    located by rendering the conversation up to it: the turn's text starts where the
    rendering of the earlier messages with the generation prompt ends, and ends where
    the rendering through the turn ends (less trailing whitespace): the assistant's
    content and the end-of-turn token after it. The whole conversation is tokenized once
    and the tokens that start inside a turn are supervised, so the ids are the
    template's own. A template that rewrites earlier turns when later ones follow (e.g.
    dropping their reasoning) renders prefixes that are not prefixes of the whole: then
    each assistant content is found in order in the rendered text, with the special
    token that closes it."""

    def __init__(self, tokenizer: Any) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError("the tokenizer has no chat template: it cannot encode messages")
        if not getattr(tokenizer, "is_fast", False):
            raise DataError("expected a fast tokenizer (with offsets), got a slow one")
        self.tokenizer = tokenizer
        self.method = "generation" if GENERATION.search(tokenizer.chat_template) else "prefix"
        self.searched = 0  # samples whose turns the content search found (see above)

    def render(self, messages: list[dict], prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=prompt
        )

    def encode(self, messages: list[dict]) -> Sample:
        if self.method == "generation":
            out = self.tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            return Sample(tuple(out["input_ids"]), tuple(out["assistant_masks"]))
        text = self.render(messages)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        spans = self._prefix_spans(messages, text)
        if spans is None:
            spans = self._content_spans(messages, text, enc)
            self.searched += 1
        mask = [int(any(a <= s < b for a, b in spans)) for s, _ in enc["offset_mapping"]]
        return Sample(tuple(enc["input_ids"]), tuple(mask))

    def _prefix_spans(self, messages: list[dict], text: str) -> list[tuple[int, int]] | None:
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], prompt=True) if i else ""
            through = self.render(messages[: i + 1]).rstrip()
            if not (through.startswith(before) and text.startswith(through)):
                return None
            spans.append((len(before), len(through)))
        return spans

    def _content_spans(self, messages: list[dict], text: str, enc: Any) -> list[tuple[int, int]]:
        special = set(self.tokenizer.all_special_ids) | set(
            self.tokenizer.added_tokens_decoder or {}
        )
        spans, at = [], 0
        for message in messages:
            if message["role"] != "assistant" or not message["content"].strip():
                continue
            # As rendered in full, or as templates render earlier turns: without reasoning.
            whole = message["content"].strip()
            answer = whole.rsplit("</think>", 1)[-1].strip()
            content = whole if text.find(whole, at) >= 0 else answer
            start = text.find(content, at)
            if start < 0 or not content:
                raise ValueError("an assistant turn's content is not in the rendered chat")
            end = at = start + len(content)
            for token, (s, e) in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
                if s >= end:  # the first token after the content: the end of turn if special
                    end = e if token in special and not text[end:s].strip() else end
                    break
            spans.append((start, end))
        return spans


# --- the file -----------------------------------------------------------------------------------
def _ids(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise ValueError(f'expected "{what}" as a list of non-negative ints')
    return value


class _Chat:
    """A ChatEncoder made at the first chat sample: a file of token ids needs none."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.encoder = tokenizer, None

    def __call__(self) -> ChatEncoder:
        if self.tokenizer is None:
            raise ValueError(
                "chat messages need a tokenizer: pass --tokenizer DIR (or --target-model)"
            )
        if self.encoder is None:
            tok = self.tokenizer
            self.encoder = ChatEncoder(load_tokenizer(tok) if isinstance(tok, str | Path) else tok)
        return self.encoder


def _parse(obj: Any, chat: _Chat) -> Sample:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "input_ids" in obj:
        ids = _ids(obj["input_ids"], "input_ids")
        mask = _ids(obj.get("loss_mask", [1] * len(ids)), "loss_mask")
        if len(mask) != len(ids) or any(m > 1 for m in mask):
            raise ValueError(
                f'expected "loss_mask" as {len(ids)} zeros and ones (one per token), '
                f"got {len(mask)} values"
            )
        return Sample(tuple(ids), tuple(mask))
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
            for m in messages
        ):
            raise ValueError('expected "messages" as a list of {"role": ..., "content": ...}')
        return chat().encode(messages)
    raise ValueError(f'expected "input_ids" or "messages", got keys {sorted(obj)}')


def read_jsonl(
    path: Path,
    tokenizer: Path | Any = None,
    *,
    max_length: int | None = None,
    vocab: int | None = None,
) -> list[Sample]:
    """The file's samples, cut to `max_length` tokens. Chat samples go through
    `tokenizer` (a loaded one or a local directory, loaded at the first chat sample).
    Raises DataError naming the line of the first bad sample (a token id >= `vocab`
    among them), or saying the file is missing or holds none."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    chat = _Chat(tokenizer)
    samples = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                sample = _parse(json.loads(line), chat)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{number}: not JSON ({exc.msg})") from None
            except DataError as exc:
                raise DataError(f"{path}:{number}: {exc}") from None
            except (ValueError, TypeError, KeyError) as exc:
                raise DataError(f"{path}:{number}: {exc}") from None
            if vocab is not None and max(sample.ids, default=0) >= vocab:
                raise DataError(
                    f"{path}:{number}: token id {max(sample.ids)} is outside the target's "
                    f"vocabulary of {vocab}"
                )
            if max_length is not None:
                sample = Sample(sample.ids[:max_length], sample.mask[:max_length])
            samples.append(sample)
    if not samples:
        raise DataError(f"{path}: no samples (the file is empty)")
    return samples


def trainable(samples: list[Sample], block: int) -> list[Sample]:
    """The samples with at least one anchor: a whole block after a position whose token
    and next are supervised (Note [DFlash objective])."""
    return [s for s in samples if _valid_anchors(s, block)]


def _valid_anchors(sample: Sample, block: int) -> list[int]:
    mask = sample.mask
    return [p for p in range(len(mask) - block + 1) if mask[p] and mask[p + 1]]


# --- batches by length --------------------------------------------------------------------------
class LengthBuckets:
    """Microbatches of `batch` samples of similar length (Note [Length buckets]), with the
    interface of `data.MarkovTokens`: `batch(index)`, `batches(start, count, stride)`.

    Each microbatch is {"input_ids": [B, L], "loss_mask": [B, L]} with L the longest
    sample rounded up to `multiple`, padded with token 0 and mask 0. With `anchors`
    (and the drafter's `block`), also "anchors" and "anchor_mask" [B, L]: per row, up to
    `anchors` distinct positions p with a whole block after them, whose token and next
    are supervised, sorted, drawn from the microbatch's own generator, in the first
    entries; "anchor_mask" is 1 on the real ones (a short sample has fewer).
    An epoch is len(samples) // batch microbatches (the rest waits for the next)."""

    def __init__(
        self,
        samples: list[Sample],
        batch: int,
        *,
        seed: int = 0,
        multiple: int = 8,
        window: int = 64,
        anchors: int | None = None,
        block: int | None = None,
    ) -> None:
        if batch < 1 or multiple < 1 or window < 1:
            raise ValueError(
                f"expected batch, multiple, window >= 1, got {batch}, {multiple}, {window}"
            )
        if len(samples) < batch:
            raise DataError(
                f"expected at least {batch} samples (one microbatch), got {len(samples)}"
            )
        if anchors is not None and (block is None or block < 2):
            raise ValueError(f"expected block >= 2 with anchors, got {block}")
        self.samples, self.batch_size, self.seed = samples, batch, seed
        self.multiple, self.window, self.anchors, self.block = multiple, window, anchors, block
        self.per_epoch = len(samples) // batch
        self._epochs: dict[int, list[list[int]]] = {}  # the last two asked for

    def epoch(self, epoch: int) -> list[list[int]]:
        """The sample indices of each microbatch of `epoch`."""
        if epoch in self._epochs:
            return self._epochs[epoch]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.samples), generator=g).tolist()
        order = order[: self.per_epoch * self.batch_size]
        span = self.window * self.batch_size
        groups = []
        for lo in range(0, len(order), span):
            window = sorted(order[lo : lo + span], key=lambda i: len(self.samples[i].ids))
            groups += [
                window[i : i + self.batch_size] for i in range(0, len(window), self.batch_size)
            ]
        groups = [groups[i] for i in torch.randperm(len(groups), generator=g).tolist()]
        self._epochs = {**dict(list(self._epochs.items())[-1:]), epoch: groups}
        return groups

    def members(self, index: int) -> list[Sample]:
        epoch, j = divmod(index, self.per_epoch)
        return [self.samples[i] for i in self.epoch(epoch)[j]]

    def tokens(self, index: int) -> int:
        """Microbatch `index`'s real (unpadded) tokens."""
        return sum(len(s.ids) for s in self.members(index))

    def padded_length(self, members: list[Sample]) -> int:
        return math.ceil(max(len(s.ids) for s in members) / self.multiple) * self.multiple

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        members = self.members(index)
        length = self.padded_length(members)
        ids = torch.zeros(len(members), length, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, s in enumerate(members):
            ids[row, : len(s.ids)] = torch.tensor(s.ids)
            mask[row, : len(s.mask)] = torch.tensor(s.mask)
        out = {"input_ids": ids, "loss_mask": mask}
        if self.anchors is not None:
            out["anchors"], out["anchor_mask"] = self._draw(index, members, length)
        return out

    def _draw(self, index: int, members: list[Sample], length: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index + (1 << 40))
        anchors = torch.zeros(len(members), length, dtype=torch.long)
        keep = torch.zeros_like(anchors)
        for row, s in enumerate(members):
            valid = torch.tensor(_valid_anchors(s, self.block), dtype=torch.long)
            n = min(self.anchors, len(valid))
            chosen = valid[torch.randperm(len(valid), generator=g)[:n]].sort().values
            anchors[row, :n], keep[row, :n] = chosen, 1
        return anchors, keep

    def batches(self, start: int, count: int, stride: int = 1, *, pin: bool = False) -> list[dict]:
        """Microbatches start, start + stride, ... (count of them)."""
        out = [self.batch(start + i * stride) for i in range(count)]
        if pin:
            out = [{key: t.pin_memory() for key, t in b.items()} for b in out]
        return out

    def padding_waste(self, epoch: int = 0) -> float:
        """The share of an epoch's microbatch tokens that are padding."""
        real = padded = 0
        for group in self.epoch(epoch):
            members = [self.samples[i] for i in group]
            real += sum(len(s.ids) for s in members)
            padded += len(members) * self.padded_length(members)
        return 1 - real / padded
