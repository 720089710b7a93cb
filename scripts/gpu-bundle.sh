#!/usr/bin/env bash
# Builds here and gathers what the GPU machine needs into .gpu/ (git-ignored, carried by the
# device tool): the GPU test and bench binaries, the moetrain binary, and the shared libraries
# that image lacks. Then, on the GPU machine: scripts/gpu-check.sh .gpu
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
rm -rf .gpu && mkdir -p .gpu
cp build/moetrain build/tests/test_moe_layer build/tests/test_cuda_train build/tests/test_cuda_dist build/bench_gemm build/bench_moe_layer build/bench_attention build/bench_expert_exchange build/bench_mx build/bench_activation build/bench_fp8_gemm build/bench_optim build/bench_context_parallel build/bench_expert_gemm_error .gpu/
# The op families' tests hold their GPU cases (Gpu*) beside the CPU ones.
for f in core gemm grouped_gemm embedding norm rope attention route permute activation loss optim \
    mx mx_gemm fp8 expert_gemm exchange_layout; do
  cp "build/tests/test_$f" .gpu/
done
for b in bench_grouped_gemm_variants bench_batched_gemm_bound bench_mx_dim1_variants bench_fp8_gemm_variants \
    bench_fp8_fixed_variants bench_fp8_fixed_variants_rul10; do
  if [ -x "build/$b" ]; then cp "build/$b" .gpu/; fi  # workbenches, built on request
done
for lib in libfmt.so.9 libgomp.so.1 libtomlplusplus.so.3; do
  cp -L "/usr/lib/x86_64-linux-gnu/$lib" .gpu/
done
for f in .gpu/*; do case "$f" in *.so*) ;; *) strip "$f" ;; esac; done
du -sh .gpu
