"""The README's training loop runs as written: a user copies it, so it must not rot."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_training_loop_runs_and_learns(tmp_path, capsys):
    loops = [block for block in python_blocks() if "Pipeline(" in block and ".run(" in block]
    assert len(loops) == 1, "expected one runnable training loop in README.md"
    script = tmp_path / "loop.py"
    script.write_text(loops[0])
    runpy.run_path(str(script), run_name="__main__")
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", capsys.readouterr().out)]
    assert len(losses) == 10
    assert losses[-1] < losses[0] * 0.9, f"expected the loss to fall, got {losses}"


def test_the_readme_stays_short():
    lines = README.read_text().count("\n")
    assert lines <= 300, f"expected README.md of at most 300 lines, got {lines}"
