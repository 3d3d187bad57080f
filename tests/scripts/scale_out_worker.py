"""A stand-in worker for bench/scale_out.py's `launch`, for the tests of it in
test_bench_scale_out.py: it behaves as its one argument says.

    environment   prints, as one JSON line, the torchrun variables launch sets (RANK,
                  LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and the NVLink
                  multicast switches (NCCL_NVLS_ENABLE, TORCH_SYMM_MEM_DISABLE_MULTICAST,
                  NVSHMEM_DISABLE_NVLS); null for one that is unset
    fail-rank-1   rank 1 exits with status 1 and an error as its last line on stderr;
                  the other ranks sleep past any limit
    sleep         sleeps past any limit
"""

import json
import os
import sys
import time

SHOWN = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NCCL_NVLS_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS",
)


def main() -> None:
    behaviour = sys.argv[1] if len(sys.argv) == 2 else None
    if behaviour == "environment":
        print(json.dumps({name: os.environ.get(name) for name in SHOWN}))
    elif behaviour == "fail-rank-1":
        if os.environ["RANK"] == "1":
            sys.exit("RuntimeError: no device")
        time.sleep(60)
    elif behaviour == "sleep":
        time.sleep(60)
    else:
        sys.exit(f"expected one of environment, fail-rank-1, sleep, got {sys.argv[1:]}")


if __name__ == "__main__":
    main()
