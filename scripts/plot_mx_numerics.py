#!/usr/bin/env python3
"""Draws the quantized recipes' numerics study's loss curves (scripts/mx-numerics.sh) into one PNG and prints
each recipe's final loss and its gap to bf16 (the mean of the last 100 steps, to smooth the
batch noise). Needs matplotlib.

    python3 scripts/plot_mx_numerics.py DIR docs/mx_numerics.png
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RUNS = ["bf16", "mxfp8", "mxfp8_wgrad_with_hp", "mxfp8_wgrad_with_hp__mxfp8_dispatch",
        "mxfp8__mxfp8_dispatch__requant_dim1", "fp8_blockwise", "fp8_wgrad_with_hp",
        "bf16__kv128", "fp8_wgrad_with_hp__dense_fp8__kv128"]
KV128 = "__kv128"  # the dense recipe's pair (wider key and value heads): gaps to its own bf16


def smooth(values, window=25):
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def main():
    src, png = sys.argv[1], sys.argv[2]
    curves = {}
    for name in RUNS:
        path = os.path.join(src, name + ".jsonl")
        if os.path.exists(path):
            rows = [json.loads(line) for line in open(path)]
            curves[name] = ([r["step"] for r in rows], [r["loss"] for r in rows])
    fig, (full, tail) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, (steps, loss) in curves.items():
        full.plot(steps, smooth(loss), label=name.replace("__", " + "), linewidth=1)
        tail.plot(steps, smooth(loss), label=name.replace("__", " + "), linewidth=1)
    full.set_yscale("log")
    full.set_title("loss (25-step mean)")
    last = max(len(s) for s, _ in curves.values())
    tail.set_xlim(last // 2, last)
    lows = [min(smooth(l)[len(l) // 2:]) for _, l in curves.values()]
    highs = [max(smooth(l)[len(l) // 2:]) for _, l in curves.values()]
    tail.set_ylim(min(lows) - 0.01, max(highs) + 0.01)
    tail.set_title("second half")
    for ax in (full, tail):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    tail.legend(fontsize=8)
    fig.suptitle("configs/mx-numerics.toml on one H200: expert GEMM recipes and MXFP8 dispatch")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    finals = {name: sum(loss[-100:]) / len(loss[-100:]) for name, (_, loss) in curves.items()}
    for name, final in finals.items():
        ref = "bf16" + KV128 if name.endswith(KV128) else "bf16"
        base = finals.get(ref)
        gap = "" if base is None or name == ref else f"  gap to {ref} {final - base:+.4f} ({(final - base) / base * 100:+.2f}%)"
        print(f"{name:40s} final loss (mean of last 100) {final:.4f}{gap}")


if __name__ == "__main__":
    main()
