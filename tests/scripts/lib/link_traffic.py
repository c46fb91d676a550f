"""Bytes that fsdp-train's mlp must move between two simulated hosts per training step, and
what the veth counters of one host say crossed (tests/scripts/test_multihost_traffic.sh,
bench/measure_multihost.sh).

Words:
  S          bytes of the mlp's fp32 parameters (units in forward order: Linear(784, h),
             Linear(h, h), Linear(h, 10); the root holds none: fsdp-train wraps every Linear)
  P_u        unit u's flat buffer padded to a multiple of the shard group (padded_numel)
  volume     the algorithm's own cross-host bytes per step (both directions), computed here
             from the layer sizes alone, for 2 hosts x K ranks (ranks 0..K-1 on host 0):
    FULL_SHARD    every all-gather and reduce-scatter is direct (each rank sends its chunk
                  P_u/N to every peer: gloo_p2p.cpp, gloo_alltoall.cpp), so a collective of
                  unit u moves N * K * P_u/N = K P_u across; per step forward gather,
                  backward gather (less the two units that finished forward last, kept
                  gathered from the second step under the default --backward-prefetch pre:
                  [Note: last unit stays gathered]) and reduce-scatter:
                  K (3 sum(P_u) - P_last - P_second_last)
    HYBRID_SHARD  shard group = a host (shared memory, nothing crosses); the reduced shard
                  P_u/K of each rank is all-reduced with its replica on the other host by
                  Gloo's ring at 2 ranks (each sends half, then its reduced half): 2 P_u/K per
                  pair, K pairs: 2 sum(P_u)
    NO_SHARD      Gloo's ring all-reduce of every unit's gradient over N = 2K ranks in rank
                  order: 2 ring links cross (K-1 -> K and N-1 -> 0), each carries
                  2 (N-1)/N S: 4 (N-1)/N S
  lower bound   what any algorithm must move per direction when each host holds the partial
                sums of the whole gradient (all-reduce between two hosts: S/2 sent + S/2
                reduced back) or half of the parameters (an all-gather receives S/2, a
                reduce-scatter sends S/2): NO_SHARD, HYBRID_SHARD S; FULL_SHARD
                (2 S - S_last - S_second_last)/2 + S/2 (two gathers, one reduce-scatter)
All three volumes are symmetric: each direction carries half.
"""

import json
import sys

ELEM = 4  # fp32


def units(hidden):
    return [784 * hidden + hidden, hidden * hidden + hidden, hidden * 10 + 10]


