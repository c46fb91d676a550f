#!/usr/bin/env bash
# Measurement, not a test (not run by ctest): fsdp-train's mlp on 2 simulated hosts x 2 ranks
# per strategy, optionally with host links capped by tbf. Reports the bytes crossing the link
# per step (host 1's veth counters, both directions, headers included; the difference
# between a SHORT and a LONG run, so start-up, evaluation and store traffic cancel) and the
# time per step (difference of the wall times).
#   FSDP_BIN_DIR=build/bin bash tests/scripts/measure_multihost.sh [RATE] [SHORT] [LONG]
#   RATE: tc rate of each host's outgoing link, e.g. 100mbit or 1gbit ("" or none: uncapped)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=lib/sim_hosts.sh
source "$HERE/lib/sim_hosts.sh"
sim_hosts_require
BIN="${FSDP_BIN_DIR:?set FSDP_BIN_DIR to the bin directory of a build}"
RATE="${1:-none}"
SHORT="${2:-5}"
LONG="${3:-15}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
sim_hosts_create 2
unset GLOO_SOCKET_IFNAME
if [[ "$RATE" != none ]]; then
  sim_host_rate 0 "$RATE"
  sim_host_rate 1 "$RATE"
fi

# run STRATEGY STEPS: prints "<bytes> <seconds>" of one 2-host run.
run() {
  local b0 t0 pids=() i
  b0="$(sim_host_bytes 1)"
  t0="$(date +%s.%N)"
  for i in 0 1; do
    sim_host_run "$i" "$BIN/fsdp-run" --nnodes 2 --node-rank "$i" --master-addr "${SIM_ADDR[0]}" \
      --master-port 29500 --nproc 2 -- "$BIN/fsdp-train" --strategy "$1" --steps "$2" --no-shuffle \
      >"$WORK/$1.$2.h$i.out" 2>&1 &
    pids+=($!)
  done
  for i in 0 1; do wait "${pids[i]}" || { echo "run $1 $2 failed:" >&2; tail "$WORK/$1.$2.h$i.out" >&2; exit 1; }; done
  echo "$(($(sim_host_bytes 1) - b0)) $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { print b - a }')"
}

echo "link: ${RATE}; per step = (run of $LONG steps - run of $SHORT steps) / $((LONG - SHORT))"
printf "%-14s %16s %14s\n" strategy "MB/step (link)" "s/step"
for strategy in hybrid_shard full_shard no_shard; do
  read -r bs ts < <(run "$strategy" "$SHORT")
  read -r bl tl < <(run "$strategy" "$LONG")
  awk -v s="$strategy" -v bs="$bs" -v bl="$bl" -v ts="$ts" -v tl="$tl" -v n=$((LONG - SHORT)) \
    'BEGIN { printf "%-14s %16.3f %14.3f\n", s, (bl - bs) / n / 1e6, (tl - ts) / n }'
done
