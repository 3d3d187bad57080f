"""bench/limits.py: the interval union behind GPU-busy time, host CPU time, FLOP counts."""

from __future__ import annotations

import os
import time

import pytest
import torch

from bench import limits


def test_union_counts_overlapping_spans_once():
    assert limits.union_length([]) == 0
    assert limits.union_length([(0, 10), (5, 15), (20, 30)]) == 25
    assert limits.union_length([(20, 30), (0, 10), (2, 3)]) == 20
    assert limits.union_length([(0, 10), (10, 12)]) == 12


def test_host_time_counts_cpu_work_and_not_sleep():
    def spin() -> None:  # 50 ms of this thread's CPU time, however loaded the machine is
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass

    busy = limits.measure(spin, reps=2, warmup=0)
    idle = limits.measure(lambda: time.sleep(0.05), reps=2, warmup=0)
    assert busy.wall_ms >= 45 and idle.wall_ms >= 45
    assert busy.host_ms >= 40
    assert idle.host_ms < busy.host_ms / 2


@pytest.mark.parametrize(
    ("cuda", "safe"),
    [(None, False), ("", False), ("11.8", False), ("12.4", False), ("12.6", True), ("13.0", True)],
)
def test_cupti_teardown_only_where_cuda_graphs_survive_it(cuda, safe):
    assert limits.cupti_teardown_safe(cuda) is safe


@pytest.mark.parametrize(("given", "expected"), [(None, "1"), ("0", "0")])
def test_a_profile_tears_cupti_down_after_it_unless_told_otherwise(monkeypatch, given, expected):
    # Note [No profiler left behind] (bench/limits.py): set before a profile starts.
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    if given is not None:
        monkeypatch.setenv("TEARDOWN_CUPTI", given)
    limits.profile([torch.profiler.ProfilerActivity.CPU])
    assert os.environ.get("TEARDOWN_CUPTI") == expected


def test_flop_count_of_a_matmul():
    a, b = torch.randn(8, 16), torch.randn(16, 32)
    assert limits.count_flops(lambda: a @ b) == 2 * 8 * 16 * 32


def test_flop_count_of_grouped_query_attention_counts_every_query_head():
    import torch.nn.functional as F

    q = torch.randn(2, 8, 16, 32, requires_grad=True)
    k, v = torch.randn(2, 2, 16, 32), torch.randn(2, 2, 16, 32)
    wide_k, wide_v = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)

    def step(key, value, **kwargs):
        return lambda: F.scaled_dot_product_attention(q, key, value, **kwargs).sum().backward()

    grouped = limits.count_flops(step(k, v, enable_gqa=True))
    assert grouped > 2 * 2 * (2 * 8 * 16 * 16 * 32)  # the two forward products, and more
    assert grouped == limits.count_flops(step(wide_k, wide_v))
