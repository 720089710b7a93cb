#!/usr/bin/env bash
# The Hugging Face flow with Qwen3-30B-A3B's layer shapes (docs/benchmarks-history.md): a random HF
# checkpoint of the bench preset's 8 layers (scripts/make_random_hf_checkpoint.py, 11.2 GB bf16),
# imported, fine-tuned 20 SFT steps on random masked documents and exported on one GPU
# (`train --init-from ... --export-hf`); transformers loads the export and runs it; the same
# checkpoint imported by two CPU ranks with (W, ep) = (2, 2). Each import and export logs its time
# and the rank's peak host memory. Needs torch, transformers and safetensors (the GPU machine's).
# Usage: scripts/bench-hf.sh [moetrain binary] [work dir (about 25 GB free)]
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/moetrain}
W=${2:-/tmp/moetrain-hf}
out=${OUT:-$W/logs}
mkdir -p "$W" "$out"
python3 scripts/make_random_hf_checkpoint.py "$W/hf30" --layers 8 > "$out/make.log" 2>&1 || exit 1
python3 - "$W" <<'PY'
import random, sys
sys.path.insert(0, 'scripts')
from moetrain_tokens import TokenFileWriter
w_dir = sys.argv[1]
r = random.Random(0)
with TokenFileWriter(f'{w_dir}/sft.tok', loss_mask=True) as w:
    for d in range(300):  # prompts (the first quarter) masked
        n = r.randint(256, 4096); p = n // 4
        w.add([r.randrange(151936) for _ in range(n)], [0] * p + [1] * (n - p))
with TokenFileWriter(f'{w_dir}/tiny.tok', loss_mask=False) as w:
    w.add([r.randrange(151936) for _ in range(40)])
PY
rm -rf "$W/out"
"$bin" train --config configs/qwen3-30b-a3b-bench.toml --init-from "$W/hf30" \
  --set data.source=sft --set data.path="$W/sft.tok" --set train.steps=20 --export-hf "$W/out" \
  --metrics "$out/sft.jsonl" > "$out/sft.log" 2>&1 || { tail -3 "$out/sft.log"; exit 1; }
python3 - "$W" > "$out/verify.log" 2>&1 <<'PY'
import json, sys, time, torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM
w_dir = sys.argv[1]
t = time.time()
m = AutoModelForCausalLM.from_pretrained(f'{w_dir}/out', dtype=torch.bfloat16, device_map='cuda')
load = time.time() - t
ids = torch.randint(0, 151936, (1, 64), device='cuda', generator=torch.Generator('cuda').manual_seed(0))
with torch.no_grad():
    loss = float(m(input_ids=ids, labels=ids).loss)
moved = {}
for name in ['model.layers.0.mlp.experts.5.down_proj.weight', 'model.layers.7.self_attn.q_proj.weight',
             'model.layers.3.mlp.gate.weight', 'lm_head.weight']:
    tensors = []
    for d in (f'{w_dir}/hf30', f'{w_dir}/out'):
        shard = json.load(open(f'{d}/model.safetensors.index.json'))['weight_map'][name]
        with safe_open(f'{d}/{shard}', 'pt') as f:
            tensors.append(f.get_tensor(name).float())
    moved[name] = float((tensors[1] - tensors[0]).norm() / tensors[0].norm())
print(json.dumps({'class': type(m).__name__, 'load_s': round(load, 1), 'loss': loss,
                  'relative_change': moved}))
PY
"$bin" launch -n 2 -- eval --config configs/qwen3-30b-a3b-bench.toml --init-from "$W/hf30" \
  --data "$W/tiny.tok" --set hardware.device=cpu --set parallel.ep=2 --set train.seq_len=16 \
  --set train.batch_rows=1 > "$out/cpu2.log" 2>&1
grep -h "hf import\|hf export\|step    20" "$out/sft.log" "$out/cpu2.log"
tail -1 "$out/verify.log"
