"""Comparator for bench/bench_attention.cpp: PyTorch SDPA (cuDNN and flash backends) at the same
shape, 8 documents of 2048 tokens as a (8, 32, 2048, 128) causal batch with 4 kv heads (GQA),
bf16, forward and forward + backward, CUDA-event medians. JSON lines in the C++ bench's schema."""
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuda_timing import median_ms

docs, length, h, kv, d = 8, 2048, 32, 4, 128
torch.manual_seed(0)
q = torch.randn(docs, h, length, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(docs, kv, length, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(docs, kv, length, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dout = torch.randn(docs, h, length, d, device="cuda", dtype=torch.bfloat16)
fwd_flops = 2.0 * length * length * d * h * docs


def attend():
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


for name, backend in (("torch_cudnn", SDPBackend.CUDNN_ATTENTION),
                      ("torch_flash", SDPBackend.FLASH_ATTENTION)):
    with sdpa_kernel(backend):
        for pass_, fn, flops in (("fwd", attend, fwd_flops),
                                 ("fwd+bwd", lambda: attend().backward(dout), 3.5 * fwd_flops)):
            ms = median_ms(fn)
            print(json.dumps({"bench": "attention", "impl": name, "pass": pass_,
                              "packing": "8x2048", "documents": docs, "longest": length,
                              "tokens": docs * length, "heads": h, "kv_heads": kv,
                              "head_dim": d, "ms": round(ms, 4),
                              "tflops": round(flops / (ms * 1e-3) / 1e12, 1)}), flush=True)
