"""The benchmark suite: `python -m bench.run` or `python bench/run.py`, with [--quick |
--full] [--sections a,b] [--fallback causal_conv1d] [--json FILE] [--plot FILE.png]
[--trace FILE.json].

Runs each section (a module `bench/<name>.py` with `run(ctx) -> list[Row]`) and prints
one table: medians, the alternatives measured in the same run, ratios, and whether
each of the issues' targets is met on this machine. Without a GPU the sections run on
CPU lanes and say which figures need a GPU. A section whose module does not exist yet,
or whose third-party dependency is missing, is reported as not run. The exit status
is 0 whether or not targets are met (a run is a measurement), 1 when a section
crashed, and 128 + the signal's number when the run was stopped (Ctrl-C, SIGTERM).

Three lengths: the default run takes about 3 minutes on one H200, every section at a
size that answers its question; --full gives every size and repetition (and the
torch.compile subprocess, which may take minutes); --quick is the CI smoke run.

The JSON (and the figure) is written when the run starts and again as each section
ends, so a run stopped part-way keeps what it measured: `complete` is false and
`finished` / `missing` name the sections.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import os
import platform
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

if not __package__:
    # Run as a script (`python bench/run.py`): import this file's package as
    # `python -m bench.run` does (PEP 366).
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from . import report
from .common import Context, Row, meets

# The sections in the order they run, each with about how many seconds it takes in the
# default run on one H200: the progress bar's "time left" counts from these, scaled by
# how the finished sections compared with theirs. Adding a section is one line here.
SECTIONS = {
    "dispatch": 25,
    "overlap": 3,
    "launch_bound": 12,
    "compile_queue": 25,
    "pipeline": 30,
    "real_target": 55,
    "scale_out": 30,
    "dflash_scale": 45,
    "seed_workload": 10,  # the default run: the drafter alone at 2 x 32 k; --full: minutes
    "dflash_varlen": 1,  # a not-run row; with --full about 7 minutes (two targets)
}
UNKNOWN_SECTION_S = 30  # a section without an estimate
MODE_SCALE = {"quick": 1.0, "default": 1.0, "full": 5.0}  # before any section has ended
PRIOR_S = 20.0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run", description=__doc__.split("\n\n")[1]
    )
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--quick", action="store_true", help="few iterations, small sizes (CI)")
    length.add_argument(
        "--full",
        action="store_true",
        help="every size and repetition, torch.compile included (many minutes)",
    )
    parser.add_argument(
        "--sections",
        type=_section_list,
        default=list(SECTIONS),
        help=f"comma-separated, from: {','.join(SECTIONS)} (default: all)",
    )
    parser.add_argument(
        "--fallback",
        type=_fallback_list,
        default=None,
        help="fast kernels to leave out of the real target's eager rows, e.g. causal_conv1d "
        "(sets PYDFLASH_BENCH_FALLBACK, which worker processes inherit)",
    )
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="write a figure (needs matplotlib)")
    parser.add_argument(
        "--trace",
        metavar="FILE.json",
        help="write the Chrome/Perfetto trace recorded in launch_bound",
    )
    return parser.parse_args(argv)


def _section_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"expected section names from {', '.join(SECTIONS)}, got {text!r}"
        )
    return names


def _fallback_list(text: str) -> str:
    from .kernels import parse_fallbacks

    try:
        return ",".join(parse_fallbacks(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class Progress:
    """A bar over the sections on stderr where it is a terminal (tqdm) showing the
    section and about how long the run has left, and above it, everywhere, one line per
    step with the time since the run started and the time left.

    The time left is the remaining sections' estimates (SECTIONS), scaled by how long
    the finished sections took against theirs."""

    def __init__(self, estimates: dict[str, float], mode: str = "default", stream: Any = None):
        self._stream = stream if stream is not None else sys.stderr
        self._start = time.perf_counter()
        self._estimates = dict(estimates)
        self._scale = MODE_SCALE[mode]
        self._took: dict[str, float] = {}  # finished sections: seconds
        self._current: str | None = None
        self._current_start = self._start
        # disable=None: no bar in a log file or a pipe, where the lines say it all.
        self._bar = tqdm(
            total=len(estimates),
            unit="section",
            file=self._stream,
            disable=None,
            bar_format="{desc} {n_fmt}/{total_fmt} sections |{bar}|{postfix}",
        )

    def for_section(self, name: str, position: str) -> Callable[[str], None]:
        self._current, self._current_start = name, time.perf_counter()
        self._bar.set_description_str(name)
        return lambda message: self(f"{name} ({position}): {message}")

    def section_done(self) -> None:
        if self._current is not None:
            self._took[self._current] = time.perf_counter() - self._current_start
            self._current = None
        self._bar.update()
        self._bar.set_postfix_str(self._left_text(), refresh=True)

    def left(self) -> float:
        """Seconds the run has left, about."""
        # How the finished sections compared with their estimates, weighed against the
        # mode's prior as if PRIOR_S seconds of sections had matched it.
        estimated = sum(self._estimates[name] for name in self._took)
        scale = (sum(self._took.values()) + PRIOR_S * self._scale) / (estimated + PRIOR_S)
        rest = [n for n in self._estimates if n not in self._took and n != self._current]
        left = sum(self._estimates[n] for n in rest) * scale
        if self._current is not None:
            spent = time.perf_counter() - self._current_start
            left += max(self._estimates[self._current] * scale - spent, 0.0)
        return left

    def _left_text(self) -> str:
        return f"about {self.left():.0f} s left"

    def close(self) -> None:
        self._bar.close()

    def __call__(self, message: str) -> None:
        left = self._left_text()
        self._bar.set_postfix_str(left, refresh=False)
        self._bar.write(
            f"[{time.perf_counter() - self._start:6.1f}s] {message} ({left})", file=self._stream
        )
        self._stream.flush()


def machine() -> dict[str, Any]:
    """build_info() plus the host, the date and the GPUs the sections will use."""
    try:
        import torch  # build_info names the GPUs once torch is imported

        torch_gpus = torch.cuda.is_available()
    except ImportError:
        torch_gpus = False
    from pydflash import build_info

    info = build_info()
    info["date"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    info["cpu"] = _cpu_name()
    info["cpu_count"] = os.cpu_count()
    # GPU sections need both pydflash's CUDA build and torch's.
    info["gpus_used"] = info["visible_devices"] if torch_gpus else 0
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_section(name: str, ctx: Context) -> tuple[list[Row], dict[str, Any]]:
    """(rows, status) for one section; never raises except KeyboardInterrupt."""
    module_name = f"{__package__}.{name}"
    start = time.perf_counter()
    if importlib.util.find_spec(module_name) is None:
        reason = f"bench/{name}.py does not exist yet"
        return [_status_row(name, "not run", reason)], {"status": "not run", "reason": reason}
    try:
        module = importlib.import_module(module_name)
        rows = module.run(ctx)
        if not isinstance(rows, list) or not all(isinstance(r, Row) for r in rows):
            raise TypeError(f"expected run() to return a list of Row, got {rows!r:.200}")
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing.split(".")[0] in (__package__, "pydflash"):
            return _failed(name, exc, start)
        reason = f"needs {missing}, which is not installed"
        return [_status_row(name, "not run", reason)], {"status": "not run", "reason": reason}
    except Exception as exc:  # noqa: BLE001 - a section's failure is its report's row
        return _failed(name, exc, start)
    for row in rows:
        if row.met is None:
            row.met = meets(row)
    return rows, {"status": "ok", "seconds": round(time.perf_counter() - start, 2)}


def _failed(name: str, exc: BaseException, start: float) -> tuple[list[Row], dict[str, Any]]:
    with tqdm.external_write_mode(file=sys.stderr):  # above the bar, not through it
        traceback.print_exception(exc, file=sys.stderr)
    reason = f"{type(exc).__name__}: {exc}"
    seconds = round(time.perf_counter() - start, 2)
    status = {"status": "failed", "reason": reason, "seconds": seconds}
    return [_status_row(name, "failed", reason)], status


def _status_row(section: str, status: str, reason: str) -> Row:
    return Row(section, f"section {status}", None, "", note=reason, extra={"status": status})


class Stopped(BaseException):
    """SIGTERM, raised where the run is, as Ctrl-C raises KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, frame: Any) -> None:
    raise Stopped(signum)


