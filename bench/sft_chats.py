#!/usr/bin/env python3
"""Chat samples of real-looking lengths for the packing benchmark (scripts/bench-packing.sh), as
JSON lines for scripts/tokenize_data.py: a system line, a user turn and an assistant reply whose
total length is log-normal (median about 650 tokens of the test tokenizer, 90% under about 1800,
about 1% past one 4096-token row), as instruction-tuning sets such as UltraChat's and Tulu's are.

    bench/sft_chats.py OUT.jsonl COUNT [SEED]
"""
import json, math, random, sys
random.seed(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
words = ["the", "model", "routes", "each", "token", "to", "experts", "while", "attention", "reads",
         "documents", "packed", "into", "rows", "gradient", "norm", "learning", "rate", "loss",
         "whole", "sample", "prompt", "answer", "question", "because", "training", "data"]
def text(chars):
    out = []
    n = 0
    while n < chars:
        w = random.choice(words)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)
with open(sys.argv[1], "w") as f:
    for i in range(int(sys.argv[2])):
        tokens = min(12000, max(40, int(random.lognormvariate(math.log(650), 0.85))))
        chars = int(tokens * 1.4)  # the fixture tokenizer: about 1.4 characters a token here
        prompt = max(20, int(chars * random.uniform(0.2, 0.6)))
        msgs = [{"role": "system", "content": "You are helpful."},
                {"role": "user", "content": text(prompt)},
                {"role": "assistant", "content": text(chars - prompt)}]
        f.write(json.dumps({"messages": msgs}) + "\n")
