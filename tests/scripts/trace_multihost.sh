#!/usr/bin/env bash
# Measurement, not a test (not run by ctest): where one FSDP step's time goes across 2
# simulated hosts x 2 ranks with a tbf-capped link, from the FSDP trace (FSDP_TRACE).
#
#   FSDP_BIN_DIR=build/bin bash tests/scripts/trace_multihost.sh [RATE] [STRATEGY] [STEPS]
#   (defaults: 1gbit hybrid_shard 13; fsdp-train's mlp as in measure_multihost.sh)
#
# Prints rank 0's and rank 2's (the other host) per-step timelines and medians
# (tests/scripts/lib/trace_timeline.py: ms from the step's start, spans as [begin, end]);
# TRACE_OUT=DIR keeps the Chrome trace files (open them in ui.perfetto.dev).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=lib/two_hosts.sh
source "$HERE/lib/two_hosts.sh"
RATE="${1:-1gbit}"
STRATEGY="${2:-hybrid_shard}"
STEPS="${3:-13}"
require_tools fsdp-run fsdp-train
sim_host_rate 0 "$RATE"
sim_host_rate 1 "$RATE"
export FSDP_TRACE="${TRACE_OUT:-$WORK/trace}"
mkdir -p "$FSDP_TRACE"
two_host_job trace "$BIN/fsdp-train" --strategy "$STRATEGY" --hidden 512 --steps "$STEPS" --no-shuffle \
  --timeout 120 --metrics "$WORK/metrics.jsonl"
for r in 0 2; do
  echo "rank $r ($RATE, $STRATEGY):"
  "$PY" "$HERE/lib/trace_timeline.py" "$FSDP_TRACE/trace_rank$r.json"
done
echo "load average: $(cat /proc/loadavg)"
