#!/usr/bin/env python3
"""Summary of the one-GPU GPT benchmark for scripts/gpu_bench.sh (GPU_BENCH_GPT=1).

Reads bench.jsonl (the JSON lines of bench_gpu_gpt and bench/fsdp2_gpt.py), prints a line per
mode (step time, tokens/s, peak memory, FSDP's collectives per step) and per target, and appends
the targets that need both programs' lines to bench.jsonl: full_shard_vs_python_fsdp2 (tokens/s of
the C++ FULL_SHARD over FSDP2's, goal >= 1.0; also each against its own process's plain baseline),
plain_vs_python_plain (the two baselines, which should agree) and, when its offload part ran,
offload_vs_python_fsdp2_offload (CPU offload: FULL_SHARD_OFFLOAD over FSDP2 with CPUOffloadPolicy,
goal >= 3.0) and offload_auto_vs_offload (placement auto over all on the host; no goal).

  python3 scripts/gpu_bench_gpt_summary.py RESULTS/bench.jsonl
"""
import json
import sys


def main(path):
    rows, extra = {}, []
    with open(path) as f:
        lines = f.readlines()
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("bench") not in ("gpu_gpt", "fsdp2_gpt"):
            continue
        if "skipped" in r:
            print("  %s skipped: %s" % (r["bench"], r["skipped"]))
        elif "strategy" in r:
            rows[r["strategy"]] = r
            if "step_ms" in r:
                coll = ""
                if "all_gathers_per_step" in r:
                    coll = "  per step: %.0f all-gathers, %.0f reduce-scatters, %.0f all-reduces (%d units)" % (
                        r["all_gathers_per_step"], r["reduce_scatters_per_step"], r["all_reduces_per_step"],
                        r["units"])
                if "units_on_device" in r:
                    coll += ", %d on the GPU" % r["units_on_device"]
                if "gpu_waits_for_host_share" in r:
                    coll += "; the GPU waits for the host %.1f ms a step (%.0f%%)" % (
                        r["host_wait_ms"], 100 * r["gpu_waits_for_host_share"])
                losses = r.get("losses") or [float("nan")]
                # The first loss: every mode starts from the same weights and data (same seeds).
                print("  %-13s %8.1f ms/step %9.0f tokens/s  peak %6.2f GiB  loss %.4f -> %.4f%s" % (
                    r["strategy"], r["step_ms"], r["tokens_per_s"], r["peak_bytes"] / 2**30, losses[0],
                    losses[-1], coll))
            if "error" in r:
                print("  %-13s error: %s" % (r["strategy"], r["error"].splitlines()[0][:300]))
        elif "target" in r and "ratio" in r:
            print("  target %-28s ratio %.3f%s" % (
                r["target"], r["ratio"], " (goal >= %.2f)" % r["goal"] if "goal" in r else ""))

    def ratio(num, den):
        a, b = rows.get(num, {}), rows.get(den, {})
        if "tokens_per_s" in a and "tokens_per_s" in b:
            return a["tokens_per_s"] / b["tokens_per_s"]
        return None

    for name, num, den, goal in (("full_shard_vs_python_fsdp2", "FULL_SHARD", "PYTHON_FSDP2", 1.0),
                                 ("plain_vs_python_plain", "PLAIN", "PYTHON_PLAIN", None),
                                 ("offload_vs_python_fsdp2_offload", "FULL_SHARD_OFFLOAD", "PYTHON_FSDP2_OFFLOAD", 3.0),
                                 ("offload_auto_vs_offload", "FULL_SHARD_OFFLOAD_AUTO", "FULL_SHARD_OFFLOAD", None)):
        x = ratio(num, den)
        if x is None:
            continue
        out = {"bench": "gpu_gpt", "target": name, "ratio": round(x, 3)}
        if goal is not None:
            out["goal"] = goal
        note = ""
        if name == "full_shard_vs_python_fsdp2":
            a, b = ratio("FULL_SHARD", "PLAIN"), ratio("PYTHON_FSDP2", "PYTHON_PLAIN")
            if a and b:
                # Each against the plain baseline of its own process: drift between the runs cancels.
                out["ratio_each_vs_own_plain"] = round(a / b, 3)
                note = "; (FULL_SHARD/PLAIN) / (PYTHON_FSDP2/PYTHON_PLAIN) = %.3f" % (a / b)
        print("  target %-28s ratio %.3f%s%s" % (name, x, " (goal >= %.2f)" % goal if goal else "", note))
        extra.append(out)
    with open(path, "a") as f:
        for out in extra:
            f.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
