"""Note [Python entry points] (csrc/python/entry_points.h): every name in pydflash's
Python that the C++ looks up by attribute resolves, so a rename that misses the header
fails here rather than at the first call."""

from __future__ import annotations

import importlib

import pytest

from pydflash import _C


@pytest.mark.parametrize(("module", "name"), _C.PYTHON_ENTRY_POINTS)
def test_each_python_name_the_native_module_calls_exists(module, name):
    found = importlib.import_module(module)
    for part in name.split("."):
        assert hasattr(found, part), f"{module}.{name}: no {part!r}"
        found = getattr(found, part)


def test_the_list_names_pydflash_modules_only():
    assert _C.PYTHON_ENTRY_POINTS
    assert all(module.startswith("pydflash.") for module, _ in _C.PYTHON_ENTRY_POINTS)
