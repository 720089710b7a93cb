#!/usr/bin/env python3
"""Training curves from moetrain metrics files (train --metrics RUN.jsonl), several runs overlaid.

    scripts/plot_metrics.py runs/a.jsonl runs/b.jsonl --out curves.png [--names a b]

Six panels against the step: loss (and eval_loss where evaluated), gradient norm, learning rate,
tokens/s, MFU, and the routing imbalance (the busiest expert's load over the mean, worst layer
solid, mean over layers dashed). A step written twice (a run resumed from an earlier checkpoint)
keeps its last line. Errors (a missing or empty file, a line that is not JSON) name the file and
line and exit with code 3. Needs matplotlib, which scripts/setup.sh installs (pinned) into
.deps/python; the script finds it there.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".deps", "python"))


def fail(message):
    print(f"plot_metrics: {message}", file=sys.stderr)
    sys.exit(3)


def read_run(path):
    """The run's steps in order, one dict per step (the last line written for it)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        fail(f"cannot read '{path}': {e.strerror}")
    steps = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            fail(f"{path}:{number}: not JSON ({e.msg})")
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            fail(f"{path}:{number}: a metrics line needs an integer \"step\"")
        steps[record["step"]] = record
    if not steps:
        fail(f"'{path}' holds no metrics lines")
    return [steps[s] for s in sorted(steps)]


def series(run, key, reduce=None):
    xs, ys = [], []
    for record in run:
        value = record.get(key)
        if isinstance(value, list):
            value = reduce(value) if value and reduce else None
        if isinstance(value, (int, float)):
            xs.append(record["step"])
            ys.append(value)
    return xs, ys


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="metrics files (JSON lines)")
    parser.add_argument("--out", required=True, help="the picture to write (.png, .svg, .pdf)")
    parser.add_argument("--names", nargs="+", help="one name per run (default: the file names)")
    parser.add_argument("--title", default="", help="a title over the panels")
    args = parser.parse_args()
    if args.names and len(args.names) != len(args.runs):
        print(f"plot_metrics: --names gives {len(args.names)} names for {len(args.runs)} runs",
              file=sys.stderr)
        sys.exit(2)
    names = args.names or [os.path.splitext(os.path.basename(p))[0] for p in args.runs]
    runs = [read_run(p) for p in args.runs]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    panels = [
        ("loss", "loss (nats/token)", False),
        ("grad_norm", "gradient norm (before clipping)", True),
        ("lr", "learning rate", False),
        ("tokens_per_s", "tokens/s", False),
        ("mfu", "MFU", False),
        ("expert_load_max_over_mean", "busiest expert's load / mean", False),
    ]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, label, log) in zip(axes.flat, panels):
        for i, (name, run) in enumerate(zip(names, runs)):
            color = colors[i % len(colors)]
            if key == "expert_load_max_over_mean":
                ax.plot(*series(run, key, max), color=color, label=f"{name} (worst layer)")
                ax.plot(*series(run, key, lambda v: sum(v) / len(v)), color=color, ls="--",
                        label=f"{name} (mean of layers)")
                continue
            ax.plot(*series(run, key), color=color, label=name)
            if key == "loss":
                xs, ys = series(run, "eval_loss")
                if xs:
                    ax.plot(xs, ys, color=color, marker="o", ls=":", label=f"{name} eval")
                floor = run[0].get("loss_floor")  # the synthetic languages' known floor
                if isinstance(floor, (int, float)):
                    ax.axhline(floor, color=color, ls=":", lw=1, label=f"{name} data floor")
        ax.set_title(label)
        ax.set_xlabel("step")
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if args.title:
        fig.suptitle(args.title)
    try:
        fig.savefig(args.out, dpi=110)
    except OSError as e:
        fail(f"cannot write '{args.out}': {e.strerror}")
    print(f"plot_metrics: wrote {args.out} ({len(runs)} runs)")


if __name__ == "__main__":
    main()