class Outputs:
    """The run's JSON and figure, rewritten whole as each section ends (each file is
    replaced at once, never left half-written), and the table and trace at the end."""

    def __init__(self, args: argparse.Namespace, header: dict[str, Any], mode: str) -> None:
        self.args, self.header, self.mode = args, header, mode
        self.started = time.perf_counter()
        self.rows: list[Row] = []
        self.sections: dict[str, dict[str, Any]] = {}

    def result(self, ctx: Context) -> dict[str, Any]:
        trace = ctx.artifacts.get("trace")
        finished = [n for n, s in self.sections.items() if s["status"] != "interrupted"]
        return {
            "header": self.header,
            "mode": self.mode,
            "quick": self.mode == "quick",
            "complete": len(finished) == len(self.args.sections),
            "finished": finished,
            "missing": [n for n in self.args.sections if n not in finished],
            "sections": self.sections,
            "targets": report.summarize_targets(self.rows),
            "rows": [row.as_dict() for row in self.rows],
            "trace": {"title": trace["title"], "events": len(trace["events"])} if trace else None,
            "seconds": round(time.perf_counter() - self.started, 1),
        }

    def write(
        self, ctx: Context, progress: Callable[[str], None] | None = None, plot: bool = True
    ) -> None:
        result = self.result(ctx)
        if self.args.json:
            report.write_json(result, self.args.json)
        if self.args.plot and plot:
            report.plot(result, self.rows, ctx.artifacts.get("trace"), self.args.plot)
        if progress is not None and (self.args.json or self.args.plot):
            written = " and ".join(p for p in (self.args.json, self.args.plot) if p)
            progress(
                f"wrote {written} ({len(result['finished'])} of {len(self.args.sections)} sections)"
            )

    def finish(self, ctx: Context, progress: Callable[[str], None]) -> None:
        result = self.result(ctx)
        print(report.format_table(result, self.rows))
        trace = ctx.artifacts.get("trace")
        if self.args.trace:
            if trace is None:
                progress("no trace was recorded (launch_bound did not run)")
            else:
                from pydflash.trace import write

                write(trace["events"], self.args.trace)
                progress(f"wrote {self.args.trace}")


