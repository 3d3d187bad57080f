"""Two runs side by side: `python -m bench.compare A.json B.json` prints every row
measured in both, its figure and ratio in A and in B, and the kernels each run's eager
rows named (e.g. a run with causal-conv1d against one with `--fallback causal_conv1d`)."""

from __future__ import annotations

import json
import sys
from typing import Any

from .report import number


def first_kernels(result: dict[str, Any]) -> Any:
    return next((r["extra"]["kernels"] for r in result["rows"] if r["extra"].get("kernels")), None)


def lines(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    other = {row["name"]: row for row in b["rows"]}
    out = [f"{'ratio A':>8} {'ratio B':>8}  {'value A':>9} {'value B':>9}  unit      row"]
    for row in a["rows"]:
        twin = other.get(row["name"])
        if row["value"] is None or twin is None or twin["value"] is None:
            continue
        out.append(
            f"{number(row['ratio']):>8} {number(twin['ratio']):>8}  {number(row['value']):>9} "
            f"{number(twin['value']):>9}  {row['unit']:9} {row['name']}"
        )
    out.append(f"kernels A: {first_kernels(a)}")
    out.append(f"kernels B: {first_kernels(b)}")
    return out


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if len(paths) != 2:
        print("usage: python -m bench.compare A.json B.json", file=sys.stderr)
        return 2
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    print(f"A: {paths[0]}\nB: {paths[1]}")
    print("\n".join(lines(*runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
