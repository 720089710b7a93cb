"""Comparator for bench/bench_gemm.cpp: torch._grouped_mm at the same balanced shape, forward,
timed with CUDA events (median of 20 after 5 warm-up runs). One JSON line."""
import json

import torch

from cuda_timing import median_ms

experts, rows, k, n = 128, 1024, 2048, 1536
m = experts * rows
x = (torch.rand(m, k, device="cuda") * 2 - 1).to(torch.bfloat16)
w = ((torch.rand(experts, k, n, device="cuda") * 2 - 1) * 0.05).to(torch.bfloat16)
offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * rows


def run():
    return torch._grouped_mm(x, w, offs=offs)


ms = median_ms(run, warmup=5, reps=20)
print(json.dumps({"bench": "torch_grouped_mm", "shape": f"{m}x{k} @ {experts}x{k}x{n} bf16 balanced",
                  "ms": round(ms, 4), "tflops": round(2 * m * k * n / (ms * 1e-3) / 1e12, 1),
                  "torch": torch.__version__}))
