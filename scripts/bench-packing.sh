#!/usr/bin/env bash
# Whole packing's cost on the 8-layer preset (configs/qwen3-30b-a3b-bench.toml): the same SFT file
# of chat-length samples trained with data.packing = "whole" and "stream" in one job; one JSON
# line each (bench-model.sh's, with real_tokens_per_s_per_gpu: tokens/s less the padding) and a
# last line with whole's real-token rate over stream's. The token file (bench/sft_chats.py's
# chats, tokenized by scripts/tokenize_data.py with the tests' tokenizer) is made when missing.
# Both runs train one epoch of the file (its tokens over the step's, and the two untimed steps),
# so they see the same documents; the ratio is of their real tokens over the time of the timed
# steps (bench-model.sh's real_tokens_per_s_per_gpu_overall), the median step's beside it.
# Usage: scripts/bench-packing.sh [moetrain binary] [token file]; BENCH_STEPS overrides the count.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/moetrain}
data=${2:-/tmp/moetrain-bench/sft_chats.tok}
out=${OUT:-/tmp/moetrain-bench}
mkdir -p "$out" "$(dirname "$data")"
if [ ! -f "$data" ]; then
  bench/sft_chats.py "$out/sft_chats.jsonl" 1500 >/dev/null &&
    scripts/tokenize_data.py --tokenizer tests/fixtures/tokenizer/chatml \
      --input "$out/sft_chats.jsonl" --output "$data" >/dev/null || exit 1
fi
tokens_per_step=$(python3 -c 'import re,sys; t=open(sys.argv[1]).read(); print(
  int(re.search(r"^batch_rows *= *(\d+)", t, re.M)[1]) * int(re.search(r"^seq_len *= *(\d+)", t, re.M)[1]))' \
  configs/qwen3-30b-a3b-bench.toml) || exit 1
epoch_steps=$(python3 -c 'import struct,sys; print(-(-struct.unpack_from("<Q", open(sys.argv[1], "rb").read(32), 24)[0] // int(sys.argv[2])))' \
  "$data" "$tokens_per_step") || exit 1
steps=${BENCH_STEPS:-$((epoch_steps + 2))}
for packing in whole stream; do
  BENCH_SET="data.source=sft data.path=$data data.packing=$packing train.steps=$steps ${BENCH_SET:-}" \
    scripts/bench-model.sh "$bin" | tee "$out/packing_$packing.json"
done
python3 - "$out/packing_whole.json" "$out/packing_stream.json" <<'PY'
import json, sys
whole, stream = (json.loads(open(p).read().splitlines()[-1]) for p in sys.argv[1:3])
if "error" in whole or "error" in stream:
    print(json.dumps({"bench": "packing", "error": whole.get("error") or stream.get("error")}))
    sys.exit(1)
print(json.dumps({"bench": "packing", "preset": whole["preset"], "layers": whole["layers"],
                  "whole_pad_fraction": whole["pad_fraction"],
                  "steps_timed": whole["steps_timed"],
                  "whole_real_tokens_per_s": whole["real_tokens_per_s_per_gpu_overall"],
                  "stream_real_tokens_per_s": stream["real_tokens_per_s_per_gpu_overall"],
                  "whole_over_stream": round(whole["real_tokens_per_s_per_gpu_overall"]
                                             / stream["real_tokens_per_s_per_gpu_overall"], 4),
                  "median_step_whole_over_stream": round(whole["real_tokens_per_s_per_gpu"]
                                                         / stream["real_tokens_per_s_per_gpu"], 4)}))
PY
