"""A Hugging Face target in the DFlash example: a tiny Qwen3-Next built from a config
(its gated-delta-rule and causal-conv layers fall back to transformers' torch code on
the CPU) and a checkpoint saved to disk and loaded back, through the three loops."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from examples.dflash.data import MarkovTokens
from examples.dflash.hf import HFTargetConfig, default_layers, parse_layers
from examples.dflash.loops import (
    Job,
    PipelineLoop,
    Placement,
    build_models,
    executor_steps,
    sequential_steps,
    target_forward,
)
from examples.dflash.models import TINY_DRAFTER

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_dflash_online.py"
TINY = "qwen3-next-tiny"


def tiny_job(target: HFTargetConfig) -> Job:
    return Job(target, TINY_DRAFTER, seq=32, batch=2, accumulate=2, lr=3e-3, seed=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny Qwen3-Next saved with save_pretrained, as a user's local checkpoint."""
    path = tmp_path_factory.mktemp("checkpoint")
    torch.manual_seed(3)
    HFTargetConfig.load(TINY).build().model.save_pretrained(path)
    return path


def test_layer_choice_and_parsing():
    assert default_layers(8) == (1, 3, 4)
    assert default_layers(16) == (1, 7, 12)
    assert default_layers(4) == (0, 1)
    assert parse_layers("3,1") == (1, 3)
    with pytest.raises(ValueError, match="expected comma-separated layer indices"):
        parse_layers("1;3")
    with pytest.raises(ValueError, match="expected distinct layer indices"):
        parse_layers("1,1")


def test_config_names_and_checkpoints_are_checked(checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"expected target layers in \[0, 4\), got \(1, 4\)"):
        HFTargetConfig.load(TINY, (1, 4))
    with pytest.raises(ValueError, match="expected a local checkpoint directory or one of qwen3-"):
        HFTargetConfig.load(tmp_path / "missing")
    with pytest.raises(ValueError, match="expected --moe only with a Qwen3-Next config name"):
        HFTargetConfig.load(checkpoint, moe=True)
    assert HFTargetConfig.load(TINY).config.num_experts == 0  # a dense MLP by default
    moe = HFTargetConfig.load(TINY, moe=True).build()
    assert type(moe.model.model.layers[0].mlp).__name__ == "Qwen3NextSparseMoeBlock"


def test_features_are_the_chosen_layers_outputs():
    target = HFTargetConfig.load(TINY, (0, 3))
    torch.manual_seed(0)
    model = target.build()
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    ids = torch.randint(0, target.vocab, (2, 20))
    with torch.no_grad():
        states = model.model(input_ids=ids, output_hidden_states=True).hidden_states
        features = model(ids)
    assert features.shape == (2, 20, 2 * target.dim)
    assert torch.equal(features, torch.cat([states[1], states[4]], dim=-1))


def test_drafter_follows_the_target_width_layers_and_vocab():
    target = HFTargetConfig.load(TINY, (0, 1, 2))
    models = build_models(tiny_job(target), Placement.parse(["cpu"], "1:1"))
    drafter = models.drafters[0]
    assert drafter.fc.in_features == 3 * target.dim
    assert drafter.lm_head.out_features == target.vocab == 64
    assert torch.equal(drafter.embed.weight, models.targets[0].get_input_embeddings().weight)


