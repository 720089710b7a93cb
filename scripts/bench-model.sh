#!/usr/bin/env bash
# The full-model training step: configs/qwen3-30b-a3b-bench.toml (Qwen3-30B-A3B layer shapes,
# 16384 tokens per step and GPU) for each layer count given (default: the config's), one JSON line each with
# the median tokens/s (per GPU) and MFU of the steps after the first two, peak memory (rank 0)
# and, with expert parallelism, the median time in dispatch/combine per step.
# Usage: scripts/bench-model.sh [moetrain binary] [layers ...]; BENCH_SET="section.key=value ..."
# adds overrides (e.g. BENCH_SET="model.checkpoint=selective parallel.ep=2"); BENCH_RANKS=N runs
# N ranks, one GPU each (moetrain launch -n N); BENCH_CONFIG another config file (the tests run
# the tiny one on CPU ranks).
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/moetrain}
shift || true
out=${OUT:-/tmp/moetrain-bench}
mkdir -p "$out"
extra=()
for kv in ${BENCH_SET:-}; do extra+=(--set "$kv"); done
ranks=${BENCH_RANKS:-1}
config=${BENCH_CONFIG:-configs/qwen3-30b-a3b-bench.toml}
tag=$(echo "${BENCH_SET:-}" | sed 's/[ =./]/_/g')
[ "$ranks" -gt 1 ] && tag="_w${ranks}${tag}"
cmd=("$bin")
[ "$ranks" -gt 1 ] && cmd=("$bin" launch -n "$ranks" -- )
preset_layers=$(grep -E '^n_layers *=' "$config" | grep -oE '[0-9]+')  # the default count
for layers in "${@:-$preset_layers}"; do
  metrics="$out/model_step_${layers}${tag}.jsonl"
  rm -f "$metrics"  # the trainer appends
  if ! "${cmd[@]}" train --config "$config" --set "model.n_layers=$layers" "${extra[@]}" \
      --metrics "$metrics" >"$out/model_step_${layers}${tag}.log" 2>&1; then
    echo "{\"bench\":\"model_step\",\"layers\":$layers,\"error\":\"$(tail -1 "$out/model_step_${layers}${tag}.log" | tr -d '"\\')\"}"
    continue
  fi
  python3 - "$metrics" "$layers" "${BENCH_SET:-}" "$ranks" "$config" <<'PY'
import json, os, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steady = rows[2:] or rows
ranks = int(sys.argv[4])
line = {"bench": "model_step", "preset": os.path.basename(sys.argv[5]).removesuffix(".toml"),
        "gpus": ranks, "layers": int(sys.argv[2]), "overrides": sys.argv[3],
        "steps_timed": len(steady),
        "tokens_per_s_per_gpu": round(statistics.median(r["tokens_per_s"] for r in steady) / ranks),
        # Of them, the documents' (whole packing pads its rows' tails; the stream does not).
        "real_tokens_per_s_per_gpu": round(statistics.median(
            r["tokens_per_s"] * (1 - r.get("pad_fraction", 0)) for r in steady) / ranks),
        # Over the timed steps together: their real tokens over their time (steps of uneven
        # cost, as whole packing's rows of a few long or many short documents, weigh by time).
        "real_tokens_per_s_per_gpu_overall": round(
            sum(1 - r.get("pad_fraction", 0) for r in steady)
            / sum(1 / r["tokens_per_s"] for r in steady) / ranks),
        "pad_fraction": round(statistics.median(r.get("pad_fraction", 0) for r in steady), 4),
        "mfu": round(statistics.median(r["mfu"] for r in steady), 4),
        "peak_gib": round(max(r["peak_bytes"] for r in rows) / 2**30, 2),
        # The caching allocator's trips to the driver in the timed steps (0 when steady; flushes:
        # the step ran at the memory limit).
        "device_mallocs": sum(r.get("device_mallocs", 0) for r in steady),
        "cache_flushes": sum(r.get("cache_flushes", 0) for r in steady),
        "final_loss": round(rows[-1]["loss"], 4)}
for key in ("exchange_ms", "exchange_exposed_ms"):  # with ep > 1 (eager passes: graphs time none)
    if key in rows[-1]:
        line[key] = round(statistics.median(r[key] for r in steady), 2)
print(json.dumps(line))
PY
done
