"""pydflash builds with scikit-build-core: pyproject.toml configures it, CMakeLists.txt
builds pydflash._C. pip runs it; this file imports nothing heavy and builds nothing itself.

    pip install .                             # build and install
    pip install -e .                          # editable: Python from this tree, _C built once
    pip install --no-build-isolation -e .     # the same with no download: scikit-build-core,
                                              # pybind11, cmake and ninja already installed

`python setup.py build_ext --inplace`, the older in-place build, runs the last command.
"""

import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":
    args = sys.argv[1:]
    if "build_ext" not in args or not {"--inplace", "-i"} & set(args):
        sys.exit(__doc__)
    quiet = ["-q"] if {"-q", "--quiet"} & set(args) else []
    root = Path(__file__).resolve().parent
    pip = [sys.executable, "-m", "pip", "install", *quiet, "--no-build-isolation", "-e", str(root)]
    sys.exit(subprocess.run(pip).returncode)
