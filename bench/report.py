"""The results of a run as a text table, a JSON file and a PNG figure.

A run's result is a dict: `header` (machine, versions, date), `sections` (status of
each section: "ok", "not run" or "failed", with the reason), `rows` (Row.as_dict()),
and `targets` (how many were met, missed, or not measured on this machine).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterable, Iterator
from typing import Any

from pydflash.trace import GPU_TID

from .common import Row, parse_target

DASH = "-"
REASON_WIDTH = 44  # longer reasons for an unmeasured row go to the notes under the table


def summarize_targets(rows: Iterable[Row]) -> dict[str, Any]:
    targeted = [r for r in rows if r.target is not None]
    return {
        "met": [r.name for r in targeted if r.met is True],
        "missed": [r.name for r in targeted if r.met is False],
        "not_measured": [r.name for r in targeted if r.met is None],
    }


# --- text ------------------------------------------------------------------------------


def number(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return DASH
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return f"{value:.2e}"


def _mode_text(mode: str) -> str:
    return {"quick": " (--quick)", "full": " (--full)"}.get(mode, "")


def _met(row: Row) -> str:
    if row.target is None:
        return ""
    return {True: "yes", False: "MISSED", None: "not measured"}[row.met]


def format_table(result: dict[str, Any], rows: list[Row]) -> str:
    header = result["header"]
    lines = [
        f"pydflash {header.get('pydflash')} benchmarks, {header.get('date')}"
        f"{_mode_text(result.get('mode') or ('quick' if result.get('quick') else 'default'))}",
        f"host: {header.get('cpu')} ({header.get('cpu_count')} cores), {header.get('platform')}",
        f"python {header.get('python')}, torch {header.get('torch')}, "
        f"triton {header.get('triton')}, CUDA runtime {header.get('cuda_runtime')}, "
        f"driver {header.get('cuda_driver')}",
    ]
    if header.get("gpus_used"):
        lines.append(f"GPUs: {', '.join(header.get('device_names') or [])}")
    else:
        why = header.get("devices_unavailable_because") or "no CUDA device visible"
        lines.append(f"GPUs: none ({why}): every figure below is CPU-only")
    columns = ("name", "median", "vs", "baseline", "ratio", "speedup", "target", "met")
    table = [columns]
    notes = []
    for section, status in result["sections"].items():
        table.append((f"[{section}]", "", "", "", "", "", "", status["status"]))
        for row in (r for r in rows if r.section == section):
            if not row.measured:
                reason = row.note if len(row.note) <= REASON_WIDTH else "see notes"
                table.append((row.name, DASH, reason, "", "", "", row.target or "", _met(row)))
                if reason != row.note:
                    notes.append(f"{row.name}: {row.note}")
                continue
            speedup = row.speedup
            table.append(
                (
                    row.name,
                    f"{number(row.value)} {row.unit}",
                    row.baseline_name or "",
                    f"{number(row.baseline)} {row.unit}" if row.baseline is not None else "",
                    number(row.ratio) if row.ratio is not None else "",
                    f"{number(speedup)}x" if speedup is not None else "",
                    row.target or "",
                    _met(row),
                )
            )
            if row.note:
                notes.append(f"{row.name}: {row.note}")
    widths = [max(len(str(line[i])) for line in table) for i in range(len(columns))]
    for line in table:
        cells = (str(cell).ljust(w) for cell, w in zip(line, widths, strict=True))
        lines.append("  ".join(cells).rstrip())
    if result.get("missing"):
        lines.append(
            f"stopped part-way: not measured: {', '.join(result['missing'])}"
            f" (finished: {', '.join(result.get('finished') or []) or 'none'})"
        )
    targets = result["targets"]
    lines.append(
        f"targets: {len(targets['met'])} met, {len(targets['missed'])} missed, "
        f"{len(targets['not_measured'])} not measured on this machine"
    )
    lines += [f"  missed: {name}" for name in targets["missed"]]
    if notes:
        lines.append("notes:")
        lines += [f"  {note}" for note in notes]
    return "\n".join(lines)


# --- JSON ------------------------------------------------------------------------------


def _finite(obj: Any) -> Any:
    # JSON has no NaN or infinity: unmeasurable figures are null.
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_json(result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Replaces `path` at once: a run stopped while writing leaves the previous file."""
    with _replacing(path) as part, open(part, "w") as f:
        json.dump(_finite(result), f, indent=1, default=str, allow_nan=False)
        f.write("\n")


@contextlib.contextmanager
def _replacing(path: str | os.PathLike[str]) -> Iterator[str]:
    """A name beside `path` to write to; moved over `path` when the block ends."""
    path = os.fspath(path)
    folder, name = os.path.split(path)
    stem, ext = os.path.splitext(name)
    part = os.path.join(folder, f".{stem}.part{ext}")  # same suffix: matplotlib reads it
    try:
        yield part
        os.replace(part, path)
    finally:
        if os.path.exists(part):
            os.unlink(part)


# --- figure ----------------------------------------------------------------------------


def matplotlib_missing() -> str | None:
    """Why --plot cannot work here, or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib: pip install matplotlib (or '.[bench]')"
    return None


def plotted_metric(rows: list[Row]) -> str:
    """What a section's bars show: the figure its targets are on, else the ratio."""
    for row in rows:
        if row.target is not None:
            metric, _, _ = parse_target(row.target)
            return metric or "ratio"
    return "ratio"


