"""The benchmark suite: `python -m bench.run` or `python bench/run.py`, with [--quick]
[--sections a,b] [--json FILE] [--plot FILE.png] [--trace FILE.json].

Runs each section (a module `bench/<name>.py` with `run(ctx) -> list[Row]`) and prints
one table: medians, the alternatives measured in the same run, ratios, and whether
each of the issues' targets is met on this machine. Without a GPU the sections run on
CPU lanes and say which figures need a GPU. A section whose module does not exist yet,
or whose third-party dependency is missing, is reported as not run. The exit status
is 0 whether or not targets are met (a run is a measurement) and 1 when a section
crashed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import os
import platform
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

SECTIONS = (
    "dispatch",
    "overlap",
    "launch_bound",
    "compile_queue",
    "pipeline",
    "real_target",
    "scale_out",
    "dflash_scale",
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run", description=__doc__.split("\n\n")[1]
    )
    parser.add_argument("--quick", action="store_true", help="few iterations, small sizes (CI)")
    parser.add_argument(
        "--sections",
        type=_section_list,
        default=list(SECTIONS),
        help=f"comma-separated, from: {','.join(SECTIONS)} (default: all)",
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


class Progress:
    """A bar over the sections on stderr where it is a terminal (tqdm), and above it,
    everywhere, one line per step with the time since the run started."""

    def __init__(self, sections: int, stream: Any = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._start = time.perf_counter()
        # disable=None: no bar in a log file or a pipe, where the lines say it all.
        self._bar = tqdm(total=sections, unit="section", file=self._stream, disable=None)

    def for_section(self, name: str, position: str) -> Callable[[str], None]:
        self._bar.set_description_str(name)
        return lambda message: self(f"{name} ({position}): {message}")

    def section_done(self) -> None:
        self._bar.update()

    def close(self) -> None:
        self._bar.close()

    def __call__(self, message: str) -> None:
        self._bar.write(f"[{time.perf_counter() - self._start:6.1f}s] {message}", file=self._stream)
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


def main(argv: Sequence[str] | None = None, options: dict[str, Any] | None = None) -> int:
    """`options` ({section name: settings}) reaches the sections as ctx.options: a
    section's own command line passes its settings through here."""
    args = parse_args(argv)
    if args.plot and (why := report.matplotlib_missing()):
        print(why, file=sys.stderr)
        return 2
    started = time.perf_counter()
    progress = Progress(len(args.sections))
    header = machine()
    ctx = Context(
        quick=args.quick, gpus=header["gpus_used"], progress=progress, options=options or {}
    )
    rows: list[Row] = []
    sections: dict[str, dict[str, Any]] = {}
    try:
        for position, name in enumerate(args.sections, 1):
            ctx.progress = progress.for_section(name, f"{position}/{len(args.sections)}")
            ctx.progress("starting")
            section_rows, sections[name] = run_section(name, ctx)
            if sections[name]["status"] != "ok":
                ctx.progress(f"{sections[name]['status']}: {sections[name]['reason']}")
            rows += section_rows
            progress.section_done()
    finally:
        progress.close()
    trace = ctx.artifacts.get("trace")
    result = {
        "header": header,
        "quick": args.quick,
        "sections": sections,
        "targets": report.summarize_targets(rows),
        "rows": [row.as_dict() for row in rows],
        "trace": {"title": trace["title"], "events": len(trace["events"])} if trace else None,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(report.format_table(result, rows))
    if args.json:
        report.write_json(result, args.json)
        progress(f"wrote {args.json}")
    if args.trace:
        if trace is None:
            progress("no trace was recorded (launch_bound did not run)")
        else:
            from pydflash.trace import write

            write(trace["events"], args.trace)
            progress(f"wrote {args.trace}")
    if args.plot:
        report.plot(result, rows, trace, args.plot)
        progress(f"wrote {args.plot}")
    return 1 if any(s["status"] == "failed" for s in sections.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
