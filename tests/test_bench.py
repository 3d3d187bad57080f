"""bench.run, the benchmark suite: it runs on this machine, reports what it measured
and what it could not, and its targets follow from the figures. No speed is asserted."""

from __future__ import annotations

import contextlib
import importlib.machinery
import io
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

import pydflash
from bench import report, run
from bench.common import Context, Row, compare, meets, not_run, parse_target

ROOT = Path(__file__).resolve().parents[1]
MEASURED_SECTIONS = ("dispatch", "overlap", "launch_bound")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def strict_json(path) -> dict:
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    with open(path) as f:
        return json.load(f, parse_constant=refuse)


def call_main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run.main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    paths = {
        k: folder / name for k, name in (("json", "r.json"), ("plot", "r.png"), ("trace", "t.json"))
    }
    code, out, err = call_main(
        [
            "--quick",
            "--sections",
            ",".join(MEASURED_SECTIONS),
            "--json",
            str(paths["json"]),
            "--plot",
            str(paths["plot"]),
            "--trace",
            str(paths["trace"]),
        ]
    )
    return {"code": code, "out": out, "err": err, "result": strict_json(paths["json"]), **paths}


def test_quick_run_succeeds_and_reports_every_section(quick_run):
    assert quick_run["code"] == 0, quick_run["err"]
    result = quick_run["result"]
    assert list(result["sections"]) == list(MEASURED_SECTIONS)
    assert all(s["status"] == "ok" for s in result["sections"].values())
    sections = {row["section"] for row in result["rows"]}
    assert sections == set(MEASURED_SECTIONS)


