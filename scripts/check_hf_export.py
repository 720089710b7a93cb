#!/usr/bin/env python3
"""Loads a directory `moetrain export-hf` wrote in transformers and runs the batch of a fixture
(scripts/make_hf_fixture.py's reference.safetensors): the loss and logits must be transformers'
own on the model the export came from. Prints one JSON line; exit 1 when they differ.

Run where transformers is installed:
    python3 scripts/check_hf_export.py EXPORT_DIR tests/fixtures/hf_qwen3moe/base
"""
import json
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main():
    export_dir, fixture = sys.argv[1], sys.argv[2]
    ref = load_file(fixture + "/reference.safetensors")
    model = AutoModelForCausalLM.from_pretrained(export_dir, torch_dtype=torch.float32)
    model.config._attn_implementation = "eager"
    tokens = ref["tokens"].unsqueeze(0)
    with torch.no_grad():
        out = model(input_ids=tokens, labels=tokens)
    loss_err = abs(float(out.loss) - float(ref["loss"])) / float(ref["loss"])
    logits_err = float((out.logits[0] - ref["logits"]).norm() / ref["logits"].norm())
    ok = loss_err < 1e-5 and logits_err < 1e-5
    print(json.dumps({"export": export_dir, "class": type(model).__name__,
                      "loss": float(out.loss), "reference_loss": float(ref["loss"]),
                      "loss_rel_err": loss_err, "logits_rel_err": logits_err, "ok": ok}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
