"""Imports pydflash and prints what the import brought in, as one JSON line: whether
torch was imported, and the CUDA driver's files mapped into the process.

    --count-devices     then asks the native module for its devices: a CUDA build looks
                        for the driver, which shows that the report can see it
    --native-version V  then imports the package again with pydflash._C reporting
                        version V, as a stale build of the native module would
"""

import argparse
import importlib
import json
import sys

import pydflash


def driver_files() -> list[str]:
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "libcuda.so" in line})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count-devices", action="store_true")
    parser.add_argument("--native-version")
    args = parser.parse_args()
    if args.count_devices:
        pydflash._C.device_count()
    if args.native_version is not None:
        pydflash._C.__version__ = args.native_version
        importlib.reload(pydflash)
    print(json.dumps({"torch": "torch" in sys.modules, "driver": driver_files()}))


if __name__ == "__main__":
    main()