@pytest.mark.parametrize(
    "command", [["bench/run.py"], ["-m", "bench.run"]], ids=["script", "module"]
)
def test_runs_as_a_script_and_as_a_module(command, tmp_path):
    path = tmp_path / "r.json"
    done = subprocess.run(
        [sys.executable, *command, "--quick", "--sections", "overlap", "--json", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    assert strict_json(path)["sections"]["overlap"]["status"] == "ok"


def test_header_names_the_machine_and_versions(quick_run):
    header = quick_run["result"]["header"]
    info = pydflash.build_info()
    for key in ("pydflash", "python", "torch", "triton", "cuda_runtime", "visible_devices"):
        assert header[key] == info[key]
    assert header["cpu_count"] >= 1 and header["date"]
    out = quick_run["out"]
    assert f"python {info['python']}, torch {info['torch']}" in out
    if not header["gpus_used"]:
        assert "every figure below is CPU-only" in out


def test_measured_rows_are_medians_compared_in_the_same_run(quick_run):
    rows = [Row(**r) for r in quick_run["result"]["rows"]]
    measured = [r for r in rows if r.measured]
    assert measured
    for row in measured:
        assert math.isfinite(row.value) and row.value > 0, row
        if row.baseline is not None:
            assert row.baseline_name
            assert row.ratio == pytest.approx(row.value / row.baseline)
        assert row.met == meets(row)  # never stated, always derived from the figures
    names = {r.name for r in measured}
    assert {
        "cpu lane: submit→result",
        "cpu lane: 64 submitted, then waited",
        "cpu lane: 64 submitted, concurrent.futures.wait",
        "cpu lane: 64 submitted, concurrent.futures.as_completed",
    } <= names
    baselines = {r.baseline_name for r in measured}
    assert {"ThreadPoolExecutor(1)", "sequential eager (1 thread)"} <= baselines


def test_what_needs_a_gpu_is_reported_not_run(quick_run):
    rows = [Row(**r) for r in quick_run["result"]["rows"]]
    targeted = {r.name: r for r in rows if r.target}
    assert "busy-wait on 4 lanes of one GPU" in targeted
    assert "2 lanes: graphs, submit_graph" in targeted
    if quick_run["result"]["header"]["gpus_used"]:
        assert all(r.measured for r in targeted.values())
        return
    for name in (
        "busy-wait on 4 lanes of one GPU",
        "2 lanes: graphs, submit_graph",
        "gpu lane: submit→result",
    ):
        row = targeted[name]
        assert not row.measured and row.met is None and "needs a GPU" in row.note
    summary = quick_run["result"]["targets"]
    assert set(summary["not_measured"]) >= {
        "busy-wait on 4 lanes of one GPU",
        "2 lanes: graphs, submit_graph",
    }


def test_table_progress_plot_and_trace_are_written(quick_run):
    out, err = quick_run["out"], quick_run["err"]
    assert "targets:" in out and "[dispatch]" in out and "[launch_bound]" in out
    assert "dispatch (1/3): starting" in err and "launch_bound (3/3)" in err
    assert quick_run["plot"].read_bytes()[:8] == PNG_MAGIC
    trace = strict_json(quick_run["trace"])
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert spans and {e["pid"] for e in spans} == {0, 1}  # two lanes in launch_bound
    assert quick_run["result"]["trace"]["events"] == len(trace["traceEvents"])


# --- sections that are missing, crash, or lack a dependency --------------------------------


def fake_section(monkeypatch, name: str, run_fn) -> None:
    module = types.ModuleType(f"bench.{name}")
    module.__spec__ = importlib.machinery.ModuleSpec(f"bench.{name}", None)
    module.run = run_fn
    monkeypatch.setitem(sys.modules, f"bench.{name}", module)


@pytest.fixture
def sections(monkeypatch):
    def use(*names):
        monkeypatch.setattr(run, "SECTIONS", dict.fromkeys(names, 1))

    return use


def test_a_missing_section_is_skipped_with_a_row(sections, tmp_path):
    sections("not_written_yet")
    code, _, err = call_main(["--sections", "not_written_yet", "--json", str(tmp_path / "r.json")])
    assert code == 0
    result = strict_json(tmp_path / "r.json")
    assert result["sections"]["not_written_yet"] == {
        "status": "not run",
        "reason": "bench/not_written_yet.py does not exist yet",
    }
    (row,) = result["rows"]
    assert row["value"] is None and row["extra"]["status"] == "not run"
    assert "not run: bench/not_written_yet.py does not exist yet" in err


def test_a_crashing_section_fails_the_run_but_not_the_others(sections, monkeypatch, tmp_path):
    def crash(ctx):
        raise RuntimeError("boom in the section")

    fake_section(monkeypatch, "crashes", crash)
    fake_section(
        monkeypatch,
        "works",
        lambda ctx: [compare("works", "figure", 2.0, "us", "b", 4.0, "<= 0.25")],
    )
    sections("crashes", "works")
    code, _, err = call_main(["--sections", "crashes,works", "--json", str(tmp_path / "r.json")])
    assert code == 1
    result = strict_json(tmp_path / "r.json")
    assert result["sections"]["crashes"]["status"] == "failed"
    assert "RuntimeError: boom in the section" in result["sections"]["crashes"]["reason"]
    assert "Traceback" in err and "boom in the section" in err
    assert result["sections"]["works"]["status"] == "ok"
    assert result["targets"]["missed"] == ["figure"]  # a missed target is not a crash


def test_a_section_returning_something_else_is_a_crash(sections, monkeypatch):
    fake_section(monkeypatch, "wrong", lambda ctx: {"not": "rows"})
    sections("wrong")
    code, _, err = call_main(["--sections", "wrong"])
    assert code == 1 and "expected run() to return a list of Row" in err


def test_a_missing_dependency_is_not_run(sections, monkeypatch):
    def needs_fla(ctx):
        raise ModuleNotFoundError("No module named 'fla'", name="fla")

    fake_section(monkeypatch, "fla_section", needs_fla)
    sections("fla_section")
    code, out, _ = call_main(["--sections", "fla_section"])
    assert code == 0 and "needs fla, which is not installed" in out


def test_an_unknown_section_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run.main(["--sections", "dispatch,bogus"])
    assert exit_info.value.code == 2
    assert "expected section names from dispatch" in capsys.readouterr().err


def test_plot_without_matplotlib_stops_before_measuring(monkeypatch, tmp_path):
    monkeypatch.setattr(report, "matplotlib_missing", lambda: "--plot needs matplotlib")
    code, out, err = call_main(["--plot", str(tmp_path / "p.png")])
    assert code == 2 and "--plot needs matplotlib" in err and out == ""
    assert not (tmp_path / "p.png").exists()


# --- targets, rows and the report ---------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "baseline", "unit", "target", "met"),
    [
        (2.0, 10.0, "us", "ratio <= 0.25", True),
        (3.0, 10.0, "us", "ratio <= 0.25", False),
        (3.0, 10.0, "us", "<= 0.25", False),  # no metric: the ratio
        (0.96, None, "fraction", ">= 0.95", True),  # no baseline: the value
        (0.9, 0.5, "fraction", "value >= 0.95", False),
        (1.0, 2.0, "ms", "speedup >= 1.8", True),
        (1.2, 2.0, "ms", "speedup >= 1.8", False),
        (1.0, None, "ms", "speedup >= 1.8", None),  # nothing to compare with
    ],
)
def test_targets_follow_from_the_figures(value, baseline, unit, target, met):
    row = compare("s", "n", value, unit, "alt" if baseline else None, baseline, target)
    assert row.met is met


def test_unmeasured_rows_meet_no_target_and_bad_targets_are_refused():
    assert not_run("s", "n", "needs a GPU", "ratio <= 0.1").met is None
    assert meets(Row("s", "n", 1.0, "us")) is None
    with pytest.raises(ValueError, match="expected a target like"):
        parse_target("about 2x")


def synthetic_result(rows: list[Row], gpus: int = 0) -> dict:
    return {
        "header": {
            "pydflash": "0",
            "date": "today",
            "gpus_used": gpus,
            "device_names": None,
            "devices_unavailable_because": "no driver",
        },
        "quick": True,
        "sections": {"s": {"status": "ok"}},
        "targets": report.summarize_targets(rows),
        "rows": [r.as_dict() for r in rows],
    }


def test_table_marks_met_missed_and_unmeasured_targets():
    rows = [
        compare("s", "fast", 1.0, "us", "pool", 10.0, "ratio <= 0.25"),
        compare("s", "slow", 5.0, "us", "pool", 10.0, "ratio <= 0.25"),
        not_run("s", "gpu only", "needs a GPU", "ratio <= 0.25"),
    ]
    table = report.format_table(synthetic_result(rows), rows)
    lines = {line.split("  ")[0]: line for line in table.splitlines()}
    assert lines["fast"].rstrip().endswith("yes") and "10x" in lines["fast"]
    assert lines["slow"].rstrip().endswith("MISSED")
    assert "needs a GPU" in lines["gpu only"] and lines["gpu only"].endswith("not measured")
    assert "targets: 1 met, 1 missed, 1 not measured" in table
    assert "every figure below is CPU-only" in table


def test_json_writes_unmeasurable_figures_as_null(tmp_path):
    rows = [Row("s", "nan", float("nan"), "us", extra={"inf": float("inf")})]
    report.write_json(synthetic_result(rows), tmp_path / "r.json")
    row = strict_json(tmp_path / "r.json")["rows"][0]
    assert row["value"] is None and row["extra"]["inf"] is None


def test_plot_is_written_with_nothing_measured(tmp_path):
    rows = [not_run("s", "gpu only", "needs a GPU", "ratio <= 0.25")]
    report.plot(synthetic_result(rows), rows, None, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG_MAGIC


# --- the real-target section --------------------------------------------------------------


def test_pipeline_setup_makes_its_batches_once():
    from bench.harness import Setup
    from examples.dflash.loops import Job, Placement
    from examples.dflash.models import TINY_DRAFTER, TINY_TARGET

    job = Job(TINY_TARGET, TINY_DRAFTER, seq=8, batch=1, accumulate=1, lr=0.1)
    setup = Setup(job, Placement(("cpu",), ("cpu",)), steps=1, reps=1, warmup=0, on_gpu=False)
    first = setup.batches(3)
    assert setup.batches(2)[1] is first[1]  # reused, not made again
    more = setup.batches(4)
    assert len(more) == 4
    assert all(a["input_ids"].equal(b["input_ids"]) for a, b in zip(first, more, strict=False))


@pytest.fixture(scope="module")
def real_target_run(tmp_path_factory):
    pytest.importorskip("transformers")
    from bench import real_target

    path = tmp_path_factory.mktemp("real_target") / "r.json"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = real_target.main(
            ["--quick", "--lanes", "1,2", "--compile-timeout", "0", "--json", str(path)]
        )
    return {"code": code, "out": out.getvalue(), "err": err.getvalue(), "result": strict_json(path)}


def test_real_target_section_measures_the_eager_rows(real_target_run):
    assert real_target_run["code"] == 0, real_target_run["err"]
    result = real_target_run["result"]
    assert result["sections"]["real_target"]["status"] == "ok"
    rows = {r["name"]: Row(**r) for r in result["rows"]}
    gpu = result["header"]["gpus_used"]
    size = "small (qwen3-next-small, 1x1024)" if gpu else "tiny (qwen3-next-tiny, 2x32)"
    for lanes in ("1 lane", "2 lanes"):  # --lanes reached the section
        for alternative in ("ThreadPoolExecutor + streams", "eager lanes"):
            row = rows[f"{size}, {lanes}: target step, {alternative}"]
            assert row.measured and row.baseline_name == "eager sequential"
            assert "samples/s" in row.note and "tokens/s" in row.note
    row = rows[f"{size}: pipeline step, eager target"]
    assert row.measured and row.baseline_name == "ThreadPoolExecutor loop, eager target"
    for row in rows.values():  # every eager row names the kernels it ran
        if row.measured and "target step" in row.name:
            assert "kernels: gated delta rule " in row.note and ", short conv " in row.note
            assert set(row.extra["kernels"]) == {"gated delta rule", "short conv", "attention"}
    fidelity = [r for name, r in rows.items() if "graph output vs eager, relative error" in name]
    assert len(fidelity) == 2  # dense and MoE
    if gpu:
        return
    assert all(not r.measured and "needs a GPU" in r.note for r in fidelity)
    for name in (
        f"{size}, 2 lanes: target step, graph lanes",
        f"{size}: pipeline step, graph target",
        f"{size}: torch.compile reduce-overhead",
    ):
        assert not rows[name].measured and "needs a GPU" in rows[name].note
    assert rows[f"{size}: pipeline step, graph target"].target == "<= 0.5"


def test_real_target_options_reach_the_section_when_run_as_a_module(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "r.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.real_target",
            "--quick",
            "--lanes",
            "1",
            "--reps",
            "1",
            "--pipeline-steps",
            "1",
            "--compile-timeout",
            "0",
            "--json",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    names = [row["name"] for row in strict_json(path)["rows"]]
    assert any("1 lane:" in name for name in names), names
    assert not any("2 lanes" in name for name in names), names  # the default is 1,2,4


def test_real_target_section_is_not_run_without_transformers(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ModuleNotFoundError
    code, _, _ = call_main(
        ["--quick", "--sections", "real_target", "--json", str(tmp_path / "r.json")]
    )
    assert code == 0
    status = strict_json(tmp_path / "r.json")["sections"]["real_target"]
    assert status == {"status": "not run", "reason": "needs transformers, which is not installed"}


def test_compile_child_is_killed_at_its_limit_and_reports_how_far_it_got():
    from bench.real_target_compile import compile_child

    def child(behaviour: str) -> list[str]:
        return [
            sys.executable,
            str(ROOT / "tests" / "scripts" / "fake_compile_child.py"),
            behaviour,
        ]

    report, failure = compile_child(child("sleep"), limit=2)
    assert report == {"phase": "built"} and failure == "still running at the 2 s limit"
    report, failure = compile_child(child("crash"), limit=30)
    assert report == {} and failure == "exit 1: RuntimeError: no compiler"
    report, failure = compile_child(child("no-graphs"), limit=30)
    assert failure is None
    assert report == {
        "phase": "timed",
        "cudagraphs_skipped": "skipping cudagraphs due to mutated inputs",
    }


@pytest.mark.parametrize(
    ("report", "failure", "first", "second"),
    [
        (
            {"phase": "built"},
            "still running at the 300 s limit",
            "no step time: after 'built', still running at the 300 s limit",
            "not reached",
        ),
        (
            {
                "phase": "threads",
                "first_call_s": 40.0,
                "step": {"compiled_ms": 2.0, "eager_ms": 8.0},
                "threads": {"error": "AssertionError: not thread safe"},
            },
            None,
            None,
            "fails: AssertionError: not thread safe",
        ),
        (
            {
                "phase": "threads",
                "first_call_s": 40.0,
                "step": {"compiled_ms": 2.0, "eager_ms": 8.0},
                "threads": {"error": None, "compiled_ms": 6.0, "eager_ms": 30.0},
                "cudagraphs_skipped": "skipping cudagraphs due to cpu device",
            },
            None,
            None,
            None,
        ),
    ],
)
def test_compile_rows_say_what_the_child_reached(monkeypatch, report, failure, first, second):
    pytest.importorskip("transformers")
    from bench import real_target, real_target_compile

    monkeypatch.setattr(
        real_target_compile, "compile_child", lambda command, limit: (report, failure)
    )
    bench = real_target.make_bench(Context(True, 0, print), real_target.Options(), "tiny")
    compiled, threaded = real_target_compile.compiled_rows(
        Context(True, 0, lambda line: None), real_target.Options(), bench, "small", 300
    )
    assert compiled.measured == (first is None) and threaded.measured == (second is None)
    if first:
        assert compiled.note == first
    else:
        assert compiled.ratio == 0.25 and compiled.extra["first_call_s"] == 40.0
        assert compiled.note.startswith("first call (compile and capture) 40.0 s")
        skipped = compiled.note.endswith("skipping cudagraphs due to cpu device")
        assert skipped == ("cudagraphs_skipped" in report)
    if second:
        assert threaded.note.startswith(second)
    else:
        assert threaded.ratio == pytest.approx(0.2) and "4 threads at once" in threaded.note


def test_threaded_calls_report_a_failing_or_wrong_callable():
    pytest.importorskip("transformers")
    import torch

    from bench import real_target
    from bench.real_target_compile import threaded_calls

    bench = real_target.make_bench(Context(True, 0, print), real_target.Options(), "tiny")
    batches = bench.batches(3)
    features = {id(b): torch.full((1,), float(i)) for i, b in enumerate(batches)}
    calls = []

    def fine(batch):
        return {"features": features[id(batch)]}

    def flaky(batch):  # right on one thread, another batch's output on several
        calls.append(batch)
        return {"features": features[id(calls[-1 if len(calls) <= 3 else 0])]}

    def broken(batch):  # right on the main thread only
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("not thread safe\nsecond line")
        return fine(batch)

    assert threaded_calls(bench, fine, fine, batches)["error"] is None
    assert "wrong outputs in threads" in threaded_calls(bench, flaky, fine, batches)["error"]
    assert threaded_calls(bench, broken, fine, batches) == {
        "error": "RuntimeError: not thread safe"
    }


def test_compile_only_runs_just_the_compile_child_for_its_sizes(monkeypatch):
    pytest.importorskip("transformers")
    from bench import real_target, real_target_compile

    def no_build(*args, **kwargs):
        raise AssertionError("--compile-only builds no target in this process")

    commands = []
    monkeypatch.setattr(real_target, "build_models", no_build)
    monkeypatch.setattr(
        real_target_compile,
        "compile_child",
        lambda command, limit: commands.append((command, limit)) or ({}, "exit 1: boom"),
    )
    options = real_target.Options(compile_only=True, compile_timeout=5.0)
    ctx = Context(False, 1, lambda line: None)  # a GPU run, as the parent sees it
    rows = [
        row for size in ("small", "medium") for row in real_target.measure_size(ctx, options, size)
    ]
    assert [r.name for r in rows] == [
        "small (qwen3-next-small, 1x1024): torch.compile reduce-overhead",
        "small (qwen3-next-small, 1x1024): torch.compile reduce-overhead, from 4 threads",
    ]
    assert rows[0].note == "no step time: after 'start', exit 1: boom"
    ((command, limit),) = commands
    assert limit == 5.0 and command[1:5] == ["-m", "bench.real_target", "--compile-child", "small"]


# --- modes, progress, a run stopped part-way ------------------------------------------------


def test_modes_pick_counts_and_settings():
    quick, default, full = (
        Context(True, 0, print),
        Context(False, 0, print),
        Context(False, 0, print),
    )
    full.full = True
    assert [c.mode for c in (quick, default, full)] == ["quick", "default", "full"]
    assert [c.reps(20, 5, default=10) for c in (quick, default, full)] == [5, 10, 20]
    assert default.reps(20, 5) == 20  # no default given: the full count
    assert [c.pick("f", "q", "d") for c in (quick, default, full)] == ["q", "d", "f"]


def test_quick_and_full_are_exclusive(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run.main(["--quick", "--full"])
    assert exit_info.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_progress_counts_down_from_the_estimates():
    stream = io.StringIO()
    progress = run.Progress({"a": 10, "b": 20}, "default", stream=stream)
    say = progress.for_section("a", "1/2")
    assert 29 < progress.left() <= 30
    say("working")
    progress.section_done()  # "a" took almost no time: "b" is expected to be quicker too
    assert 0 < progress.left() < 20
    progress.close()
    assert "a (1/2): working (about 30 s left)" in stream.getvalue()


def test_json_says_what_a_run_finished(tmp_path, sections, monkeypatch):
    fake_section(monkeypatch, "one", lambda ctx: [compare("one", "figure", 2.0, "us", "b", 4.0)])
    sections("one")
    code, out, err = call_main(["--sections", "one", "--json", str(tmp_path / "r.json")])
    result = strict_json(tmp_path / "r.json")
    assert code == 0 and result["complete"] is True and result["mode"] == "default"
    assert result["finished"] == ["one"] and result["missing"] == []
    assert "wrote" in err and "stopped part-way" not in out


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_run_stopped_part_way_keeps_what_it_measured(how, tmp_path, python_subprocess_env):
    """The JSON and the figure are rewritten as each section ends; a run stopped in its
    second section leaves both valid, naming the finished and the missing sections."""
    paths = {"json": tmp_path / "r.json", "plot": tmp_path / "r.png"}
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "scripts" / "stopped_bench_run.py"),
            "--json",
            str(paths["json"]),
            "--plot",
            str(paths["plot"]),
        ],
        cwd=ROOT,
        env=python_subprocess_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("blocking until stopped" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        assert strict_json(paths["json"])["finished"] == ["first"]  # written before "blocks"
        proc.send_signal(how)
        out = proc.stdout.read()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
        proc.stdout.close()
        proc.stderr.close()
    err = "".join(lines)
    assert proc.returncode == 128 + how, err
    result = strict_json(paths["json"])
    assert result["complete"] is False
    assert result["finished"] == ["first"] and result["missing"] == ["blocks", "third"]
    assert result["sections"]["first"]["status"] == "ok"
    assert result["sections"]["blocks"]["status"] == "interrupted"
    assert signal.Signals(how).name in result["sections"]["blocks"]["reason"]
    assert "third" not in result["sections"]
    assert [row["name"] for row in result["rows"]] == ["figure"]
    assert result["targets"]["met"] == ["figure"]
    assert paths["plot"].read_bytes()[:8] == PNG_MAGIC
    assert not list(tmp_path.glob(".*part*"))  # no half-written file left beside them
    assert "stopped part-way: not measured: blocks, third" in out
    assert "blocking until stopped" in err


# --- kernels named in the real target's rows ------------------------------------------------


def test_fallbacks_are_parsed_and_refused_by_name():
    from bench import kernels

    assert kernels.parse_fallbacks(" causal_conv1d , fla") == ("causal_conv1d", "fla")
    assert kernels.parse_fallbacks("") == () and kernels.parse_fallbacks(None) == ()
    with pytest.raises(ValueError, match="expected fallbacks from fla, causal_conv1d"):
        kernels.parse_fallbacks("flash_attn")


def test_fallback_option_reaches_the_environment(sections, monkeypatch):
    from bench import kernels

    monkeypatch.setenv(kernels.FALLBACK_ENV, "")  # restored after the test
    seen = []
    fake_section(
        monkeypatch, "env", lambda ctx: seen.append(os.environ[kernels.FALLBACK_ENV]) or []
    )
    sections("env")
    code, _, _ = call_main(["--sections", "env", "--fallback", "causal_conv1d"])
    assert code == 0 and seen == ["causal_conv1d"]
    with pytest.raises(SystemExit):
        run.main(["--fallback", "bogus"])


def test_kernels_are_named_and_fallbacks_forced(monkeypatch):
    pytest.importorskip("transformers")
    import torch

    from bench import kernels
    from examples.dflash.hf import HFTargetConfig
    from examples.dflash.loops import target_forward

    module = kernels._modeling()
    for _, _, names in kernels.PACKAGES.values():
        for name in names:  # restored after the test: forcing rebinds module globals
            monkeypatch.setattr(module, name, getattr(module, name))
    # Layer 3, the tiny model's full-attention layer, is a capture layer: the forward stops
    # after the last capture layer, and these tests need it to reach an attention call.
    model = HFTargetConfig.load("qwen3-next-tiny", layers=(1, 3)).build(torch.float32)
    forward = target_forward(model)
    batch = {"input_ids": torch.randint(0, 64, (1, 8))}
    expected = forward(batch)["features"]
    found = kernels.describe(model, forward, batch)
    assert set(found) == {"gated delta rule", "short conv", "attention"}
    assert found["attention"].startswith("SDPA")
    for what in ("gated delta rule", "short conv"):
        assert found[what].startswith(("FLA", "causal-conv1d", "torch fallback")), found
    monkeypatch.setenv(kernels.FALLBACK_ENV, "causal_conv1d,fla")
    assert kernels.apply_fallbacks() == ("causal_conv1d", "fla")
    assert kernels.apply_fallbacks() == ("causal_conv1d", "fla")  # idempotent
    forced = kernels.describe(model)
    assert forced == {
        "gated delta rule": "torch fallback (forced by PYDFLASH_BENCH_FALLBACK)",
        "short conv": "torch fallback (forced by PYDFLASH_BENCH_FALLBACK)",
    }
    torch.testing.assert_close(forward(batch)["features"], expected)  # same math, torch's
    assert kernels.note(forced).startswith("kernels: gated delta rule torch fallback")


# --- fidelity (the GPU figures are in tests/test_bench_fidelity.py) --------------------------


def test_relative_error_and_cutting_padding():
    import torch

    from bench import fidelity, fidelity_probes

    a = torch.ones(1, 4, 2)
    assert fidelity_probes.rel_err(a, a) == 0.0
    assert fidelity_probes.rel_err(a * 1.01, a) == pytest.approx(0.01, rel=1e-4)
    assert fidelity_probes.rel_err(a, torch.ones(1, 5, 2)) == float("inf")
    long = torch.arange(12.0).reshape(1, 6, 2)
    assert fidelity_probes.cut(long, a).shape == a.shape and fidelity_probes.cut(a, long) is None
    assert fidelity_probes.cut(torch.ones(2, 6, 3), a) is None  # two dimensions differ
    assert fidelity.bucket_of(700) == 1024 and fidelity.bucket_of(5) == 128
    assert fidelity.bucket_of(1024) == 1024


def test_call_comparison_names_the_kernel_that_changes_bits():
    import torch

    from bench.fidelity_probes import Call, compare_calls
    from bench.fidelity_report import explain_calls

    x = torch.ones(1, 4, 2)
    eager = [Call("l0", "Linear", x, x), Call("gdr", "chunk", x, x), Call("l1", "Linear", x, x)]
    changed = x * 1.001
    graph = [
        Call("l0", "Linear", x, x),
        Call("gdr", "chunk", x, changed),
        Call("l1", "Linear", changed, changed),
    ]
    result = compare_calls(eager, graph)
    assert result["first"] == {
        "index": 1,
        "name": "gdr",
        "kind": "chunk",
        "input_equal": True,
        "output_error": pytest.approx(0.001, rel=1e-3),
        "between_probes": False,
    }
    assert (
        result["by_kind"]["chunk"]["changed"] == 1 and result["by_kind"]["Linear"]["changed"] == 0
    )
    lines = explain_calls(result)
    assert "gdr (chunk): input equal, output differs" in lines[0]
    assert "chunk 1 of 1" in lines[1] and "Linear 2" in lines[2]
    assert compare_calls(eager, graph[:2])["aligned"] is False
    padded = [Call(c.name, c.kind, torch.ones(1, 8, 2), torch.ones(1, 8, 2)) for c in eager]
    assert compare_calls(eager, padded)["first"] is None  # cut back to 4 positions: equal


def synthetic_fidelity(**errors):
    base = dict.fromkeys(
        ("eager_repeat", "padding", "graph", "graph_vs_padded", "lane", "plain_capture"), 0.0
    )
    base["eager_after_capture"] = 0.0
    base.update(errors)
    return {
        "label": "qwen3-next-small, 1x700 padded to 1024",
        "kernels": {"gated delta rule": "FLA 0.6.0", "short conv": "torch fallback"},
        "flags": {"tf32_matmul": False},
        "errors": base,
        "graph_stats": {},
        "autotune": {"keys": 3, "changed": [], "new": []},
    }


def test_fidelity_report_reads_itself():
    from bench import fidelity_report

    floor = synthetic_fidelity(padding=0.01, graph=0.01, graph_vs_padded=0.001)
    assert "within the padding floor" in fidelity_report.reading(floor)
    capture = synthetic_fidelity(graph=0.002, graph_vs_padded=0.002, plain_capture=0.002)
    text = fidelity_report.format_result(capture)
    assert "TargetGraphs on a lane  vs  eager" in text and "0.200 %" in text
    assert "the capture itself changes kernels" in text
    row = fidelity_report.row("real_target", capture)
    assert row.value == 0.002 and row.baseline == 0.0 and row.ratio is None
    assert row.baseline_name == "noise floor: eager padded vs eager"
    assert "kernels: gated delta rule FLA 0.6.0" in row.note
    ours = synthetic_fidelity(graph=0.004, graph_vs_padded=0.004, plain_capture=0.0, lane=0.004)
    assert "running on a lane changes the bits" in fidelity_report.reading(ours)
    assert "more than a plain capture" in fidelity_report.reading(ours)


def test_probes_record_leaf_modules_and_kernels_then_leave():
    pytest.importorskip("transformers")
    import torch

    from bench import fidelity_probes, kernels
    from examples.dflash.hf import HFTargetConfig

    # Layer 3, the tiny model's full-attention layer, is a capture layer: the forward stops
    # after the last capture layer, and these tests need it to reach an attention call.
    model = HFTargetConfig.load("qwen3-next-tiny", layers=(1, 3)).build(torch.float32)
    module = kernels._modeling()
    before = {name: getattr(module, name) for name in fidelity_probes.Probes.FUNCTIONS}
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def hooks():
        return sum(len(m._forward_hooks) for m in model.modules())

    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        model(ids)  # transformers adds hooks of its own on the first forward
    hooks_before = hooks()
    probes = fidelity_probes.Probes(model)
    with probes.recording() as calls, torch.no_grad():
        model(ids)
    with probes.recording() as longer, torch.no_grad():
        model(torch.cat([ids, torch.zeros(1, 4, dtype=ids.dtype)], dim=1))
    probes.remove()
    kinds = {c.kind for c in calls}
    assert {"Linear", "torch_chunk_gated_delta_rule", "causal_conv1d_fn", "sdpa"} <= kinds
    assert {name: getattr(module, name) for name in before} == before
    assert torch.nn.functional.scaled_dot_product_attention is sdpa
    padding = fidelity_probes.compare_calls(list(calls), list(longer))
    assert padding["aligned"] and padding["calls"] == len(calls)
    assert hooks() == hooks_before


def test_the_bound_kernel_is_read_through_wrappers():
    """As transformers binds it: a wrapper closing over `implementation`, under our own
    wrappers (examples/dflash/hf.py routes CPU tensors, the bench forces fallbacks)."""
    import functools

    from bench import kernels

    def fast(x):
        return x

    fast.__module__ = "fla.ops.gated_delta_rule.chunk"

    def reference(x):
        return x

    def bind(implementation):
        @functools.wraps(reference)
        def wrapped(*args, **kwargs):
            return implementation(*args, **kwargs)

        return wrapped

    chosen = bind(fast)

    @functools.wraps(chosen)
    def routed(x, _chosen=chosen):
        return _chosen(x)

    assert kernels.bound_implementation(routed) is fast
    assert kernels.kernel_name("fla", fast).startswith("FLA ")
    assert kernels.bound_implementation(bind(reference)) is reference
    assert kernels._reference(routed) is reference
    forced = kernels._calls_reference(reference)
    assert kernels.bound_implementation(forced) is reference and forced(3) == 3


def test_real_target_sizes_follow_the_run_mode():
    pytest.importorskip("transformers")
    from bench import real_target

    def options(quick=False, full=False, **given):
        ctx = Context(quick, 1, print)
        ctx.full = full
        return real_target.Options(**given).for_run(ctx)

    default = options()
    assert default.sizes == ("small",) and default.lanes == (1, 4)
    assert default.compile_timeout == 0  # torch.compile is --full only
    full = options(full=True)
    assert full.sizes == ("small", "medium", "large") and full.compile_timeout == 180
    assert options(quick=True).compile_timeout == 0
    assert options(sizes=("medium",), compile_timeout=5.0).sizes == ("medium",)
    assert options(compile_timeout=5.0).compile_timeout == 5.0  # given: kept


def test_two_runs_compare_row_by_row(tmp_path):
    from bench import compare as side_by_side

    a = synthetic_result(
        [compare_row(0.5, {"short conv": "causal-conv1d 1.7.0"}), not_run("s", "x", "no")]
    )
    b = synthetic_result([compare_row(0.25, {"short conv": "torch fallback"})])
    for name, result in (("a", a), ("b", b)):
        report.write_json(result, tmp_path / f"{name}.json")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert side_by_side.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    text = out.getvalue()
    assert "0.5     0.25" in text and "graph lanes" in text
    assert not any(line.endswith(" x") for line in text.splitlines())  # unmeasured: left out
    assert "kernels A: {'short conv': 'causal-conv1d 1.7.0'}" in text
    assert "kernels B: {'short conv': 'torch fallback'}" in text


def compare_row(ratio: float, kernels: dict) -> Row:
    return compare("s", "graph lanes", ratio, "ms", "eager", 1.0, kernels=kernels)


def test_reading_the_autotuners_touches_no_deprecated_attribute():
    # Warnings are errors here: the scan over every live object must not read an
    # attribute of one that warns on access (torch.distributed.reduce_op does).
    pytest.importorskip("triton")
    import torch.distributed  # noqa: F401 - puts the deprecated reduce_op among the objects

    from bench import fidelity_probes

    assert isinstance(fidelity_probes.autotuner_choices(), dict)


def test_launch_bound_graph_rows_time_a_longer_steady_state_window():
    from bench import pipeline_limits

    def regime(graph_window: bool) -> pipeline_limits.Regime:
        return pipeline_limits.Regime(
            "launch-bound", None, None, reps=4, warmup=2, on_gpu=True, graph_window=graph_window
        )

    assert regime(True).window(graphs=True) == (6, 12)
    assert regime(True).window(graphs=False) == (2, 4)  # eager rows keep the short window
    assert regime(False).window(graphs=True) == (2, 4)


def test_pipeline_host_time_leaves_out_the_bench_own_synchronize():
    # torch.cuda.synchronize() spins on the caller's thread: the bench's wait, not the
    # stage's work, so it must not count as the stage's host time.
    from bench import pipeline_limits

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    class Spinning(pipeline_limits.Regime):
        def synchronize(self) -> None:
            spin(0.02)

    regime = Spinning("launch-bound", None, None, reps=3, warmup=1, on_gpu=False)
    c = pipeline_limits.cost(regime, lambda: spin(0.005), graphs=False)
    assert 18 <= c["sync_ms_left_out"] <= 40
    assert 4 <= c["host_ms"] < 15, c