def _figure(row: Row, metric: str) -> float | None:
    value = row.figure(metric)
    return None if value is None or not math.isfinite(value) else value


def plot(
    result: dict[str, Any],
    rows: list[Row],
    trace: dict[str, Any] | None,
    path: str | os.PathLike[str],
) -> None:
    """Bars of each section's figures against their targets, and a per-lane timeline
    of the recorded trace."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for section in result["sections"]:
        section_rows = [r for r in rows if r.section == section]
        metric = plotted_metric(section_rows)
        bars = [(r, _figure(r, metric)) for r in section_rows if r.measured]
        bars = [(r, v) for r, v in bars if v is not None]
        if bars:
            panels.append((section, metric, bars))
    heights = [max(1.5, 0.35 * len(bars) + 0.8) for _, _, bars in panels]
    if trace is not None:
        heights.append(max(2.0, 0.5 * _lane_tracks(trace["events"]) + 1.0))
    if not heights:
        heights = [1.5]
    fig, axes = plt.subplots(
        len(heights),
        1,
        figsize=(11, sum(heights) + 0.8),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    axes = [a[0] for a in axes]
    header = result["header"]
    gpus = ", ".join(header.get("device_names") or []) or "no GPU (CPU-only figures)"
    fig.suptitle(
        f"pydflash {header.get('pydflash')}, {header.get('date')}: {gpus}; "
        f"torch {header.get('torch')}"
        + (
            f"\nstopped part-way: not measured: {', '.join(result['missing'])}"
            if result.get("missing")
            else ""
        ),
        fontsize=9,
    )
    for ax, (section, metric, bars) in zip(axes, panels, strict=False):
        _bars(ax, section, metric, bars)
    if trace is not None:
        _timeline(axes[len(panels)], trace)
    elif not panels:
        axes[0].text(0.5, 0.5, "nothing measured", ha="center", va="center")
        axes[0].axis("off")
    # Leave the top half inch to the title; "tight" keeps long row labels in the image.
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    with _replacing(path) as part:
        fig.savefig(part, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _bars(ax: Any, section: str, metric: str, bars: list[tuple[Row, float]]) -> None:
    colors = {True: "tab:green", False: "tab:red", None: "tab:gray"}
    names = [row.name for row, _ in bars]
    values = [value for _, value in bars]
    ax.barh(range(len(bars)), values, color=[colors[row.met] for row, _ in bars])
    ax.set_yticks(range(len(bars)), names, fontsize=7)
    ax.invert_yaxis()
    for y, (row, _) in enumerate(bars):
        if row.target is not None:
            _, _, bound = parse_target(row.target)
            ax.plot(
                [bound, bound], [y - 0.45, y + 0.45], color="black", linestyle="--", linewidth=1
            )
    if metric in ("ratio", "speedup"):
        ax.axvline(1.0, color="gray", linestyle=":", linewidth=0.8)  # parity with the baseline
    label = {
        "ratio": "ratio to baseline (value / baseline)",
        "value": "value",
        "speedup": "speedup over baseline (x)",
        "added": "added over baseline (value - baseline)",
    }[metric]
    ax.set_title(
        f"{section}: {label}; dashed: target (green met, red missed), dotted: 1", fontsize=8
    )
    ax.tick_params(axis="x", labelsize=7)


def _lane_tracks(events: list[dict[str, Any]]) -> int:
    return len({(e["pid"], e["tid"]) for e in events if e.get("ph") == "X"})


def _timeline(ax: Any, trace: dict[str, Any]) -> None:
    spans = [e for e in trace["events"] if e.get("ph") == "X"]
    queued = {}  # (pid, id) -> [begin µs, end µs]
    for e in trace["events"]:
        if e.get("ph") in ("b", "e"):
            queued.setdefault((e["pid"], e["id"]), [0.0, 0.0])[e["ph"] == "e"] = e["ts"]
    ax.set_title(f"timeline: {trace['title']} (gray: time in the queue)", fontsize=8)
    if not spans:
        ax.text(0.5, 0.5, "no spans recorded", ha="center", va="center")
        return
    tracks = sorted({(e["pid"], e["tid"]) for e in spans})
    labels = sorted({e["name"] for e in spans})
    cmap = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    t0 = min([e["ts"] for e in spans] + [b for b, _ in queued.values()])
    for y, (pid, tid) in enumerate(tracks):
        mine = [e for e in spans if (e["pid"], e["tid"]) == (pid, tid)]
        ax.broken_barh(
            [((e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, 1e-4)) for e in mine],
            (y - 0.3, 0.7),
            facecolors=[cmap[e["name"]] for e in mine],
            edgecolor="white",
            linewidth=0.5,
        )
        if tid != GPU_TID:
            waits = [
                ((b - t0) / 1e3, (e - b) / 1e3) for (p, _), (b, e) in queued.items() if p == pid
            ]
            ax.broken_barh(waits, (y - 0.45, 0.1), facecolors="lightgray")
    ax.set_yticks(
        range(len(tracks)),
        [f"lane {pid} {'gpu' if tid == GPU_TID else 'host'}" for pid, tid in tracks],
        fontsize=7,
    )
    ax.invert_yaxis()
    ax.set_xlabel("ms", fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
    from matplotlib.patches import Patch

    ax.legend(
        handles=[Patch(color=cmap[label], label=label) for label in labels],
        fontsize=7,
        loc="upper right",
    )
