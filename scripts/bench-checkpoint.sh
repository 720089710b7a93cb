#!/usr/bin/env bash
# Checkpoint cost on one GPU: the bench preset at 4 layers (its fp32 weights and AdamW moments,
# about 37 GB), one checkpoint written blocking (at step 8) and then asynchronously
# (checkpoint.async, at the step after as many as it leaves for the write, so that the interval
# brings no second save), and the disk's own write rate (dd, 8 GiB, direct). The disk holds one such
# checkpoint, not two, so each run ends by the tests' fault hook (MOETRAIN_FAULT_EXIT, exit 17)
# after its last step, before the final save, and its checkpoint is removed before the next run.
# One JSON line per mode: the median step time of quiet steps (from 3 to the save's, and those
# after the write), of the steps while the asynchronous write runs, their ratio, the training
# thread's stall at the save (async: allocating and page-locking staging, a first save's, then
# the copy into it, and its rate), the write's time and rate, and dd's.
# Usage: scripts/bench-checkpoint.sh [moetrain binary] [checkpoint dir]; BENCH_LAYERS (default 4),
# BENCH_AFTER (steps after the save, default 200 async, 6 blocking).
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/moetrain}
dir=${2:-/tmp/moetrain-ckpt-bench}
out=${OUT:-/tmp/moetrain-bench}
layers=${BENCH_LAYERS:-4}
config=${BENCH_CONFIG:-configs/qwen3-30b-a3b-bench.toml}
mkdir -p "$out"
rm -rf "$dir" && mkdir -p "$dir"
df -h "$dir" >"$out/df.log" 2>&1
dd if=/dev/zero of="$dir/dd.bin" bs=64M count=128 oflag=direct conv=fsync 2>"$out/dd.log"
rate=$(grep -oE '[0-9.]+ [GM]B/s' "$out/dd.log" | tail -1)
rm -f "$dir/dd.bin"
for mode in false true; do
  after=${BENCH_AFTER:-$([ "$mode" = true ] && echo 200 || echo 6)}
  save_at=$([ "$mode" = true ] && echo $((after + 8)) || echo 8)
  last=$((save_at + after))
  rm -rf "$dir/ckpt" "$out/ckpt_$mode.jsonl"
  MOETRAIN_FAULT_EXIT="0:$last" "$bin" train --config "$config" \
    --set "model.n_layers=$layers" --set "train.steps=$((last + 1))" \
    --set "checkpoint.every=$save_at" --set "checkpoint.dir=$dir/ckpt" \
    --set "checkpoint.async=$mode" --metrics "$out/ckpt_$mode.jsonl" >"$out/ckpt_$mode.log" 2>&1
  rc=$?
  if [ "$rc" -ne 17 ]; then
    echo "{\"bench\":\"checkpoint\",\"async\":$mode,\"error\":\"exit $rc: $(tail -1 "$out/ckpt_$mode.log" | tr -d '"\\')\"}"
    continue
  fi
  python3 - "$out/ckpt_$mode.jsonl" "$mode" "$layers" "$rate" "$dir/ckpt" "$out/ckpt_$mode.log" "$save_at" <<'PY'
import json, os, re, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
is_async, save_at = sys.argv[2] == "true", int(sys.argv[7])
step_s = {r["step"]: 16384 / r["tokens_per_s"] for r in rows}
stall = next(r["checkpoint_stall_s"] for r in rows if r["step"] == save_at)
size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(sys.argv[5]) for f in fs)
line = {"bench": "checkpoint", "layers": int(sys.argv[3]), "async": is_async,
        "checkpoint_gib": round(size / 2**30, 2), "stall_s": round(stall, 2),
        "disk_write_rate_dd": sys.argv[4]}
quiet = [step_s[s] for s in range(3, save_at)]
if is_async:
    m = re.search(r"written in the background: ([0-9.]+) GiB \(rank 0's\) in ([0-9.]+) s",
                  open(sys.argv[6]).read())
    if not m:
        print(json.dumps({**line, "error": "the write did not finish before the last step"}))
        sys.exit(0)
    write_s = float(m[2])
    prep = re.search(r"([0-9.]+) s of it preparing staging", open(sys.argv[6]).read())
    prepare_s = float(prep[1]) if prep else 0.0
    # The steps that ran while the write did (each step's start within write_s of the save).
    during, t = [], 0.0
    for s in range(save_at + 1, max(step_s) + 1):
        (during if t < write_s else quiet).append(step_s[s])
        t += step_s[s]
    line.update({"staging_prepare_s": prepare_s,
                 "copy_to_pinned_gib_per_s": round(size / 2**30 / max(stall - prepare_s, 1e-9), 2),
                 "write_s": write_s, "write_gib_per_s": round(float(m[1]) / write_s, 2),
                 "steps_during_write": len(during),
                 "step_s_during_write": round(statistics.median(during), 4)})
else:
    line["write_gib_per_s"] = round(size / 2**30 / stall, 2)
line["step_s_quiet"] = round(statistics.median(quiet), 4)
if is_async:
    line["during_over_quiet"] = round(line["step_s_during_write"] / line["step_s_quiet"], 4)
else:
    line["stall_over_step"] = round(stall / line["step_s_quiet"], 1)
print(json.dumps(line))
PY
  rm -rf "$dir/ckpt"
done
