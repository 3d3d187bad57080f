"""bench/target_speed.py's code paths on a CPU, in small: the script the H200 runs for
the target's speed and fidelity rows (FP8 emulated, FLA's rows skipped without FLA)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")


def test_smoke_run_writes_rows_table_and_fidelity(run_child_module, tmp_path):
    result = run_child_module(
        "bench.target_speed",
        *("--device", "cpu", "--config", "qwen3-next-tiny", "--seq", "32", "--reps", "1"),
        *("--only", "bf16,bf16 1-ulp input,fp8"),
        *("--fidelity-steps", "2", "--drafter", "tiny", "--out", str(tmp_path)),
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "target_speed.json").read_text())
    assert summary["complete"]
    rows = {row["variant"]: row for row in summary["rows"]}
    assert list(rows) == ["bf16 all hidden states", "bf16", "bf16 1-ulp input", "fp8"]
    layers = len(summary["capture_layers"])
    assert rows["bf16"]["layer_rel_errors"] == [0.0] * layers  # capture-only: the same
    fp8, floor = rows["fp8"]["layer_rel_errors"], rows["bf16 1-ulp input"]["layer_rel_errors"]
    assert len(fp8) == len(floor) == layers
    assert 0 < max(fp8) < 0.05
    assert min(floor) > 0 and max(floor) < min(fp8)  # one fp32 ulp: far below FP8's rounding
    gemms = rows["bf16"]["gemm_errors"]
    assert gemms and all(0.005 < g["fp8_rel_error"] < 0.08 for g in gemms)
    assert all(g["bf16_rel_error"] < 1e-5 for g in gemms)  # on a CPU the target is fp32
    fidelity = summary["fidelity"]
    losses = fidelity["losses"]
    assert list(losses) == ["bf16", "fp8", "bf16 1-ulp input"]
    assert all(len(curve) == 2 for curve in losses.values())
    assert losses["bf16"] != losses["fp8"]  # FP8 features differ
    assert fidelity["last_loss_relative_difference"]["bf16"] == 0.0
    table = (tmp_path / "target_speed.txt").read_text()
    assert "drafter loss after 2 steps" in table and table in result.stdout + "\n"
    assert "FP8 GEMMs alone" in table


def test_default_run_leaves_singles_and_compile_behind_their_flags():
    from bench import target_speed

    default = [v.name for v in target_speed.chosen(target_speed.parse_args([]))]
    assert default == [
        "bf16 all hidden states",
        "bf16",
        "bf16 1-ulp input",
        "fp8",
        "fp8 torchao",
        "bf16+fla",
        "fp8+fla",
    ]
    every = target_speed.chosen(target_speed.parse_args(["--singles", "--compile"]))
    assert len(every) == len(target_speed.VARIANTS)
    only = target_speed.chosen(target_speed.parse_args(["--only", "fp8+fla"]))
    assert [v.name for v in only] == ["bf16 all hidden states", "fp8+fla"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_ulp_moves_each_magnitude_one_step_as_nextafter(dtype):
    import torch

    from bench.target_speed_variants import one_ulp

    dtype = getattr(torch, dtype)
    x = (torch.randn(1000) * 10).to(dtype)
    x[:4] = 0
    up = torch.rand(1000) < 0.5
    away = torch.where(x >= 0, torch.inf, -torch.inf).to(dtype)
    want = torch.where(up, torch.nextafter(x, away), torch.nextafter(x, torch.zeros_like(x)))
    assert torch.equal(one_ulp(x, up), want)
