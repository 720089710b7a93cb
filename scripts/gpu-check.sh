#!/usr/bin/env bash
# On the GPU machine: the GPU tests (every CUDA op against the CPU reference) from a bundle made
# by scripts/gpu-bundle.sh. Logs and JSON go to $OUT; a short table is printed last.
set -uo pipefail
bundle=${1:-.gpu}
out=${OUT:-/tmp/moetrain-gpu}
mkdir -p "$out"
export LD_LIBRARY_PATH="$bundle:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
"$bundle/test_cuda_ops" --gtest_output="json:$out/test_cuda_ops.json" >"$out/test_cuda_ops.log" 2>&1
status=$?
# The training tests read configs/ from the source tree they were built in: run from here.
MOETRAIN_SOURCE_DIR="$PWD" "$bundle/test_cuda_train" >>"$out/test_cuda_ops.log" 2>&1 || status=1
grep -E "^\[ *(OK|FAILED) *\]|Failure|error|seed" "$out/test_cuda_ops.log" | grep -v "listed below" | tail -40
# The README's main job, on the GPU (hardware.device = auto picks it).
"$bundle/moetrain" train --config configs/tiny.toml --set train.log_every=100 \
  --metrics "$out/tiny_gpu.jsonl" >"$out/tiny_gpu.log" 2>&1 || status=1
tail -2 "$out/tiny_gpu.log"
if [ "${GPU_CHECK_BENCH:-1}" = 1 ]; then
  "$bundle/bench_gemm" >"$out/bench.jsonl" 2>"$out/bench.log" || echo "bench_gemm failed: $(tail -3 "$out/bench.log")"
  python3 bench/grouped_mm_torch.py >>"$out/bench.jsonl" 2>>"$out/bench.log" || echo "torch comparator failed: $(tail -3 "$out/bench.log")"
  [ -x "$bundle/bench_grouped_gemm_variants" ] && "$bundle/bench_grouped_gemm_variants" >>"$out/bench.jsonl" 2>>"$out/bench.log"
  "$bundle/bench_moe_layer" >>"$out/bench.jsonl" 2>>"$out/bench.log" || echo "bench_moe_layer failed: $(tail -3 "$out/bench.log")"
  python3 bench/moe_layer_torch.py >>"$out/bench.jsonl" 2>>"$out/bench.log" || echo "torch MoE comparator failed: $(tail -3 "$out/bench.log")"
  echo "== benchmarks (JSON lines, also in bench.jsonl)"
  cat "$out/bench.jsonl"
fi
echo "== gpu tests: $(grep -c '^\[       OK' "$out/test_cuda_ops.log") ok, $(grep -c '^\[  FAILED  \] [A-Z]' "$out/test_cuda_ops.log") failed (exit $status)"
exit $status
