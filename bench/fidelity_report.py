"""What bench/fidelity.py's figures say: the row real_target reports for them, and the
diagnostic's printed report with its one-sentence reading."""

from __future__ import annotations

from typing import Any

from bench import kernels


# --- rows (real_target) ----------------------------------------------------------------------
def row(section: str, result: dict[str, Any]) -> Any:
    from bench.common import compare

    e = result["errors"]
    note = (
        f"relative error of the features; capture alone (graph vs eager "
        f"on the same padded input) {pct(e['graph_vs_padded'])}, plain torch.cuda.graph "
        f"{pct(e['plain_capture'])}, the lane's thread and stream {pct(e['lane'])}, eager "
        f"run twice {pct(e['eager_repeat'])}; {kernels.note(result['kernels'])}"
    )
    if result["autotune"]["changed"] or result["autotune"]["new"]:
        note += (
            f"; autotuner keys chosen while graphs were captured: "
            f"{len(result['autotune']['new'])} new, {len(result['autotune']['changed'])} changed"
        )
    return compare(
        section,
        f"{result['label']}: graph output vs eager, relative error",
        e["graph"],
        "fraction",
        "noise floor: eager padded vs eager",
        e["padding"],
        note=note,
        errors=e,
        kernels=result["kernels"],
        flags=result["flags"],
        autotune=result["autotune"],
    )


# --- the diagnostic's report -----------------------------------------------------------------
def pct(x: Any) -> str:
    if isinstance(x, str):
        return x
    return "n/a" if x is None else "shapes differ" if x == float("inf") else f"{x * 100:.3f} %"


LINES = (
    ("eager_repeat", "eager vs eager, unpadded, run twice", "determinism"),
    ("padding", "eager padded, cut back  vs  eager", "padding alone: the noise floor"),
    ("graph", "TargetGraphs on a lane  vs  eager", "what a user gets"),
    ("graph_vs_padded", "TargetGraphs on a lane  vs  eager padded", "capture + lane, same input"),
    ("lane", "eager padded on a lane  vs  eager padded", "the lane's thread and stream"),
    ("plain_capture", "torch.cuda.graph  vs  eager padded", "capture alone, no pydflash"),
    ("eager_after_capture", "eager padded after captures  vs  before", "state the captures left"),
)


def format_result(result: dict[str, Any]) -> str:
    e = result["errors"]
    out = [
        f"== {result['label']} ==",
        kernels.note(result["kernels"]),
        "flags: " + ", ".join(f"{k} {v}" for k, v in result["flags"].items()),
        "relative error ‖a - b‖ / ‖b‖ of the features:",
    ]
    for key, what, isolates in LINES:
        out.append(f"  {what:44s} {isolates:32s} {pct(e[key])}")
    a = result["autotune"]
    out.append(
        f"Triton autotuner keys: {a['keys']}; first chosen during TargetGraphs/plain capture: "
        f"{len(a['new'])}; changed: {len(a['changed'])}"
        + (f" ({', '.join((a['new'] + a['changed'])[:4])})" if a["new"] or a["changed"] else "")
    )
    if "diagnosis_failed" in result:
        out.append(f"the call-by-call diagnosis failed: {result['diagnosis_failed']}")
    d = result.get("diagnosis")
    if d:
        out.append("where the bits change, call by call (probed leaf modules and kernels):")
        for title, comparison in (
            ("capture (plain capture vs eager, same padded input)", d["capture"]),
            ("padding (eager padded vs eager unpadded)", d["padding"]),
        ):
            out.append(f"  {title}:")
            out += [f"    {line}" for line in explain_calls(comparison)]
        a = d["autotune_during_capture"]
        out.append(
            f"  autotuner keys first chosen inside the capture: {len(a['new'])}, changed: "
            f"{len(a['changed'])}"
        )
        out.append("plain capture vs eager padded, both under each setting:")
        for name, err in d["remedies"].items():
            out.append(f"  {name:40s} {pct(err)}")
    out.append("reading: " + reading(result))
    return "\n".join(out)


def explain_calls(comparison: dict[str, Any]) -> list[str]:
    if not comparison["aligned"]:
        return ["the two runs made different calls: cannot compare call by call"]
    first = comparison["first"]
    if first is None:
        return [f"all {comparison['calls']} calls bit-identical"]
    where = (
        "its input already differs, after equal outputs: an unprobed op before it"
        if first["between_probes"]
        else "input equal, output differs"
        if first["input_equal"]
        else "input differs"
    )
    lines = [
        f"first difference at call {first['index']} of {comparison['calls']}: "
        f"{first['name']} ({first['kind']}): {where}; output {pct(first['output_error'])}"
    ]
    changed = {k: v for k, v in comparison["by_kind"].items() if v["changed"]}
    same = [f"{k} {v['calls']}" for k, v in comparison["by_kind"].items() if not v["changed"]]
    if changed:
        lines.append(
            "outputs that change with equal inputs: "
            + ", ".join(
                f"{k} {v['changed']} of {v['calls']} (max {pct(v['max'])})"
                for k, v in changed.items()
            )
        )
    lines.append("bit-identical whenever their inputs were: " + (", ".join(same) or "none"))
    return lines


def reading(result: dict[str, Any]) -> str:
    """One sentence on what the figures say, for whoever reads the output alone."""
    e = result["errors"]
    tiny = 1e-6
    parts = []
    if e["eager_repeat"] > tiny:
        parts.append("eager itself is not deterministic here, so every figure has that noise")
    if e["graph"] <= max(e["padding"], tiny) * 1.05:
        parts.append("the graph is within the padding floor: nothing beyond padding to remove")
    else:
        if e["lane"] > tiny:
            parts.append("running on a lane changes the bits (thread or stream)")
        if e["plain_capture"] > tiny and abs(e["plain_capture"] - e["graph_vs_padded"]) <= max(
            0.25 * e["graph_vs_padded"], tiny
        ):
            parts.append(
                "a plain torch.cuda.graph capture differs as much as TargetGraphs: the capture "
                "itself changes kernels, not pydflash's padding or lanes"
            )
        elif e["graph_vs_padded"] > e["plain_capture"] + tiny:
            parts.append(
                "TargetGraphs differs more than a plain capture: look at what it does beyond "
                "capturing (lane, warm-up calls, pool)"
            )
        if e["eager_after_capture"] > tiny:
            parts.append("capturing changed what eager runs afterwards (a choice made again)")
    d = result.get("diagnosis")
    if d:
        fixed = [
            name
            for name, err in d["remedies"].items()
            if name != "as is" and isinstance(err, float) and err <= tiny < e["plain_capture"]
        ]
        if fixed:
            parts.append(f"capture matches eager bit for bit with: {', '.join(fixed)}")
        changed = [
            k for k, v in d["capture"].get("by_kind", {}).items() if v["changed"]
        ]  # the kernels whose bits capture changes
        if changed:
            parts.append(f"under capture these change their output: {', '.join(changed)}")
    return "; ".join(parts) + "." if parts else "no difference anywhere."
