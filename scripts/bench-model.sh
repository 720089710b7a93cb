#!/usr/bin/env bash
# The full-model training step on one GPU: configs/qwen3-30b-a3b-bench.toml (Qwen3-30B-A3B layer
# shapes, 16384 tokens per step) for each layer count given (default 7), one JSON
# line each with the median tokens/s and MFU of the steps after the first two, and peak memory.
# Usage: scripts/bench-model.sh [moetrain binary] [layers ...]; BENCH_SET="section.key=value ..."
# adds overrides (e.g. BENCH_SET="model.checkpoint=selective").
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/moetrain}
shift || true
out=${OUT:-/tmp/moetrain-bench}
mkdir -p "$out"
extra=()
for kv in ${BENCH_SET:-}; do extra+=(--set "$kv"); done
tag=$(echo "${BENCH_SET:-}" | sed 's/[ =.]/_/g')
for layers in "${@:-7}"; do
  metrics="$out/model_step_${layers}${tag}.jsonl"
  if ! "$bin" train --config configs/qwen3-30b-a3b-bench.toml --set "model.n_layers=$layers" "${extra[@]}" \
      --metrics "$metrics" >"$out/model_step_${layers}${tag}.log" 2>&1; then
    echo "{\"bench\":\"model_step\",\"layers\":$layers,\"error\":\"$(tail -1 "$out/model_step_${layers}${tag}.log" | tr -d '"\\')\"}"
    continue
  fi
  python3 - "$metrics" "$layers" "${BENCH_SET:-}" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steady = rows[2:] or rows
print(json.dumps({"bench": "model_step", "preset": "qwen3-30b-a3b-bench",
                  "layers": int(sys.argv[2]), "overrides": sys.argv[3], "tokens_per_step": 16384,
                  "steps_timed": len(steady),
                  "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in steady)),
                  "mfu": round(statistics.median(r["mfu"] for r in steady), 4),
                  "peak_gib": round(max(r["peak_bytes"] for r in rows) / 2**30, 2),
                  "final_loss": round(rows[-1]["loss"], 4)}))
PY
done
