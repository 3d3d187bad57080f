"""The example run as a user runs it: resume after --stop-after or Ctrl-C equal to an
uninterrupted run, export and load back, the scalars it writes, and user errors that end
in a one-line reason instead of a traceback."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.dflash import checkpoint, export
from examples.dflash.data import MarkovTokens
from examples.dflash.loops import Job, Placement, build_models, sequential_steps
from examples.dflash.models import TINY_TARGET, BlockDrafter, DrafterConfig, HybridTarget

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_dflash_online.py"
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def script(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=240
    )
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def token_file(path: Path, n: int = 40, seed: int = 0) -> Path:
    """Token-id samples of 10..60 tokens, each a prompt (mask 0) then a reply (mask 1)."""
    g = torch.Generator().manual_seed(seed)
    lines = []
    for _ in range(n):
        length = int(torch.randint(10, 60, (1,), generator=g))
        prompt = int(torch.randint(1, length // 2, (1,), generator=g))
        ids = torch.randint(0, TINY_TARGET.vocab, (length,), generator=g).tolist()
        lines.append(
            json.dumps({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (length - prompt)})
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def losses(out: Path) -> list[list[float]]:
    return json.loads((out / "summary.json").read_text())["losses"]


# --- resume -------------------------------------------------------------------------------------
def run_args(data: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return [
        "--tiny", "--data", str(data), "--seq", "64", "--anchors", "3", "--warmup", "2",
        "--steps", str(steps), "--log-every", "1", "--no-plot", "--out", str(out), *extra,
    ]  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "flags",
    [("--mode", "pipeline"), ("--mode", "sequential"), ("--drafter-graphs",)],
    ids=["pipeline", "sequential", "drafter-graphs"],
)
def test_resumed_run_equals_an_uninterrupted_one_exactly_on_cpu(tmp_path, flags):
    data = token_file(tmp_path / "d.jsonl")
    whole, part = tmp_path / "whole", tmp_path / "part"
    common = (*flags, "--devices", "cpu")
    script(*run_args(data, whole, 7, *common, "--export", str(whole / "drafter")), cwd=tmp_path)
    script(*run_args(data, part, 7, *common, "--stop-after", "3"), cwd=tmp_path)
    assert len(losses(part)) == 3
    resumed = script(*run_args(data, part, 7, *common, "--resume"), cwd=tmp_path)
    assert "resumed after step 3" in resumed.stdout
    assert losses(part) == losses(whole)[3:]
    summary = json.loads((part / "summary.json").read_text())
    assert summary["first_step"] == 4
    # The scalars of both processes, one CSV: steps 1-3, then 4-7.
    rows = (part / "metrics.csv").read_text().splitlines()
    assert rows[0].split(",")[:3] == ["step", "loss", "lr"]
    assert [r.split(",")[0] for r in rows[1:]] == [str(s) for s in range(1, 8)]
    # The same weights: the export of the whole run loads into the resumed drafter's sums.
    whole_sum = json.loads((whole / "summary.json").read_text())["drafter_sha256"]
    assert summary["drafter_sha256"] == whole_sum


@pytest.mark.timeout(300)
def test_ctrl_c_checkpoints_the_last_finished_step_and_resume_continues(tmp_path):
    data = token_file(tmp_path / "d.jsonl")
    out = tmp_path / "run"
    args = run_args(data, out, 100_000, "--devices", "cpu", "--checkpoint-every", "1000")
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith("pipeline step 3/"):
                break
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, rest + err
    assert "Traceback" not in err
    done = int(rest.split("interrupted after step ")[1].split(":")[0])
    assert done >= 3
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == done
    # The lanes may finish a step the loop has not reported yet: it is in the checkpoint.
    assert 3 <= len(losses(out)) <= done
    script(
        *run_args(data, out, 100_000, "--devices", "cpu", "--resume", "--stop-after", "2"),
        cwd=tmp_path,
    )
    reference = tmp_path / "reference"
    stop = str(done + 2)
    script(
        *run_args(data, reference, 100_000, "--devices", "cpu", "--stop-after", stop), cwd=tmp_path
    )
    assert losses(out) == losses(reference)[done:]


@pytest.mark.gpu
@GPU
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "flags", [(), ("--target-graphs", "--drafter-graphs")], ids=["eager", "graphs"]
)
def test_resumed_run_equals_an_uninterrupted_one_on_a_gpu(tmp_path, flags):
    data = token_file(tmp_path / "d.jsonl")
    whole, part = tmp_path / "whole", tmp_path / "part"
    common = (*flags, "--devices", "cuda:0", "--ratio", "1:1")
    script(*run_args(data, whole, 7, *common), cwd=tmp_path)
    script(*run_args(data, part, 7, *common, "--stop-after", "3"), cwd=tmp_path)
    script(*run_args(data, part, 7, *common, "--resume"), cwd=tmp_path)
    got = [x for step in losses(part) for x in step]
    want = [x for step in losses(whole)[3:] for x in step]
    torch.testing.assert_close(got, want, rtol=2e-2, atol=0)  # bf16 autocast, reductions


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    job = Job(TINY_TARGET, DrafterConfig(layers=1, heads=2, head_dim=16, block=4), 32, 2, 2, 3e-3)
    models = build_models(job, Placement.parse(["cpu"], "1:1"))
    checkpoint.save(tmp_path / "c.pt", models, 0, {"seed": 0, "batch": 2})
    assert checkpoint.load(tmp_path / "c.pt", {"seed": 0, "batch": 2})["step"] == 0
    with pytest.raises(checkpoint.ResumeError, match=r"another run's: expected \{'batch': 4\}"):
        checkpoint.load(tmp_path / "c.pt", {"seed": 0, "batch": 4})
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temporary file left


def test_checkpoint_restores_optimizer_and_scheduler_state(tmp_path):
    job = Job(TINY_TARGET, DrafterConfig(layers=1, heads=2, head_dim=16, block=4), 32, 2, 2, 3e-3,
              warmup=3, decay_steps=10)  # fmt: skip
    placement = Placement.parse(["cpu"], "1:1")
    data = MarkovTokens(TINY_TARGET.vocab, 32, 2, seed=1)
    trained = build_models(job, placement)
    for f in sequential_steps(trained, placement, job, data.batches(0, 6), 3):
        f()
    checkpoint.save(tmp_path / "c.pt", trained, 3, {})
    fresh = build_models(job, placement)
    assert checkpoint.restore(checkpoint.load(tmp_path / "c.pt", {}), fresh) == 3
    assert fresh.schedulers[0].get_last_lr() == trained.schedulers[0].get_last_lr()
    more = [f() for f in sequential_steps(trained, placement, job, data.batches(6, 4), 2)]
    again = [f() for f in sequential_steps(fresh, placement, job, data.batches(6, 4), 2)]
    assert more == again


# --- export -------------------------------------------------------------------------------------
def test_export_round_trips_the_drafter(tmp_path):
    torch.manual_seed(0)
    target = HybridTarget(TINY_TARGET).eval().requires_grad_(False)
    cfg = DrafterConfig(layers=2, heads=2, kv_heads=1, head_dim=16, block=4, anchors=5, gamma=3.0)
    drafter = BlockDrafter(target, cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # trained weights, not the initial ones
    path = export.export(drafter, tmp_path / "drafter", target_layers=(1, 3))
    meta = json.loads((path / "config.json").read_text())
    assert meta["architectures"] == ["DFlashBlockDrafter"]
    assert (meta["block_size"], meta["loss_decay_gamma"], meta["target_layer_ids"]) == (
        4,
        3.0,
        [1, 3],
    )
    assert (meta["hidden_size"], meta["num_hidden_layers"], meta["num_key_value_heads"]) == (
        32,
        2,
        1,
    )
    loaded = export.load(path)
    assert loaded.cfg == cfg
    frozen = {n for n, p in loaded.named_parameters() if not p.requires_grad}
    assert frozen == {"embed.weight", "lm_head.weight"}
    batch = MarkovTokens(TINY_TARGET.vocab, 24, 2, seed=2, anchors=5, block=4).batch(0)
    features = target(batch["input_ids"])
    with torch.no_grad():
        want = drafter.predict(features, batch["input_ids"], batch["anchors"])
        got = loaded.predict(features, batch["input_ids"], batch["anchors"])
    assert torch.equal(got, want)
    again = export.export(loaded, tmp_path / "drafter", target_layers=(1, 3))  # overwrites
    assert sorted(p.name for p in again.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


# --- the scalars --------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_scalars_go_to_csv_and_to_tensorboard_when_installed(tmp_path):
    result = script(
        "--tiny", "--steps", "4", "--log-every", "2", "--no-plot", "--out", str(tmp_path),
        "--tensorboard", cwd=tmp_path,
    )  # fmt: skip
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert rows[0] == "step,loss,lr,samples_per_s,tokens_per_s,memory_bytes"
    assert [r.split(",")[0] for r in rows[1:]] == ["2", "4"]
    assert all(float(x) > 0 for r in rows[1:] for x in r.split(","))
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        assert "tensorboard is not installed" in result.stderr
    else:
        assert any((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


# --- a user's errors ----------------------------------------------------------------------------
BAD_DATA = {
    "missing.jsonl": None,
    "empty.jsonl": "",
    "bad.jsonl": '{"input_ids": [1, 2, 3]}\n\n{"input_ids": [1, 2}\n',
    "mask.jsonl": '{"input_ids": [1, 2, 3], "loss_mask": [1, 1]}\n',
}
CASES = {
    "seq": (["--seq", "1"], "--seq must be >= 2 (a token and the next), got 1"),
    "device": (["--devices", "cuda:0"], "--devices cuda:0: no GPU is visible here"),
    "device-name": (["--devices", "gpu0"], "--devices gpu0: expected a device such as cpu"),
    "ratio": (["--ratio", "2-1"], "expected a ratio like 2:1 (targets:drafters), got '2-1'"),
    "anchors": (["--anchors", "500"], "expected 1 <= anchors <= seq - block + 1 = 29, got 500"),
    "missing": (["--data", "missing.jsonl"], "missing.jsonl: no such file"),
    "empty": (["--data", "empty.jsonl"], "empty.jsonl: no samples (the file is empty)"),
    "malformed": (["--data", "bad.jsonl"], "bad.jsonl:3: not JSON (Expecting ',' delimiter)"),
    "mask": (["--data", "mask.jsonl"], 'mask.jsonl:1: expected "loss_mask" as 3 zeros and ones'),
    "resume": (["--resume"], "checkpoint.pt: no checkpoint there"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_user_errors_end_in_the_usage_line_with_the_reason(tmp_path, case):
    if case == "device" and torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    for name, text in BAD_DATA.items():
        if text is not None:
            (tmp_path / name).write_text(text)
    flags, reason = CASES[case]
    result = script("--tiny", "--out", str(tmp_path / "out"), *flags, cwd=tmp_path, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("usage: train_dflash_online.py")
    assert lines[-1].startswith("train_dflash_online.py: error: ")
    assert reason in lines[-1]


def test_liger_without_the_package_or_a_gpu_is_a_usage_error(tmp_path):
    if torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None:
        pytest.skip("liger and a GPU are both here")
    result = script("--tiny", "--loss-kernel", "liger", cwd=tmp_path, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--loss-kernel liger" in result.stderr.strip().splitlines()[-1]
