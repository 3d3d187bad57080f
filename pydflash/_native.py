"""Loads pydflash._C with an error that says what was built and what is missing."""

from __future__ import annotations

import sys

from .errors import NativeModuleError

try:
    from . import _C
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    raise NativeModuleError(
        f"pydflash's native module failed to load ({exc}). It is built by `pip install .`; "
        f"this interpreter is Python {sys.version.split()[0]} at {sys.executable}. "
        "Reinstall from the source tree, and run `python -m pydflash` for build details."
    ) from exc

C = _C
