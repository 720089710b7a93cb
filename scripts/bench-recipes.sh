#!/usr/bin/env bash
# The precision recipes' training step against bf16's in one job (docs/benchmarks.md, issue 34):
# scripts/bench-model.sh's step (configs/qwen3-30b-a3b-bench.toml, or BENCH_CONFIG) at one layer
# count under bf16, the experts in FP8 (model.expert_recipe = "fp8_wgrad_with_hp") and the
# experts and dense layers in FP8 (model.dense_recipe too), run in turn ROUNDS times, so that a
# drift of the machine's clocks falls on all three. Each run's JSON line goes to stdout and
# $OUT/recipes.jsonl; last, on stderr, a table of each run's tokens/s, peak memory and final loss,
# and its ratio to the bf16 run of its round.
# Usage: scripts/bench-recipes.sh [moetrain binary] [layers]; ROUNDS (default 2), STEPS (default
# 20), BENCH_SET (overrides added to every run), BENCH_CONFIG as scripts/bench-model.sh takes.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/moetrain}
layers=${2:-$(grep -E '^n_layers *=' "${BENCH_CONFIG:-configs/qwen3-30b-a3b-bench.toml}" |
  grep -oE '[0-9]+')}
out=${OUT:-/tmp/moetrain-bench}
mkdir -p "$out"
lines="$out/recipes.jsonl"
: >"$lines"
recipes=("bf16" "experts_fp8" "experts_dense_fp8")
declare -A sets=(
  [bf16]=""
  [experts_fp8]="model.expert_recipe=fp8_wgrad_with_hp"
  [experts_dense_fp8]="model.expert_recipe=fp8_wgrad_with_hp model.dense_recipe=fp8_wgrad_with_hp"
)
status=0
for round in $(seq "${ROUNDS:-2}"); do
  for recipe in "${recipes[@]}"; do
    line=$(BENCH_SET="train.steps=${STEPS:-20} ${BENCH_SET:-} ${sets[$recipe]}" OUT="$out" \
      scripts/bench-model.sh "$bin" "$layers" | tail -1)
    echo "$line"
    case $line in *'"error"'*) status=1 ;; esac
    python3 -c 'import json, sys; l = json.loads(sys.argv[1]); l.update(recipe=sys.argv[2], round=int(sys.argv[3])); print(json.dumps(l))' \
      "$line" "$recipe" "$round" >>"$lines" || status=1
  done
done
# The table on stderr: stdout stays JSON lines (scripts/gpu-check.sh collects them).
python3 - "$lines" >&2 <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
base = {r["round"]: r for r in rows if r["recipe"] == "bf16" and "error" not in r}
print(f"{'round':>5} {'recipe':<18} {'tokens/s':>10} {'vs bf16':>8} {'peak GiB':>9} {'final loss':>10}")
for r in rows:
    if "error" in r:
        print(f"{r['round']:>5} {r['recipe']:<18} error: {r['error']}")
        continue
    b = base.get(r["round"])
    ratio = f"{r['tokens_per_s_per_gpu'] / b['tokens_per_s_per_gpu']:.3f}x" if b else "-"
    print(f"{r['round']:>5} {r['recipe']:<18} {r['tokens_per_s_per_gpu']:>10} {ratio:>8} "
          f"{r['peak_gib']:>9} {r['final_loss']:>10}")
PY
exit $status
