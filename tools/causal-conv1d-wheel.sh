#!/usr/bin/env bash
# Build a causal-conv1d wheel for one GPU architecture, on a machine with nvcc and a CUDA torch
# but no network (the lent H200). transformers' Qwen3-Next takes its fast kernel when it is
# installed and otherwise a much slower PyTorch reference, so the bench's eager baselines need
# it to be fair. Its setup.py compiles for eight architectures; this builds one (minutes, not
# tens of minutes).
#
#   here (with a registry):   tools/causal-conv1d-wheel.sh download      # sdist into .whl/src/
#   there (offline, GPU):     tools/causal-conv1d-wheel.sh build OUTDIR  # wheel into OUTDIR
#
# Then carry the wheel in .whl/ and install it as the FLA wheels are installed.
set -euo pipefail
version="${CAUSAL_CONV1D_VERSION:-1.7.0}"
arch="${CAUSAL_CONV1D_ARCH:-90}"
case "${1:-}" in
  download)
    mkdir -p .whl/src
    # The sdist's metadata step imports torch and looks for nvcc; neither is needed to fetch it.
    CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE python3 -m pip download --no-deps --no-binary=:all: \
      --no-build-isolation -d .whl/src "causal-conv1d==$version"
    ;;
  build)
    out="$(realpath "${2:?usage: $0 build OUTDIR}")"
    work="$(mktemp -d)"
    tar xzf ".whl/src/causal_conv1d-$version.tar.gz" -C "$work"
    src="$work/causal_conv1d-$version"
    # Keep the one -gencode pair for $arch; the others only cost compile time.
    python3 - "$src/setup.py" "$arch" <<'PY'
import sys
path, arch = sys.argv[1], sys.argv[2]
text = open(path).read()
anchor = "    # HACK: The compiler flag"
assert anchor in text and f"compute_{arch}," in text, f"setup.py has moved: no sm_{arch} flags or anchor"
keep = f"""    cc_flag = [f for i, f in enumerate(cc_flag)
               if not (f == "-gencode" or (i and cc_flag[i - 1] == "-gencode"))
               or "compute_{arch}," in (f if f != "-gencode" else cc_flag[i + 1])]
"""
open(path, "w").write(text.replace(anchor, keep + anchor, 1))
PY
    (cd "$src" && CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
      python3 -m pip wheel --no-build-isolation --no-deps -w "$out" .)
    ;;
  *)
    echo "usage: $0 download | build OUTDIR" >&2
    exit 2
    ;;
esac