def padded(numel, n):
    return -(-numel // n) * n


def volume(strategy, hidden, per_host=2):
    """Cross-host bytes per step, both directions, for 2 hosts x per_host ranks."""
    k, n = per_host, 2 * per_host
    u = units(hidden)
    if strategy == "full_shard":
        p = [ELEM * padded(x, n) for x in u]
        return k * (3 * sum(p) - p[-1] - p[-2])
    if strategy == "hybrid_shard":
        return 2 * sum(ELEM * padded(x, k) for x in u)
    if strategy == "no_shard":
        return 4 * (n - 1) * ELEM * sum(u) // n
    raise ValueError("unknown strategy " + strategy)


def lower_bound_per_direction(strategy, hidden):
    u = units(hidden)
    s = ELEM * sum(u)
    if strategy == "full_shard":
        return (2 * s - ELEM * (u[-1] + u[-2])) / 2 + s / 2
    return s


def per_step(runs, idle, header):
    """Per-step counters of host 1's link from a short and a long run of the same job:
    (long - short - idle rate x (long time - short time)) / (long steps - short steps).
    Returns tx/rx wire bytes, packets and payload (wire - header x packets), and the TCP
    segments the hosts retransmitted during the long and the short run, per step between them
    (retransmitted_long, retransmitted_short)."""
    short, long_ = sorted(runs, key=lambda r: r["steps"])
    dsteps = long_["steps"] - short["steps"]
    dt = long_["seconds"] - short["seconds"]
    out = {}
    for i, key in enumerate(["tx_bytes", "rx_bytes", "tx_packets", "rx_packets"]):
        d = lambda r: r["after"][i] - r["before"][i]
        rate = (idle["after"][i] - idle["before"][i]) / idle["seconds"]
        out[key] = (d(long_) - d(short) - rate * dt) / dsteps
    for side in ("tx", "rx"):
        out[side + "_payload"] = out[side + "_bytes"] - header * out[side + "_packets"]
    out["wire"] = out["tx_bytes"] + out["rx_bytes"]
    out["payload"] = out["tx_payload"] + out["rx_payload"]
    out["packets"] = out["tx_packets"] + out["rx_packets"]
    out["seconds_per_step"] = dt / dsteps
    out["retransmitted_long"] = retransmitted(long_) / dsteps
    out["retransmitted_short"] = retransmitted(short) / dsteps
    return out


def retransmitted(run):
    """TCP segments both hosts retransmitted during one run (counter 4, when recorded)."""
    return run["after"][4] - run["before"][4] if len(run["after"]) > 4 else 0


def check(path, hidden, header, framing, mss):
    """The test's assertions over the JSON lines at `path` (see test_multihost_traffic.sh).
    Exits 1 naming every failed bound.

    A retransmitted segment crosses twice; the kernel counts them (RetransSegs, in units of at
    most one MSS of payload each), so each run's retransmissions widen its bounds by what they
    can have added: the long run's raise the per-step excess, the short run's lower it."""
    recs = [json.loads(line) for line in open(path)]
    idle = next(r for r in recs if r["kind"] == "idle")
    rate = sum(idle["after"][i] - idle["before"][i] for i in (0, 1)) / idle["seconds"]
    print("idle: %.0f B/s across the link with both launchers connected and the ranks asleep "
          "(keepalives, neighbour discovery), subtracted pro rata" % rate)
    failed = []
    for strategy in dict.fromkeys(r["strategy"] for r in recs if r["kind"] == "run"):
        before = len(failed)
        runs = [r for r in recs if r.get("strategy") == strategy]
        m = per_step(runs, idle, header)
        v = volume(strategy, hidden)
        retrans = sum(retransmitted(r) for r in runs)
        up = m["retransmitted_long"] * mss
        down = m["retransmitted_short"] * mss
        print(json.dumps({"strategy": strategy, "volume_bytes": v, "retransmitted_segments": retrans, "payload_bytes": round(m["payload"]),
                          "tx_payload_bytes": round(m["tx_payload"]), "rx_payload_bytes": round(m["rx_payload"]),
                          "wire_bytes": round(m["wire"]), "packets": round(m["packets"], 1),
                          "payload_vs_volume": round(m["payload"] / v, 5), "wire_vs_volume": round(m["wire"] / v, 5)}))
        # What crossed beyond the algorithm's bytes, per direction: Gloo's framing (a 48-byte
        # preamble per message, and the 48-byte send-ready / recv-ready notices), never less
        # than the algorithm's bytes; retransmitted segments on top.
        for side in ("tx", "rx"):
            extra = m[side + "_payload"] - v / 2
            if not (-framing / 8 - down <= extra <= framing + up):
                failed.append("%s: host 1 %s %.0f payload bytes per step, expected %d (half the volume) + at most "
                              "%d of Gloo framing + at most %.0f retransmitted: off by %+.0f"
                              % (strategy, side, m[side + "_payload"], v // 2, framing, up, extra))
        # Headers: one Ethernet+IPv4+TCP header per packet, at most one data segment of a full
        # MSS per header plus one pure ACK per data segment; TSO/GRO keeps it far below.
        headers = m["wire"] - m["payload"]
        if not (0 <= headers <= 2 * header * m["payload"] / mss):
            failed.append("%s: %.0f header bytes per step on %.0f payload bytes exceeds 2 x %d per %d-byte segment"
                          % (strategy, headers, m["payload"], header, mss))
        if len(failed) == before:
            print("ok: %s: %.0f B/step crossed (payload %.0f = volume %d %+.0f, Gloo framing%s; TCP/IP headers "
                  "+%.2f%% in %.0f packets)" % (strategy, m["wire"], m["payload"], v, m["payload"] - v,
                                                " and %d retransmitted segment%s" % (retrans, "s" * (retrans > 1)) if retrans else "",
                                                100 * headers / m["payload"], m["packets"]))
    if failed:
        print("FAIL: " + "\nFAIL: ".join(failed))
        sys.exit(1)


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def step_seconds(metrics_path, batch, first=3):
    """Median of rank 0's step times (fsdp-train --metrics: samples_per_s = batch / step time)
    over steps >= first: the first steps carry warm-up (allocations, the unit order)."""
    lines = [json.loads(line) for line in open(metrics_path)]
    return median([batch / j["samples_per_s"] for j in lines if "eval" not in j and j["step"] >= first])


def report(path, hidden, header):
    """measure_multihost.sh's table and JSON lines from its records."""
    recs = [json.loads(line) for line in open(path)]
    idle = next(r for r in recs if r["kind"] == "idle")
    comp = next(r for r in recs if r["kind"] == "compute")
    per_process = [step_seconds(p, 16) for p in comp["metrics"]]
    compute = max(per_process)
    print(json.dumps({"compute_only_step_s": round(compute, 5), "per_process_median_s": [round(x, 5) for x in per_process],
                      "idle_bytes_per_s": round(sum(idle["after"][i] - idle["before"][i] for i in (0, 1)) / idle["seconds"], 1)}))
    rows = []
    for link in (r for r in recs if r["kind"] == "link"):
        rate = link["rate"]
        bps = {"tx": link["tx"]["payload_bytes_per_s"], "rx": link["rx"]["payload_bytes_per_s"]}
        print(json.dumps({"rate": rate, "calibrated_payload_bytes_per_s": bps}))
        runs = [r for r in recs if r["kind"] == "run" and r["rate"] == rate]
        for strategy in dict.fromkeys(r["strategy"] for r in runs):
            mine = [r for r in runs if r["strategy"] == strategy]
            m = per_step(mine, idle, header)
            long_ = max(mine, key=lambda r: r["steps"])
            step = step_seconds(long_["metrics"], 64)
            link_s = max(m["tx_payload"] / bps["tx"], m["rx_payload"] / bps["rx"])
            v = volume(strategy, hidden)
            lb = lower_bound_per_direction(strategy, hidden)
            rows.append({"source": "fsdp-train", "rate": rate, "strategy": strategy, "step_s": round(step, 5),
                         "step_s_wall_difference": round(m["seconds_per_step"], 5),
                         "compute_only_s": round(compute, 5), "link_bound_s": round(link_s, 5),
                         "vs_bound": round(step / max(compute, link_s), 3),
                         "tx_payload_bytes": round(m["tx_payload"]), "rx_payload_bytes": round(m["rx_payload"]),
                         "wire_bytes": round(m["wire"]), "volume_bytes": v,
                         "payload_vs_volume": round(m["payload"] / v, 5),
                         "vs_lower_bound": round(max(m["tx_payload"], m["rx_payload"]) / lb, 3)})
        for b in (r for r in recs if r["kind"] == "bench" and r["rate"] == rate):
            res = next(r["result"] for r in recs if r["kind"] == "bench_result" and r["name"] == b["name"])
            tx = (b["after"][0] - b["before"][0] - header * (b["after"][2] - b["before"][2])) / b["fsdp_steps"]
            rx = (b["after"][1] - b["before"][1] - header * (b["after"][3] - b["before"][3])) / b["fsdp_steps"]
            step = res["step_ms"] / 1e3
            comp_b = (res["ceiling_ms"] + res["optimizer_ms"]) / 1e3
            link_s = max(tx / bps["tx"], rx / bps["rx"])
            rows.append({"source": "bench_strategies " + b.get("model", "mlp"), "rate": rate, "strategy": b["strategy"], "step_s": round(step, 5),
                         "compute_only_s": round(comp_b, 5), "link_bound_s": round(link_s, 5),
                         "vs_bound": round(step / max(comp_b, link_s), 3),
                         "tx_payload_bytes": round(tx), "rx_payload_bytes": round(rx), "bench": res})
    print("| source | link | strategy | step s | compute-only s | link bound s | step / max(compute, link) "
          "| <= 1.25? | MB/step each way (payload, host 1 tx / rx) | vs volume | vs cross-host lower bound |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for r in rows:
        print("| %s | %s | %s | %.3f | %.3f | %.3f | %.2f | %s | %.3f / %.3f | %s | %s |" % (
            r["source"], r["rate"], r["strategy"].upper(), r["step_s"], r["compute_only_s"], r["link_bound_s"],
            r["vs_bound"], "yes" if r["vs_bound"] <= 1.25 else "NO", r["tx_payload_bytes"] / 1e6,
            r["rx_payload_bytes"] / 1e6, "%.4f" % r["payload_vs_volume"] if "payload_vs_volume" in r else "-",
            "%.2f" % r["vs_lower_bound"] if "vs_lower_bound" in r else "-"))
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "volume":
        print(volume(sys.argv[2], int(sys.argv[3])))
    elif cmd == "report":
        report(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif cmd == "check":
        check(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    else:
        sys.exit("usage: link_traffic.py volume STRATEGY HIDDEN | check RUNS.jsonl HIDDEN HEADER FRAMING MSS | "
                 "report RECORDS.jsonl HIDDEN HEADER")
