#!/usr/bin/env python3
"""Reference vectors from transformers' Qwen3MoeForCausalLM for moetrain's Hugging Face import.

Writes tests/fixtures/hf_qwen3moe/<case>/: the directory save_pretrained makes (config.json,
model.safetensors) and reference.safetensors with one token batch ("tokens", i64 (T,)), the fp32
logits at every position ("logits", (T, V)), the mean next-token loss ("loss", (1,)) and every
parameter's gradient of that loss ("grad.<transformers name>", as the module holds it). Small
random models, not default shapes: head_dim differs from hidden / heads; cases for
norm_topk_prob false, tied embeddings, and the experts saved merged (transformers 5's in-memory
gate_up_proj [E, 2F, D] / down_proj [E, D, F]) instead of per expert. The load-balancing loss is
left out there (output_router_logits off).

reference_aux.safetensors holds the same batch with transformers' load-balancing loss on
(output_router_logits, router_aux_loss_coef = AUX_COEF): "loss" (cross-entropy + coef x aux),
"aux_loss" (transformers' load_balancing_loss_func over all layers at once) and every gradient;
moetrain's model.aux_loss_form = "transformers" must match it. `--aux-only` adds these to
existing fixtures (loading the saved models) without touching the other files.

Run where transformers is installed (the GPU machine has 5.17 with torch 2.11; CPU is enough):
    python3 scripts/make_hf_fixture.py tests/fixtures/hf_qwen3moe [--aux-only]
"""
import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

CASES = {
    "base": dict(norm_topk_prob=True, tie_word_embeddings=False, merged=False),
    "no_norm_topk": dict(norm_topk_prob=False, tie_word_embeddings=False, merged=False),
    "tied": dict(norm_topk_prob=True, tie_word_embeddings=True, merged=False),
    "merged": dict(norm_topk_prob=True, tie_word_embeddings=False, merged=True),
}


def make(case, out, seed):
    opts = CASES[case]
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
        num_experts=8, num_experts_per_tok=3, norm_topk_prob=opts["norm_topk_prob"],
        tie_word_embeddings=opts["tie_word_embeddings"], rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=256, initializer_range=0.2,
        output_router_logits=False, decoder_sparse_step=1, mlp_only_layers=[],
        use_sliding_window=False, attention_dropout=0.0)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    # Norm weights away from 1, so that a swapped or missing norm shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    os.makedirs(out, exist_ok=True)
    if opts["merged"]:
        config.save_pretrained(out)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()
                   if not (config.tie_word_embeddings and k == "lm_head.weight")},
                  os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    else:
        model.save_pretrained(out, safe_serialization=True)

    tokens = torch.randint(0, config.vocab_size, (1, 20))
    out_fw = model(input_ids=tokens, labels=tokens)
    out_fw.loss.backward()
    ref = {"tokens": tokens[0].to(torch.int64), "logits": out_fw.logits[0].detach().float(),
           "loss": out_fw.loss.detach().float().reshape(1)}
    for name, p in model.named_parameters():
        ref["grad." + name] = p.grad.detach().float().contiguous()
    save_file(ref, os.path.join(out, "reference.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__,
                        "case": case})
    names = sorted(k for k in ref if k.startswith("grad."))
    print(json.dumps({"case": case, "loss": float(out_fw.loss), "grads": len(names),
                      "files": sorted(os.listdir(out))}))


AUX_COEF = 0.05


def make_aux(case, out):
    """reference_aux.safetensors for the saved model of `case` and its reference batch."""
    from safetensors.torch import load_file
    model = Qwen3MoeForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    model.config._attn_implementation = "eager"
    model.config.output_router_logits = True
    model.router_aux_loss_coef = AUX_COEF
    model.config.router_aux_loss_coef = AUX_COEF
    tokens = load_file(os.path.join(out, "reference.safetensors"))["tokens"].reshape(1, -1)
    out_fw = model(input_ids=tokens, labels=tokens, output_router_logits=True)
    assert out_fw.aux_loss is not None, "transformers computed no aux loss"
    out_fw.loss.backward()
    ref = {"loss": out_fw.loss.detach().float().reshape(1),
           "aux_loss": out_fw.aux_loss.detach().float().reshape(1),
           "aux_coef": torch.tensor([AUX_COEF], dtype=torch.float32)}
    for name, p in model.named_parameters():
        ref["grad." + name] = p.grad.detach().float().contiguous()
    save_file(ref, os.path.join(out, "reference_aux.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__,
                        "case": case})
    print(json.dumps({"case": case, "aux": True, "loss": float(out_fw.loss),
                      "aux_loss": float(out_fw.aux_loss)}))


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/hf_qwen3moe"
    aux_only = "--aux-only" in sys.argv
    for i, case in enumerate(CASES):
        if not aux_only:
            make(case, os.path.join(root, case), 1234 + i)
        make_aux(case, os.path.join(root, case))


if __name__ == "__main__":
    main()