def main(argv: Sequence[str] | None = None, options: dict[str, Any] | None = None) -> int:
    """`options` ({section name: settings}) reaches the sections as ctx.options: a
    section's own command line passes its settings through here."""
    args = parse_args(argv)
    if args.plot and (why := report.matplotlib_missing()):
        print(why, file=sys.stderr)
        return 2
    if args.fallback is not None:
        from .kernels import FALLBACK_ENV

        os.environ[FALLBACK_ENV] = args.fallback  # worker processes inherit it
    mode = "quick" if args.quick else "full" if args.full else "default"
    estimates = {name: SECTIONS.get(name, UNKNOWN_SECTION_S) for name in args.sections}
    progress = Progress(estimates, mode)
    ctx = Context(quick=args.quick, gpus=0, progress=progress, options=options or {})
    ctx.full = args.full
    outputs = Outputs(args, machine(), mode)
    ctx.gpus = outputs.header["gpus_used"]
    previous = _catch_sigterm()
    stopped: BaseException | None = None
    current: str | None = None  # the section running
    try:
        # A run stopped in its first section still leaves a valid JSON (the figure would
        # show nothing yet: it comes with the first section).
        outputs.write(ctx, plot=False)
        for position, name in enumerate(args.sections, 1):
            ctx.progress = progress.for_section(name, f"{position}/{len(args.sections)}")
            ctx.progress("starting")
            current, start = name, time.perf_counter()
            section_rows, status = run_section(name, ctx)
            current = None
            outputs.sections[name] = status
            if status["status"] != "ok":
                ctx.progress(f"{status['status']}: {status['reason']}")
            outputs.rows += section_rows
            progress.section_done()
            outputs.write(ctx, ctx.progress)
    except (KeyboardInterrupt, Stopped) as exc:
        stopped = exc
        why = "SIGINT" if isinstance(exc, KeyboardInterrupt) else str(exc)
        if current is not None:
            seconds = round(time.perf_counter() - start, 2)
            outputs.sections[current] = {
                "status": "interrupted",
                "reason": f"stopped by {why} after {seconds} s",
                "seconds": seconds,
            }
        progress(f"stopped by {why}: writing what the finished sections measured")
    finally:
        _restore_sigterm(previous)
        progress.close()
    if stopped is not None:
        outputs.write(ctx, progress)
    outputs.finish(ctx, progress)
    if stopped is not None:
        return 128 + (stopped.signum if isinstance(stopped, Stopped) else signal.SIGINT)
    return 1 if any(s["status"] == "failed" for s in outputs.sections.values()) else 0


def _catch_sigterm() -> Any:
    try:
        return signal.signal(signal.SIGTERM, _raise_stopped)
    except ValueError:  # not the main thread: leave the signal as it is
        return None


def _restore_sigterm(previous: Any) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
