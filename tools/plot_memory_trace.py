#!/usr/bin/env python3
"""Renders an fsdp::MemoryTracer trace (fsdp-train --memory-trace FILE, or
fsdp::dump_memory_stats) as a stacked area chart of bytes by category, one point
per sample in time order, with optimizer steps marked.

    tools/plot_memory_trace.py memory.jsonl memory.png [--rank R]

Needs matplotlib (scripts/bootstrap.sh installs it into .venv: run it with .venv/bin/python).
"""
import argparse
import json
import sys

CATEGORIES = ["parameter_shards", "unsharded_parameters", "gradients", "master_weights", "optimizer_state", "other"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("png")
    ap.add_argument("--rank", type=int, default=None, help="only this rank's samples (default: the first rank seen)")
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_memory_trace.py: matplotlib is not installed; on Debian: apt-get install python3-matplotlib "
                 "(scripts/bootstrap.sh installs it)")
    samples = []
    with open(args.trace) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                samples.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"plot_memory_trace.py: {args.trace}:{n}: not a JSON line ({e})")
    if not samples:
        sys.exit(f"plot_memory_trace.py: {args.trace} holds no samples")
    rank = args.rank if args.rank is not None else samples[0].get("rank", 0)
    samples = [s for s in samples if s.get("rank", 0) == rank]
    xs = list(range(len(samples)))
    mib = [[s["bytes"].get(c, 0) / 2**20 for s in samples] for c in CATEGORIES]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.stackplot(xs, mib, labels=[c.replace("_", " ") for c in CATEGORIES])
    for x, s in zip(xs, samples):
        if s["phase"] == "optimizer_step":
            ax.axvline(x, color="k", linewidth=0.5, alpha=0.4)
    ax.set_xlabel("sample (unit boundaries in time order; vertical lines: optimizer steps)")
    ax.set_ylabel("MiB")
    ax.set_title(f"memory by category, rank {rank}")
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(args.png, dpi=100)
    print(f"plot_memory_trace.py: wrote {args.png} ({len(samples)} samples of rank {rank})")


if __name__ == "__main__":
    main()
