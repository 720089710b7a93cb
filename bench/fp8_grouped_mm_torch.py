"""Comparator for bench/bench_fp8_gemm.cpp: torch._scaled_grouped_mm (row-wise FP8 scales: what
torchao's float8 MoE training runs on Hopper) and torch._grouped_mm (bf16) at the balanced shapes
of the expert layer's four row products (128 experts x 1024 rows), timed with CUDA events (median
of 20 after 5 warm-up runs). One JSON line per product and dtype."""
import json

import torch

from cuda_timing import median_ms

experts, rows = 128, 1024
m = experts * rows
offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * rows
products = [("gate_up_forward", 2048, 1536), ("down_forward", 768, 2048),
            ("down_input_gradient", 2048, 768), ("gate_up_input_gradient", 1536, 2048)]
for name, k, n in products:
    a = (torch.rand(m, k, device="cuda") * 2 - 1).to(torch.bfloat16)
    b = ((torch.rand(experts, n, k, device="cuda") * 2 - 1) * 0.05).to(torch.bfloat16)
    flops = 2 * m * k * n
    shape = f"balanced {m} rows, Q {k}, P {n}"
    ms = median_ms(lambda: torch._grouped_mm(a, b.transpose(-2, -1), offs=offs), warmup=5, reps=20)
    print(json.dumps({"bench": f"torch_grouped_mm_{name}", "shape": shape + " bf16",
                      "ms": round(ms, 4), "tflops": round(flops / (ms * 1e-3) / 1e12, 1),
                      "torch": torch.__version__}), flush=True)
    fmax = torch.finfo(torch.float8_e4m3fn).max
    sa = a.float().abs().amax(dim=1).clamp(min=1e-12) / fmax
    sb = b.float().abs().amax(dim=2).clamp(min=1e-12) / fmax  # (E, N)
    aq = (a.float() / sa[:, None]).to(torch.float8_e4m3fn)
    bq = (b.float() / sb[:, :, None]).to(torch.float8_e4m3fn)  # (E, N, K) row-major
    try:
        run = lambda: torch._scaled_grouped_mm(aq, bq.transpose(-2, -1), sa, sb, offs=offs,
                                               out_dtype=torch.bfloat16, use_fast_accum=True)
        ms = median_ms(run, warmup=5, reps=20)
        print(json.dumps({"bench": f"torch_scaled_grouped_mm_{name}", "shape": shape + " fp8 rowwise",
                          "ms": round(ms, 4), "tflops": round(flops / (ms * 1e-3) / 1e12, 1),
                          "torch": torch.__version__}), flush=True)
    except Exception as e:  # noqa: BLE001 - report what torch refuses
        print(json.dumps({"bench": f"torch_scaled_grouped_mm_{name}", "error": str(e)[:200]}),
              flush=True)
