"""No module in pydflash/ or bench/ is over 500 lines: a file that grows past it holds
more than one question, and is split by question (as bench/real_target*.py are)."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MOST_LINES = 500


@pytest.mark.parametrize("package", ["pydflash", "bench"])
def test_no_module_is_over_500_lines(package):
    modules = sorted((ROOT / package).rglob("*.py"))
    assert len(modules) > 5, f"expected the modules of {package}/, found {len(modules)}"
    lines = {
        path.relative_to(ROOT).as_posix(): len(path.read_bytes().splitlines()) for path in modules
    }
    over = {name: n for name, n in lines.items() if n > MOST_LINES}
    assert not over, f"expected at most {MOST_LINES} lines per module, got {over}"