@pytest.mark.parametrize(("ratio", "graphs"), [("1:1", False), ("2:1", False), ("2:1", True)])
def test_pipeline_losses_equal_the_sequential_loop_on_cpu(ratio, graphs):
    job = tiny_job(HFTargetConfig.load(TINY))
    one = Placement.parse(["cpu"], "1:1")
    placement = Placement.parse(["cpu"], ratio)
    batches = MarkovTokens(job.target.vocab, job.seq, job.batch, seed=1).batches(
        0, 4 * job.accumulate
    )
    reference = [f() for f in sequential_steps(build_models(job, one), one, job, batches, 4)]
    executor = [
        f()
        for f in executor_steps(build_models(job, placement), placement, job, batches, 4, depth=2)
    ]
    loop = PipelineLoop(build_models(job, placement), placement, job, depth=2, graphs=graphs)
    try:
        pipelined = [f() for f in loop.steps(batches, 4)]
    finally:
        loop.close()
    assert executor == reference
    assert pipelined == reference
    assert reference[-1] != reference[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("moe", [False, True])
def test_graph_target_matches_eager_on_gpu_dense_and_moe(moe):
    """Each batch equals the eager forward, the second one replayed on new data. An MoE
    block either captures (transformers 5.17 routes with fixed shapes) or falls back
    with a warning: never a wrong result."""
    from pydflash import Dispatcher, GraphFallbackWarning, TargetGraphs

    config = HFTargetConfig.load("qwen3-next-small", moe=moe)
    torch.manual_seed(0)
    forward = target_forward(config.build(torch.bfloat16).to("cuda:0"))
    batches = [
        {"input_ids": torch.randint(0, config.vocab, (2, t), device="cuda:0")} for t in (1000, 1024)
    ]  # both in bucket 1024
    dispatcher = Dispatcher(["cuda:0"])
    graphs = TargetGraphs(forward, policy="graphs")  # a capture at the first batch
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", GraphFallbackWarning)
            for batch in batches:
                got = graphs.submit(dispatcher.lanes[0], batch).wait_stream()["features"].float()
                with torch.no_grad():
                    expected = forward(batch)["features"].float()
                assert got.shape == expected.shape
                assert ((got - expected).norm() / expected.norm()).item() < 2e-2  # bf16
        (lane,) = graphs.stats()["lanes"].values()
    finally:
        dispatcher.shutdown()
    fell_back = any(issubclass(w.category, GraphFallbackWarning) for w in caught)
    assert lane["buckets"] == ([] if fell_back else [(2, 1024)])
    assert fell_back == (lane["eager_runs"] == 2)
    if not moe:
        assert not fell_back


def test_a_saved_checkpoint_loads_as_the_target(checkpoint):
    target = HFTargetConfig.load(checkpoint, (1,))
    assert target.vocab == 64 and target.capture_layers == (1,)
    torch.manual_seed(3)
    saved = HFTargetConfig.load(TINY, (1,)).build()
    loaded = target.build()
    ids = torch.randint(0, target.vocab, (1, 12))
    with torch.no_grad():
        assert torch.equal(loaded(ids), saved(ids))


# --- the script -------------------------------------------------------------------------------
def load_script(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # the script imports dflash.* from its folder
    spec = importlib.util.spec_from_file_location("train_dflash_online", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--target-config", TINY, "--vocab", "32"], "--vocab sizes the built-in target"),
        (["--moe"], "--moe applies to --target-config"),
        (["--target-graphs", "--mode", "sequential"], "use --mode pipeline, not sequential"),
        (["--target-layers", "1,x"], "expected comma-separated layer indices"),
        (["--target-config", TINY, "--target-model", "."], "not allowed with argument"),
    ],
)
def test_script_refuses_flags_that_do_not_fit(monkeypatch, capsys, argv, message):
    script = load_script(monkeypatch)
    with pytest.raises(SystemExit):
        script.parse_args(argv)
    assert message in capsys.readouterr().err


def test_script_trains_on_a_local_checkpoint_with_graph_targets(checkpoint, tmp_path):
    result = subprocess.run(  # as the example's README runs it, on the installed pydflash
        [
            sys.executable,
            str(SCRIPT),
            "--tiny",
            "--target-model",
            str(checkpoint),
            "--target-layers",
            "0,2",
            "--target-graphs",
            "--check",
            "--steps",
            "3",
            "--devices",
            "cpu",
            "--ratio",
            "2:1",
            "--no-plot",
            "--out",
            str(tmp_path),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "check passed: pipeline losses equal the sequential loop's exactly" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["target"] == str(checkpoint) and summary["target_layers"] == [0, 2]
    (graphs,) = summary["target_graphs"]
    assert len(graphs["lanes"]) == 2  # one TargetGraphs shared by both target lanes


def test_script_target_flags_pick_the_target(monkeypatch):
    script = load_script(monkeypatch)
    builtin = script.make_target(script.parse_args(["--tiny", "--target-layers", "2,0"]))
    assert type(builtin).__name__ == "TargetConfig" and builtin.capture_layers == (0, 2)
    with pytest.raises(SystemExit, match=r"--target-layers: expected capture_layers in \[0, 4\)"):
        script.make_target(script.parse_args(["--tiny", "--target-layers", "4"]))
    hf = script.make_target(script.parse_args(["--target-config", TINY, "--moe"]))
    assert hf.source == TINY and hf.config.num_experts == 16
    with pytest.raises(
        SystemExit, match=r"cannot use that target: expected target layers in \[0, 4\)"
    ):
        script.make_target(script.parse_args(["--target-config", TINY, "--target-layers", "7"]))
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    with pytest.raises(SystemExit, match=r"needs transformers: pip install 'pydflash\[hf\]'"):
        script.make_target(script.parse_args(["--target-config", TINY]))
