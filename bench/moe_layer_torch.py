"""Comparator for bench/bench_moe_layer.cpp: the same MoE layer in PyTorch (router, softmax top-k
with renormalisation, sort by expert, torch._grouped_mm gate|up, SwiGLU, down, weighted sum),
forward + backward, eager, torch.compile, and torch.compile with CUDA graphs, bf16, CUDA-event
medians. JSON lines."""
import json

import torch
import torch.nn.functional as F

from cuda_timing import median_ms

n, d, f, e, k = 16384, 2048, 768, 128, 8
torch.manual_seed(0)
router = (torch.randn(d, e, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
w_gate_up = (torch.randn(e, d, 2 * f, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
w_down = (torch.randn(e, f, d, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dout = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)


def moe(x):
    scores = F.softmax((x @ router).float(), dim=-1)
    weight, idx = torch.topk(scores, k, dim=-1)
    weight = weight / weight.sum(-1, keepdim=True)
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)
    # Not torch.bincount: on CUDA it reads the largest id back to size its output (a host sync,
    # which also keeps a CUDA graph from capturing the layer).
    counts = torch.zeros(e, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[order // k]
    h = torch._grouped_mm(xs, w_gate_up, offs=offs)
    a = F.silu(h[:, :f]) * h[:, f:]
    y = torch._grouped_mm(a, w_down, offs=offs)
    out = torch.zeros_like(x)
    out.index_add_(0, order // k, y * weight.flatten()[order, None].to(y.dtype))
    return out


def step(fn):
    out = fn(x)
    out.backward(dout)


# "compile_cudagraphs": torch.compile's reduce-overhead mode, forward and backward replayed as
# CUDA graphs (as bench_moe_layer's `ms`, the layer as moetrain's trainer runs it).
for name, fn in [("eager", moe), ("compile", torch.compile(moe)),
                 ("compile_cudagraphs", torch.compile(moe, mode="reduce-overhead"))]:
    try:
        ms = median_ms(lambda: step(fn))
        print(json.dumps({"bench": "torch_moe_layer_fwd_bwd", "mode": name, "ms": round(ms, 3),
                          "routing": "real", "torch": torch.__version__}), flush=True)
    except Exception as exc:  # report, do not hide
        print(json.dumps({"bench": "torch_moe_layer_fwd_bwd", "mode": name,
                          "error": str(exc)[:300]}), flush=True)
