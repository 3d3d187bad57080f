#!/usr/bin/env bash
# What CI cannot show, on one GPU with two lanes (about 4 minutes on an H200):
#   1. the GPU tests: the handoff waits for the target's kernels, pipeline losses on GPU
#      lanes match a loop, flash-linear-attention's kernel matches the torch recurrence,
#      the drafter's fused loss and block attention (no SDPA math fallback) on the GPU;
#   2. the example with --check: pipeline losses vs the sequential loop, within bf16
#      tolerance, at the default sizes, and again with a Hugging Face Qwen3-Next target
#      replayed as CUDA graphs (needs transformers), and on a JSONL file of variable-length
#      samples with a loss mask through both graph stages;
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
run python3 -m pytest -q -m gpu tests/test_pipeline.py tests/test_example.py tests/test_dflash_scale.py \
  tests/test_example_data.py tests/test_example_run.py tests/test_bench_fused_loss.py
run python3 -m examples.train_dflash_online --devices cuda:0 --ratio 1:1 --check \
  --steps 30 --log-every 10 --out "$out"
run python3 -m examples.train_dflash_online --devices cuda:0 --ratio 1:1 --check \
  --target-config qwen3-next-small --target-graphs --steps 20 --log-every 10 --out "$out/hf"
python3 - "$out/data.jsonl" <<'EOF'
import json, random, sys
random.seed(0)
with open(sys.argv[1], "w") as f:
    for _ in range(400):  # a prompt, then a supervised reply; 128 to 1,024 tokens
        n = random.randint(128, 1024)
        p = random.randint(16, n // 2)
        ids = [random.randrange(4096) for _ in range(n)]
        f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * p + [1] * (n - p)}) + "\n")
EOF
run python3 -m examples.train_dflash_online --devices cuda:0 --ratio 1:1 --check \
  --data "$out/data.jsonl" --seq 1024 --batch 4 --target-graphs --drafter-graphs \
  --steps 20 --log-every 10 --out "$out/data"
run python3 -m bench.pipeline --quick --json "$out/bench_pipeline.json"
echo "results in $out"
exit $failed
