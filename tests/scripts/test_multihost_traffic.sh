#!/usr/bin/env bash
# Bytes on the wire between two simulated hosts (tests/scripts/lib/sim_hosts.sh) equal each
# strategy's own volume, computed from the layer sizes alone (tests/scripts/lib/link_traffic.py).
# Gloo has no byte counters, so the bytes are counted by the kernel: host 1's veth, through which
# everything between the hosts passes (tx and rx, packets and bytes).
#
# fsdp-train's mlp on 2 hosts x 2 ranks, one `fsdp-run --nnodes 2` per host, uncapped link:
# FULL_SHARD (groups span the hosts: 2 (3 sum P_u - P_last - P_second_last) per step), HYBRID_SHARD (shard group =
# a host on shared memory; only the replica all-reduce crosses: 2 S) and NO_SHARD (Gloo's ring
# over 4 ranks crosses twice: 3 S). Per step = (run of LONG steps - run of SHORT steps) / (LONG -
# SHORT): start-up, the final evaluation and the rendezvous cancel; what runs for as long as the
# job does (TCP keepalives of the launchers, neighbour discovery) is measured in an idle job (both
# launchers connected, ranks asleep) and subtracted pro rata.
#
# Asserted per strategy and direction: payload = bytes - packets x 66 (Ethernet 14 + IPv4 20 +
# TCP 20 + timestamps 12; one header per packet, also for a 64 KiB TSO segment) equals half the
# volume, plus at most FRAMING bytes of Gloo's own framing, minus at most FRAMING/8 of counting
# noise; and the headers stay below two per MSS-sized segment (the bound with one ACK per
# segment; TSO keeps the measured share far below it). A retransmitted segment crosses twice: a
# loaded machine drops packets on the simulated link now and then, so each run's retransmissions
# (both hosts' RetransSegs, at most one MSS each) widen its bounds by exactly what they can add.
# Needs root (namespaces): as another user it prints SKIP; under CI=true it fails instead.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=lib/two_hosts.sh
source "$HERE/lib/two_hosts.sh"
require_tools fsdp-run fsdp-train
require_fashion_mnist
command -v "$PY" >/dev/null || { echo "FAIL: $PY is needed for the arithmetic ($PY_MISSING)"; exit 1; }

FAIL_TAIL=15
HIDDEN=512
SHORT="${TRAFFIC_SHORT:-2}"
LONG="${TRAFFIC_LONG:-10}"
# Gloo's framing per step and direction: a 48-byte preamble on every message and a 48-byte
# send-ready and recv-ready notice each; fewer than 100 messages cross per step and direction
# in these jobs (FULL_SHARD, the most: 8 unit collectives x 2 ranks x 2 remote peers = 32).
FRAMING=$((100 * 3 * 48))

HEADER="$(tcp_header_bytes)"
MSS="$(tcp_mss)"
RUNS="$WORK/runs.jsonl"

# Host 1's link counters, then the retransmissions of both hosts.
counters() { echo "$(sim_host_counters 1 | tr ' ' ','),$(($(sim_host_retransmits 0) + $(sim_host_retransmits 1)))"; }

idle_window 1 2.5 counters >"$RUNS"

for strategy in full_shard hybrid_shard no_shard; do
  for steps in "$SHORT" "$LONG"; do
    c0="$(counters)" t0="$(now)"
    two_host_job "$strategy.$steps" "$BIN/fsdp-train" --strategy "$strategy" --hidden $HIDDEN --steps "$steps" --no-shuffle \
      --timeout 60
    c1="$(counters)" t1="$(now)"
    echo "{\"kind\": \"run\", \"strategy\": \"$strategy\", \"steps\": $steps, \"before\": [$c0], \"after\": [$c1]," \
      "\"seconds\": $(seconds_since "$t0" "$t1")}" >>"$RUNS"
  done
done
# The model the volumes are computed for is the one that trained.
params="$("$PY" -c "import sys; sys.path.insert(0, '$HERE/lib'); import link_traffic as t; print(sum(t.units($HIDDEN)))")"
grep -q "fsdp-train: mlp ($params params, " "$WORK/full_shard.$SHORT.h0.out" ||
  fail "fsdp-train's mlp does not have the $params parameters of link_traffic.units($HIDDEN)"
"$PY" "$HERE/lib/link_traffic.py" check "$RUNS" $HIDDEN "$HEADER" $FRAMING "$MSS" || fail "traffic on the link differs from the volumes (raw runs: $(cat "$RUNS"))"
echo "all traffic checks passed"
