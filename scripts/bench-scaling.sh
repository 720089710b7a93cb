#!/usr/bin/env bash
# Expert-parallel scaling on one host (issue 5's table): the full-model step of
# configs/qwen3-30b-a3b-bench.toml on W GPUs (16384 tokens per GPU) for every ep that divides W
# (W, W/2, ..., 1), with learned, skewed and balanced routing (model.routing); one JSON line per case from
# scripts/bench-model.sh (tokens/s per GPU, MFU, peak memory, time in dispatch/combine).
# Usage: scripts/bench-scaling.sh [moetrain binary] [W (default: every visible GPU)] [layers];
# BENCH_SET adds overrides to every case, BENCH_CONFIG picks another config (see bench-model.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/moetrain}
world=${2:-$(nvidia-smi --list-gpus 2>/dev/null | wc -l)}
layers=${3:-}  # default: the preset's own count
if ! [[ $world =~ ^[0-9]+$ ]] || (( world < 1 )); then
  echo "bench-scaling: W = '$world': give the number of GPUs (no GPU visible to count)" >&2
  exit 2
fi
export NCCL_NVLS_ENABLE=0
for ((ep = world; ep >= 1; ep /= 2)); do
  (( world % ep == 0 )) || continue
  for routing in learned skewed balanced; do
    BENCH_RANKS=$world BENCH_SET="${BENCH_SET:-} parallel.ep=$ep model.routing=$routing" \
      scripts/bench-model.sh "$bin" $layers
  done
done
