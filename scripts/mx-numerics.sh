#!/usr/bin/env bash
# The quantized recipes' numerics study (MXFP8 and FP8 blockwise): configs/mx-numerics.toml
# trained once per expert recipe (same seed,
# same data), one metrics file each under $OUT (default /tmp/moetrain-mx-numerics); then
# scripts/plot_mx_numerics.py draws the loss curves (docs/mx_numerics.png) and prints the final
# gaps to bf16.
# Usage: scripts/mx-numerics.sh [moetrain binary]. The nine runs share the GPU concurrently (the
# model is small and launch-bound: together they finish sooner than one after another).
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/moetrain}
out=${OUT:-/tmp/moetrain-mx-numerics}
mkdir -p "$out"
declare -A runs=(
  [bf16]="model.expert_recipe=bf16"
  [mxfp8]="model.expert_recipe=mxfp8"
  [mxfp8_wgrad_with_hp]="model.expert_recipe=mxfp8_wgrad_with_hp"
  [mxfp8_wgrad_with_hp__mxfp8_dispatch]="model.expert_recipe=mxfp8_wgrad_with_hp parallel.ep_dispatch_dtype=mxfp8"
  [mxfp8__mxfp8_dispatch__requant_dim1]="model.expert_recipe=mxfp8 parallel.ep_dispatch_dtype=mxfp8 model.requant_dim1=true"
  [fp8_blockwise]="model.expert_recipe=fp8_blockwise"
  [fp8_wgrad_with_hp]="model.expert_recipe=fp8_wgrad_with_hp"
  # The dense layers in FP8 too (model.dense_recipe) need the key and value heads 128 wide
  # together: a pair of its own with four of them, its gap taken to that shape's bf16.
  [bf16__kv128]="model.n_kv_heads=4"
  [fp8_wgrad_with_hp__dense_fp8__kv128]="model.expert_recipe=fp8_wgrad_with_hp model.dense_recipe=fp8_wgrad_with_hp model.n_kv_heads=4"
)
names=(bf16 mxfp8 mxfp8_wgrad_with_hp mxfp8_wgrad_with_hp__mxfp8_dispatch mxfp8__mxfp8_dispatch__requant_dim1
  fp8_blockwise fp8_wgrad_with_hp bf16__kv128 fp8_wgrad_with_hp__dense_fp8__kv128)
start=$(date +%s)
for name in "${names[@]}"; do
  sets=()
  for kv in ${runs[$name]}; do sets+=(--set "$kv"); done
  rm -f "$out/$name.jsonl"
  "$bin" train --config configs/mx-numerics.toml "${sets[@]}" --metrics "$out/$name.jsonl" \
    >"$out/$name.log" 2>&1 &
done
status=0
wait || status=1
for name in "${names[@]}"; do echo "$name: $(tail -1 "$out/$name.log")"; done
echo "all runs: $(( $(date +%s) - start )) s"
exit $status
