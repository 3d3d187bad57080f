"""bench/scale_out.py, the scale-out section: on the CPU it runs the tiny target on one
and two CPU lanes and in two CPU worker processes, and every row that needs more GPUs
says how many. Its figures are not checked; how rows, ratios and goals follow from
them is."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

from bench.common import Context, Row

pytest.importorskip("transformers")

# After the skip: these need transformers' config classes at run time.
from bench import scale_out, scale_out_pipeline, scale_out_processes
from examples.dflash.loops import Placement

NAME = "qwen3-next-tiny 2x32"
SCRIPTS = Path(__file__).parent / "scripts"  # what tests run in a child interpreter


def strict_json(path) -> dict:
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    with open(path) as f:
        return json.load(f, parse_constant=refuse)


@pytest.fixture(scope="module")
def section_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("scale_out") / "r.json"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = scale_out.main(
            ["--quick", "--reps", "2", "--pipeline-steps", "1", "--json", str(path)]
        )
    return {"code": code, "out": out.getvalue(), "err": err.getvalue(), "result": strict_json(path)}


def test_section_measures_what_this_machine_has_and_names_what_it_lacks(section_run):
    assert section_run["code"] == 0, section_run["err"]
    result = section_run["result"]
    assert result["sections"]["scale_out"]["status"] == "ok"
    rows = {r["name"]: Row(**r) for r in result["rows"]}
    gpus = result["header"]["gpus_used"]
    if gpus:
        return  # the GPU host's figures are the bench's to report; this checks the CPU path
    for n, where in ((1, "1 CPU lane"), (2, "2 CPU lanes")):
        for way in ("eager lanes", "ThreadPoolExecutor + streams", "one process per device"):
            row = rows[f"{NAME}, {where}: {way}"]
            assert row.measured and row.unit == "samples/s" and "tokens/s" in row.note, row
            assert row.extra["devices"] == n
        graphs = rows[f"{NAME}, {where}: graph lanes"]
        assert not graphs.measured and "needs a GPU" in graphs.note
    # Above one lane each way's ratio is its speed-up over itself on one lane.
    for way in ("eager lanes", "one process per device"):
        row = rows[f"{NAME}, 2 CPU lanes: {way}"]
        assert row.baseline_name == f"{way}, 1 CPU lane"
        assert row.ratio == pytest.approx(row.value / rows[f"{NAME}, 1 CPU lane: {way}"].value)
    assert rows[f"{NAME}, 2 CPU lanes: graph lanes"].target == "ratio >= 1.9"
    for n, goal in ((4, "ratio >= 3.8"), (8, "ratio >= 7.6")):
        for way in (
            "graph lanes",
            "eager lanes",
            "ThreadPoolExecutor + streams",
            "one process per device",
            "graph lanes over ThreadPoolExecutor",
        ):
            row = rows[f"{NAME}, {n} GPUs: {way}"]
            assert not row.measured and row.note == f"needs {n} GPUs"
        assert rows[f"{NAME}, {n} GPUs: graph lanes"].target == goal
    for ratio, n in (("1:1", 2), ("3:1", 4)):
        row = rows[f"{NAME}: pipeline step, graph target, {ratio} on {n} GPUs"]
        assert not row.measured and row.note == f"needs {n} GPUs" and row.target == "<= 1.05"
    assert f"{NAME}, 8 GPUs: graph lanes" in result["targets"]["not_measured"]
    assert "2 worker processes" in section_run["err"]  # progress


def test_graph_lanes_and_the_pipeline_run_on_cpu_lanes():
    """TargetGraphs' padded eager path on CPU lanes: the graph rows' code runs in CI."""
    ctx = Context(True, 0, lambda line: None)
    options = scale_out.Options(reps=2, pipeline_steps=1)
    setting = scale_out.make_setting(options, 0)
    times, stats = scale_out.in_process(ctx, options, setting, [1, 2], graphs=True)
    assert set(times[2]) == {"graphs", "lanes", "executor"} and len(stats) == 2
    rows = {r.name: r for r in scale_out.scaling_rows(setting, [1, 2], times, stats, "off")}
    graphs = rows[f"{NAME}, 2 CPU lanes: graph lanes"]
    assert graphs.measured and graphs.target == "ratio >= 1.9" and graphs.met is not None
    assert rows[f"{NAME}, 2 CPU lanes: one process per device"].note == "no figure: off"
    row = scale_out_pipeline.pipeline_figures(
        ctx, options, setting, Placement.parse(["cpu"] * 4, "3:1"), "3:1 on CPU lanes"
    )
    assert row.measured and row.target == "<= 1.05" and row.extra["peer_access"] is None
    assert row.baseline == max(row.extra["target_stage_ms"], row.extra["drafter_stage_ms"])
    assert "depth 4" in row.note


def times_of(executor: float, graphs: float, lanes: float, processes: float) -> dict[str, float]:
    return {"executor": executor, "graphs": graphs, "lanes": lanes, "processes": processes}


def test_goals_follow_from_the_speed_ups_and_the_one_device_margin():
    setting = scale_out.make_setting(scale_out.Options(), 0)
    setting.on_gpu, setting.available = True, 2  # as a two-GPU host sees it
    times = {
        1: times_of(executor=0.03, graphs=0.01, lanes=0.02, processes=0.02),
        2: times_of(executor=0.04, graphs=0.0104, lanes=0.03, processes=0.02),
    }
    rows = {r.name: r for r in scale_out.scaling_rows(setting, [1, 2, 4], times, [], None)}
    one, two = f"{NAME}, 1 GPU", f"{NAME}, 2 GPUs"
    assert rows[f"{one}: graph lanes"].ratio == pytest.approx(3.0)  # over the executor
    assert rows[f"{one}: graph lanes"].baseline_name == "ThreadPoolExecutor + streams, 1 GPU"
    graphs = rows[f"{two}: graph lanes"]
    assert graphs.ratio == pytest.approx(2 * 0.01 / 0.0104) and graphs.met is True  # 1.92 >= 1.9
    assert rows[f"{two}: eager lanes"].ratio == pytest.approx(2 * 0.02 / 0.03)
    margin = rows[f"{two}: graph lanes over ThreadPoolExecutor"]
    assert margin.target == "ratio >= 3.000" and margin.ratio == pytest.approx(0.04 / 0.0104)
    assert margin.met is True
    assert rows[f"{NAME}, 4 GPUs: graph lanes"].note == "needs 4 GPUs"
    slower = {1: times[1], 2: {**times[2], "graphs": 0.0108}}
    missed = {r.name: r for r in scale_out.scaling_rows(setting, [1, 2], slower, [], None)}
    assert missed[f"{two}: graph lanes"].met is False  # 1.85 < 1.9


def worker(behaviour: str) -> list[str]:
    return [sys.executable, str(SCRIPTS / "scale_out_worker.py"), behaviour]


def test_workers_get_torchrun_environment_and_no_nvlink_multicast():
    reports, failure = scale_out_processes.launch(worker("environment"), world=2, limit=60)
    assert failure is None
    assert sorted(r["RANK"] for r in reports) == ["0", "1"]
    for r in reports:
        assert r["LOCAL_RANK"] == r["RANK"] and r["WORLD_SIZE"] == "2"
        assert r["MASTER_ADDR"] == "127.0.0.1" and int(r["MASTER_PORT"]) > 0
        assert (
            r["NCCL_NVLS_ENABLE"],
            r["TORCH_SYMM_MEM_DISABLE_MULTICAST"],
            r["NVSHMEM_DISABLE_NVLS"],
        ) == ("0", "1", "1")


def test_a_failing_worker_stops_the_others_and_says_why():
    reports, failure = scale_out_processes.launch(worker("fail-rank-1"), world=2, limit=60)
    assert reports == [] and failure == "rank 1 exit 1: RuntimeError: no device"
    reports, failure = scale_out_processes.launch(worker("sleep"), world=2, limit=1)
    assert reports == [] and failure == "still running at the 1 s limit"


def test_pipeline_ratios_have_one_drafter(capsys):
    assert scale_out_pipeline.parse_ratio("3:1") == 3
    with pytest.raises(SystemExit):
        scale_out.main(["--pipelines", "2:2"])
    assert "expected a ratio like 3:1" in capsys.readouterr().err
