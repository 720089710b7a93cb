#!/usr/bin/env bash
# Checkpoint cost on one GPU: the bench preset at 4 layers (its fp32 weights and AdamW moments,
# about 37 GB, fit the GPU machine's disk), a checkpoint every 4 steps, written blocking and then
# asynchronously (checkpoint.async), and the disk's own write rate (dd, 8 GiB). One JSON line
# each: the median step time of steps without a checkpoint, of the steps while an asynchronous
# one is being written (the 3 after it), the training thread's stall per save, and the write rate.
# Usage: scripts/bench-checkpoint.sh [moetrain binary] [checkpoint dir]; BENCH_LAYERS (default 4).
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/moetrain}
dir=${2:-/tmp/moetrain-ckpt-bench}
out=${OUT:-/tmp/moetrain-bench}
layers=${BENCH_LAYERS:-4}
mkdir -p "$out"
rm -rf "$dir" && mkdir -p "$dir"
dd if=/dev/zero of="$dir/dd.bin" bs=64M count=128 oflag=direct conv=fsync 2>"$out/dd.log"
rate=$(grep -oE '[0-9.]+ [GM]B/s' "$out/dd.log" | tail -1)
rm -f "$dir/dd.bin"
for mode in false true; do
  rm -rf "$dir/ckpt" "$out/ckpt_$mode.jsonl"
  "$bin" train --config configs/qwen3-30b-a3b-bench.toml --set "model.n_layers=$layers" \
    --set train.steps=16 --set checkpoint.every=4 --set checkpoint.keep=1 \
    --set "checkpoint.dir=$dir/ckpt" --set "checkpoint.async=$mode" \
    --metrics "$out/ckpt_$mode.jsonl" >"$out/ckpt_$mode.log" 2>&1 ||
    { echo "{\"bench\":\"checkpoint\",\"async\":$mode,\"error\":\"$(tail -1 "$out/ckpt_$mode.log" | tr -d '"\\')\"}"; continue; }
  python3 - "$out/ckpt_$mode.jsonl" "$mode" "$layers" "$rate" "$dir/ckpt" <<'PY'
import json, os, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
saves = [r["step"] for r in rows if "checkpoint_stall_s" in r]
step_s = {r["step"]: 16384 / r["tokens_per_s"] for r in rows}
after = {s + k for s in saves for k in (1, 2, 3)}
quiet = [t for s, t in step_s.items() if s > 2 and s not in after and s not in saves]
during = [t for s, t in step_s.items() if s in after]
size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(sys.argv[5]) for f in fs)
print(json.dumps({"bench": "checkpoint", "layers": int(sys.argv[3]), "async": sys.argv[2] == "true",
                  "checkpoint_gib": round(size / 2**30, 1),
                  "step_s_quiet": round(statistics.median(quiet), 4),
                  "step_s_after_save": round(statistics.median(during), 4),
                  "ratio_after_over_quiet": round(statistics.median(during) / statistics.median(quiet), 4),
                  "stall_s_per_save": round(statistics.median(r["checkpoint_stall_s"] for r in rows
                                                              if "checkpoint_stall_s" in r), 2),
                  "disk_write_rate": sys.argv[4]}))
PY
done
