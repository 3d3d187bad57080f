#!/usr/bin/env bash
# What CI cannot show, on one GPU with two lanes (about 4 minutes on an H200):
#   1. the GPU tests: the handoff waits for the target's kernels, pipeline losses on GPU
#      lanes match a loop, flash-linear-attention's kernel matches the torch recurrence,
#      the drafter's fused loss and block attention (no SDPA math fallback) on the GPU;
#   2. the example with --check: pipeline losses vs the sequential loop, within bf16
#      tolerance, at the default sizes, and again with a Hugging Face Qwen3-Next target
#      replayed as CUDA graphs (needs transformers);
#   3. benchmark section 5: step time of the pipeline, the sequential loop, the executor
#      loop and each stage alone, and the hidden-state bytes held at each depth.
# Usage: bash examples/gpu_check.sh        (OUT_DIR=... to choose where results go)
# With two GPUs, the same benchmark puts target and drafter on separate devices, and
#   python -m examples.train_dflash_online --devices cuda:0 cuda:1 --ratio 1:1 --check
# checks the peer-copy path.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT_DIR:-out/gpu_check}
mkdir -p "$out"
python3 -c "import pydflash" 2>/dev/null || python3 setup.py -q build_ext --inplace || exit 1

failed=0
run() {
  echo "== $*"
  "$@" || { echo "!! failed: $*"; failed=1; }
}
run python3 -m pytest -q -m gpu tests/test_pipeline.py tests/test_example.py tests/test_dflash_scale.py
run python3 -m examples.train_dflash_online --devices cuda:0 --ratio 1:1 --check \
  --steps 30 --log-every 10 --out "$out"
run python3 -m examples.train_dflash_online --devices cuda:0 --ratio 1:1 --check \
  --target-config qwen3-next-small --target-graphs --steps 20 --log-every 10 --out "$out/hf"
run python3 -m bench.pipeline --quick --json "$out/bench_pipeline.json"
echo "results in $out"
exit $failed
