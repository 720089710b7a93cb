#!/usr/bin/env bash
# On the GPU machine: the GPU tests (every CUDA op against the CPU reference) from a bundle made
# by scripts/gpu-bundle.sh. Logs and JSON go to $OUT; a short table is printed last.
set -uo pipefail
bundle=${1:-.gpu}
out=${OUT:-/tmp/moetrain-gpu}
mkdir -p "$out"
export LD_LIBRARY_PATH="$bundle:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
# The device API (symmetric windows, LSA) must run on the NCCL it was built against (2.28.9, as
# PyTorch's wheel there carries it; the system's is older): that one first.
nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
[ -n "$nccl_dir" ] && export LD_LIBRARY_PATH="$nccl_dir:$LD_LIBRARY_PATH"
# cuDNN comes from the machine: the system's, else the one PyTorch's wheels carry.
if ! ldconfig -p | grep -q 'libcudnn.so.9'; then
  cudnn_dir=$(python3 -c 'import nvidia.cudnn, os; print(os.path.join(nvidia.cudnn.__path__[0], "lib"))' 2>/dev/null)
  [ -n "$cudnn_dir" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$cudnn_dir"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
# The op families' GPU cases (Gpu*: each kernel against the CPU reference), then the MoE layer's.
status=0
: >"$out/gpu_tests.log"
for f in core gemm grouped_gemm embedding norm rope attention route permute activation loss optim \
    mx mx_gemm fp8 expert_gemm exchange_layout; do
  "$bundle/test_$f" --gtest_filter='*Gpu*' >>"$out/gpu_tests.log" 2>&1 || status=1
done
"$bundle/test_moe_layer" >>"$out/gpu_tests.log" 2>&1 || status=1
# The training tests read configs/ from the source tree they were built in: run from here.
MOETRAIN_SOURCE_DIR="$PWD" MOETRAIN_BIN="$bundle/moetrain" "$bundle/test_cuda_train" \
  >>"$out/gpu_tests.log" 2>&1 || status=1
# NCCL: one GPU, and two when present (collectives, then 2-GPU training against 1 GPU); a hang
# is cut off rather than eating the machine's time.
MOETRAIN_SOURCE_DIR="$PWD" MOETRAIN_BIN="$bundle/moetrain" timeout 300 "$bundle/test_cuda_dist" \
  >>"$out/gpu_tests.log" 2>&1 || { status=1; echo "test_cuda_dist failed or timed out"; }
grep -E "^\[ *(OK|FAILED) *\]|Failure|error|seed" "$out/gpu_tests.log" | grep -v "listed below" | tail -40
# The README's main job, on the GPU (hardware.device = auto picks it).
"$bundle/moetrain" train --config configs/tiny.toml --set train.log_every=100 \
  --metrics "$out/tiny_gpu.jsonl" >"$out/tiny_gpu.log" 2>&1 || status=1
tail -2 "$out/tiny_gpu.log"
# Benchmarks: GPU_CHECK_BENCH lists which (default all but recipes and scaling; 0 for none),
# GPU_CHECK_LAYERS the layer counts of the full-model step.
benches=",${GPU_CHECK_BENCH:-gemm,mx,fp8,activation,optim,attention,cp,exchange,moe,model},"
run_bench() {  # name, command...: JSON lines to bench.jsonl, failures named on stdout
  local name=$1
  shift
  "$@" >>"$out/bench.jsonl" 2>>"$out/bench.log" || echo "$name failed: $(tail -3 "$out/bench.log")"
}
: >"$out/bench.jsonl"
if [[ $benches == *,gemm,* ]]; then
  run_bench bench_gemm "$bundle/bench_gemm"
  run_bench grouped_mm_torch python3 bench/grouped_mm_torch.py
  [ -x "$bundle/bench_grouped_gemm_variants" ] && run_bench variants "$bundle/bench_grouped_gemm_variants"
fi
if [[ $benches == *,mx,* ]]; then
  run_bench bench_mx "$bundle/bench_mx"
fi
if [[ $benches == *,fp8,* ]]; then
  run_bench bench_fp8_gemm "$bundle/bench_fp8_gemm"
  [ -x "$bundle/bench_fp8_gemm_variants" ] && run_bench fp8_variants "$bundle/bench_fp8_gemm_variants"
  for v in bench_fp8_fixed_variants bench_fp8_fixed_variants_rul10; do
    [ -x "$bundle/$v" ] && run_bench "$v" "$bundle/$v"
  done
  run_bench fp8_grouped_mm_torch python3 bench/fp8_grouped_mm_torch.py
fi
if [[ $benches == *,activation,* ]]; then
  run_bench bench_activation "$bundle/bench_activation"
fi
if [[ $benches == *,optim,* ]]; then
  run_bench bench_optim "$bundle/bench_optim"
fi
if [[ $benches == *,attention,* ]]; then
  run_bench bench_attention "$bundle/bench_attention"
  run_bench attention_torch python3 bench/attention_torch.py
fi
if [[ $benches == *,cp,* ]]; then
  run_bench bench_context_parallel "$bundle/bench_context_parallel"
fi
if [[ $benches == *,exchange,* ]]; then  # two or more GPUs
  run_bench bench_expert_exchange timeout 300 "$bundle/bench_expert_exchange"
fi
if [[ $benches == *,moe,* ]]; then
  run_bench bench_moe_layer "$bundle/bench_moe_layer"
  run_bench moe_layer_torch python3 bench/moe_layer_torch.py
fi
if [[ $benches == *,model,* ]]; then
  run_bench bench-model env OUT="$out" scripts/bench-model.sh "$bundle/moetrain" ${GPU_CHECK_LAYERS:-}
fi
if [[ $benches == *,recipes,* ]]; then  # the FP8 recipes' step against bf16's, alternating
  run_bench bench-recipes env OUT="$out" scripts/bench-recipes.sh "$bundle/moetrain" ${GPU_CHECK_LAYERS:-}
fi
if [[ $benches == *,scaling,* ]]; then  # two or more GPUs: every ep of W = all GPUs
  run_bench bench-scaling env OUT="$out" scripts/bench-scaling.sh "$bundle/moetrain" "" ${GPU_CHECK_LAYERS:-}
fi
if [ -s "$out/bench.jsonl" ]; then
  echo "== benchmarks (JSON lines, also in bench.jsonl)"
  cat "$out/bench.jsonl"
fi
echo "== gpu tests: $(grep -c '^\[       OK' "$out/gpu_tests.log") ok, $(grep -c '^\[  FAILED  \] [A-Z]' "$out/gpu_tests.log") failed (exit $status)"
exit $status
