#!/usr/bin/env python3
"""Writes tests/fixtures/mx_torchao.safetensors: MX (E4M3, 32-element blocks) quantizations made
by torchao's own `to_mx` and `to_dtype`, the vectors moetrain's ops/mx.h is tested against.

Needs torch and torchao 0.18.0 (run on the GPU machine, where torch is installed, with torchao's
wheel carried along); the computation runs on the CPU, torchao's reference path (on sm_90 its
CUDA path is the same PyTorch code).

    python3 scripts/make_mx_fixture.py tests/fixtures/mx_torchao.safetensors

Tensors (every byte tensor saved as uint8):
  x.<in>                    the input, (128, 128), in = bf16 | f32; the same values, f32 with a
                            few extra f32-only cases (mantissas that bf16 cannot hold)
  <in>.<rule>.dim0.data     to_mx(x)           rule = floor | rceil       (128, 128)
  <in>.<rule>.dim0.scales                                                  (128, 4)
  <in>.<rule>.dim0.dequant  to_dtype(...) in the input's dtype
  x.<in>.t                  x.t(): the dim1 input, whose columns are x's rows
  <in>.<rule>.dim1.data     x.t() quantized down its columns, stored transposed: to_mx(x)
  <in>.<rule>.dim1.scales                                                  (128, 4)
  <in>.<rule>.dim1.dequant  the dequantized x.t(), in x.t()'s layout
Each row of x holds four 32-value blocks drawn from the cases below: dim0 meets them along
x's rows, dim1 down x.t()'s columns.
"""
import sys

import numpy as np
import torch
import torchao
from safetensors.torch import save_file
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

BLOCK = 32
ROWS, COLS = 128, 128


def special_blocks(rng):
    """32-value blocks covering each rule's edges; (values, f32_only)."""
    b = []

    def add(v, f32_only=False):
        v = np.asarray(v, dtype=np.float64)
        assert v.shape == (BLOCK,)
        b.append((v, f32_only))

    def normal(scale):
        return rng.standard_normal(BLOCK) * scale

    add(np.zeros(BLOCK))                                   # zero block
    add(-np.zeros(BLOCK))                                  # negative zeros
    for k in (-130, -126, -122, -119, -118, -100, -20, -9, -1, 0, 1, 8, 9, 20, 60, 100, 120, 126):
        add(normal(2.0**k))                                # magnitudes over the exponent range
    add(np.sign(rng.standard_normal(BLOCK)) * 2.0 ** -np.arange(BLOCK))  # subnormal results
    add(np.sign(rng.standard_normal(BLOCK)) * 1000.0 * 2.0 ** -np.arange(BLOCK) * 0.37)
    for m in (1.0, 1.5, 1.75, 1.875, 1.9921875):          # FLOOR: 1.75 * 2^k fits, above saturates
        for k in (-3, 0, 5):
            v = normal(2.0**k)
            v = np.clip(v, -m * 2.0**k, m * 2.0**k)
            v[rng.integers(BLOCK)] = -m * 2.0**k
            add(v)
    for k in (-6, 0, 7):                                   # RCEIL: amax = 448 * 2^k exactly
        v = np.clip(normal(448.0 * 2.0**k / 2), -448.0 * 2.0**k, 448.0 * 2.0**k)
        v[3] = 448.0 * 2.0**k
        add(v)
    ties = np.array([256.0, 1.0625, 1.1875, 1.3125, -1.0625, 0.0087890625, 0.0029296875,
                     17.0, 19.0, 3.0625])                   # halfway cases at scale 1 (FLOOR)
    add(np.concatenate([ties, rng.standard_normal(BLOCK - len(ties))]))
    v = normal(1.0); v[5] = np.nan; add(v)                 # NaN
    v = normal(1.0); v[7] = np.inf; add(v)                 # infinities
    v = normal(1.0); v[7] = -np.inf; add(v)
    v = normal(1.0); v[2] = np.inf; v[9] = np.nan; add(v)
    v = normal(3e38 / 4); v[0] = 3.38e38; add(v)           # near the largest bf16 / f32
    # f32-only: descale = amax / 448 a few ulps above or below a power of two
    for k in (-10, 0, 4, 11, 40):
        for ulps in (-1, 1, 3):
            amax = np.float32(448.0 * 2.0**k) + np.float32(ulps) * np.spacing(np.float32(448.0 * 2.0**k))
            v = np.clip(normal(float(amax) / 3), -float(amax), float(amax))
            v[11] = float(amax)
            add(v, f32_only=True)
    return b


def build_inputs():
    rng = np.random.default_rng(20261130)
    blocks = special_blocks(rng)
    n_blocks = ROWS * COLS // BLOCK
    assert len(blocks) <= n_blocks
    x32 = np.empty((n_blocks, BLOCK), dtype=np.float64)
    f32_only = np.zeros(n_blocks, dtype=bool)
    for i in range(n_blocks):
        if i < len(blocks):
            x32[i], f32_only[i] = blocks[i]
        else:  # random blocks with a random scale
            x32[i] = rng.standard_normal(BLOCK) * 2.0 ** rng.integers(-30, 30)
    order = rng.permutation(n_blocks)  # spread the cases over rows and columns
    x32, f32_only = x32[order], f32_only[order]
    x_f32 = torch.from_numpy(x32.astype(np.float32)).reshape(ROWS, COLS)
    x_bf16 = x_f32.to(torch.bfloat16)
    # bf16's copy of the f32-only blocks is still a valid input; keep it.
    return {"bf16": x_bf16, "f32": x_f32}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/mx_torchao.safetensors"
    tensors = {}
    rules = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}
    for name, x in build_inputs().items():
        tensors[f"x.{name}"] = x.contiguous()
        for rule_name, rule in rules.items():
            for axis in ("dim0", "dim1"):
                src = x if axis == "dim0" else x.t().contiguous()
                # dim1 of an input y quantizes y.t() along rows; our fixture's dim1 input is x.t(),
                # so its quantized (transposed) layout is to_mx(x).
                y = src if axis == "dim0" else src.t().contiguous()
                scale, data = to_mx(y, torch.float8_e4m3fn, BLOCK, rule)
                deq = to_dtype(data, scale, torch.float8_e4m3fn, BLOCK, x.dtype)
                if axis == "dim1":
                    deq = deq.t()
                key = f"{name}.{rule_name}.{axis}"
                tensors[f"{key}.data"] = data.view(torch.uint8).contiguous()
                tensors[f"{key}.scales"] = scale.view(torch.uint8).contiguous()
                tensors[f"{key}.dequant"] = deq.contiguous()
        tensors[f"x.{name}.t"] = x.t().contiguous()
    meta = {"torch": torch.__version__, "torchao": torchao.__version__,
            "script": "scripts/make_mx_fixture.py"}
    save_file(tensors, out, metadata=meta)
    print(f"wrote {out}: {len(tensors)} tensors, torch {torch.__version__}, torchao {torchao.__version__}")


if __name__ == "__main__":
    main()
