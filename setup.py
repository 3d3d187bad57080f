"""Builds pydflash._C with CMake. Imports nothing heavy (no torch) and needs no network."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def read_version() -> str:
    text = (ROOT / "pydflash" / "_version.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


class CMakeExtension(Extension):
    def __init__(self, name: str, source_dir: Path) -> None:
        super().__init__(name, sources=[])
        self.source_dir = str(source_dir)


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        import pybind11  # build requirement, present under build isolation

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_type = os.environ.get("PYDFLASH_BUILD_TYPE", "Release")
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DPYDFLASH_VERSION={read_version()}",
            f"-DPYDFLASH_CUDA={os.environ.get('PYDFLASH_CUDA', 'AUTO')}",
            f"-DPYDFLASH_SANITIZE={os.environ.get('PYDFLASH_SANITIZE', '')}",
        ]
        ninja = shutil.which("ninja")
        if ninja:
            args += ["-GNinja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        if "CMAKE_CUDA_ARCHITECTURES" in os.environ:
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={os.environ['CMAKE_CUDA_ARCHITECTURES']}")
        args += [a for a in os.environ.get("CMAKE_ARGS", "").split() if a]

        build_dir = Path(self.build_temp) / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cmake", ext.source_dir, *args], cwd=build_dir, check=True)
        build = ["cmake", "--build", ".", "--target", "_C"]
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 2)
        subprocess.run([*build, "--parallel", jobs], cwd=build_dir, check=True)


setup(
    version=read_version(),
    ext_modules=[CMakeExtension("pydflash._C", ROOT)],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
