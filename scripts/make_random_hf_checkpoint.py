#!/usr/bin/env python3
"""Writes a random Hugging Face Qwen3-MoE checkpoint with Qwen3-30B-A3B's layer shapes: what the
import benchmark (docs/benchmarks-history.md) loads. config.json as the published checkpoint has it
(transformers 4 keys), bf16 weights N(0, 0.02) (norms 1) in the published per-expert layout,
sharded at 5 GB with model.safetensors.index.json. Needs torch and safetensors (the GPU machine
has both; a GPU makes the random numbers faster).

    scripts/make_random_hf_checkpoint.py OUT_DIR [--layers 8] [--seed 0]
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file

SHAPE = dict(vocab_size=151936, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
             head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
             intermediate_size=6144)
SHARD_BYTES = 5 << 30


def tensors(layers):
    """(name, shape) of every tensor, in the published checkpoint's order."""
    d, v, f = SHAPE["hidden_size"], SHAPE["vocab_size"], SHAPE["moe_intermediate_size"]
    q = SHAPE["num_attention_heads"] * SHAPE["head_dim"]
    kv = SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    yield "model.embed_tokens.weight", (v, d)
    for l in range(layers):
        p = f"model.layers.{l}."
        yield p + "input_layernorm.weight", (d,)
        yield p + "post_attention_layernorm.weight", (d,)
        yield p + "self_attn.q_proj.weight", (q, d)
        yield p + "self_attn.k_proj.weight", (kv, d)
        yield p + "self_attn.v_proj.weight", (kv, d)
        yield p + "self_attn.o_proj.weight", (d, q)
        yield p + "self_attn.q_norm.weight", (SHAPE["head_dim"],)
        yield p + "self_attn.k_norm.weight", (SHAPE["head_dim"],)
        yield p + "mlp.gate.weight", (SHAPE["num_experts"], d)
        for e in range(SHAPE["num_experts"]):
            yield p + f"mlp.experts.{e}.gate_proj.weight", (f, d)
            yield p + f"mlp.experts.{e}.up_proj.weight", (f, d)
            yield p + f"mlp.experts.{e}.down_proj.weight", (d, f)
    yield "model.norm.weight", (d,)
    yield "lm_head.weight", (v, d)


def main():
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("out")
    a.add_argument("--layers", type=int, default=8)
    a.add_argument("--seed", type=int, default=0)
    args = a.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(args.seed)
    config = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                  num_hidden_layers=args.layers, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=40960,
                  decoder_sparse_step=1, mlp_only_layers=[], hidden_act="silu",
                  attention_bias=False, attention_dropout=0.0, use_sliding_window=False,
                  router_aux_loss_coef=0.001, initializer_range=0.02, torch_dtype="bfloat16",
                  **SHAPE)
    with open(os.path.join(args.out, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    shards, current, size = [], {}, 0
    for name, shape in tensors(args.layers):
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()
        nbytes = t.numel() * 2
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(args.out, fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * 2
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    print(json.dumps({"out": args.out, "layers": args.layers, "tensors": len(weight_map),
                      "bytes": total, "shards": len(shards)}))


if __name__ == "__main__":
    main()
