"""bench/target_speed.py's code paths on a CPU, in small: the script the H200 runs for
the target's speed rows (FP8 emulated, FLA's rows skipped without FLA)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")


def test_smoke_run_writes_rows_table_and_fidelity(run_child_module, tmp_path):
    result = run_child_module(
        "bench.target_speed",
        *("--device", "cpu", "--config", "qwen3-next-tiny", "--seq", "32", "--reps", "1"),
        *("--only", "bf16,fp8,bf16+compile", "--no-compile"),
        *("--fidelity-steps", "2", "--drafter", "tiny", "--out", str(tmp_path)),
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "target_speed.json").read_text())
    rows = {row["variant"]: row for row in summary["rows"]}
    assert list(rows) == ["bf16 all hidden states", "bf16", "fp8", "bf16+compile"]
    assert rows["bf16"]["features_rel_error"] == 0.0  # capture-only: the same features
    assert 0 < rows["fp8"]["features_rel_error"] < 0.05
    assert rows["bf16+compile"]["skipped"] == "skipped: --no-compile"
    fidelity = summary["fidelity"]
    assert len(fidelity["loss_bf16_target"]) == len(fidelity["loss_fp8_target"]) == 2
    assert fidelity["loss_bf16_target"] != fidelity["loss_fp8_target"]  # FP8 features differ
    table = (tmp_path / "target_speed.txt").read_text()
    assert "fidelity (2 steps)" in table and table in result.stdout + "\n"
