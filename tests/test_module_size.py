"""No module in pydflash/ or bench/ is over 500 lines: a file that grows past it holds
more than one question, and is split by question (as bench/real_target*.py are)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pydflash", "bench")
MOST_LINES = 500


def module_lines() -> dict[str, int]:
    modules = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    assert len(modules) > 10, f"expected the modules of {PACKAGES}, found {len(modules)}"
    return {
        path.relative_to(ROOT).as_posix(): len(path.read_bytes().splitlines()) for path in modules
    }


def test_no_module_is_over_500_lines():
    over = {name: n for name, n in module_lines().items() if n > MOST_LINES}
    assert not over, f"expected at most {MOST_LINES} lines per module, got {over}"
