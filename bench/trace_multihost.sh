#!/usr/bin/env bash
# Measurement, not a test (not run by ctest): where one FSDP step's time goes across 2
# simulated hosts x 2 ranks with a tbf-capped link, from the FSDP trace (FSDP_TRACE).
#
#   FSDP_BIN_DIR=build/bin bash bench/trace_multihost.sh [RATE] [STRATEGY] [STEPS]
#   (defaults: 1gbit hybrid_shard 13; fsdp-train's mlp as in measure_multihost.sh)
#
# Prints rank 0's and rank 2's (the other host) per-step timelines and medians
# (bench/trace_timeline.py: ms from the step's start, spans as [begin, end]; with
# the optimizer inside backward, how much of it the reductions hide);
# TRACE_OUT=DIR keeps the Chrome trace files (open them in ui.perfetto.dev).
# BENCH_ARGS="..." traces bench_strategies' rank mode with those arguments instead of
# fsdp-train (STRATEGY and STEPS are then ignored), e.g. BENCH_ARGS="--model transformer
# --strategy hybrid_shard --shard-group 2 --optim adam --steps 10 --warmup 1 --rounds 2
# --prefetch default --bucket-mb 0 --optimizer-in-backward --zero-copy-gather".
# LINK_UNIT=LABEL also prints, over all four ranks, when the link fills (every rank has issued
# that unit's replica all-reduce) and empties (bench/trace_link.py).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
# The multi-host tests' two simulated hosts (tests/scripts/lib).
TESTS_LIB="$HERE/../tests/scripts/lib"
# shellcheck source=../tests/scripts/lib/two_hosts.sh
source "$TESTS_LIB/two_hosts.sh"
RATE="${1:-1gbit}"
STRATEGY="${2:-hybrid_shard}"
STEPS="${3:-13}"
read -r -a BENCH <<<"${BENCH_ARGS:-}"
if ((${#BENCH[@]})); then
  require_tools fsdp-run bench_strategies
  CMD=("$BIN/bench_strategies" "${BENCH[@]}")
  WHAT="bench_strategies ${BENCH[*]}"
else
  require_tools fsdp-run fsdp-train
  CMD=("$BIN/fsdp-train" --strategy "$STRATEGY" --hidden 512 --steps "$STEPS" --no-shuffle --timeout 120
    --metrics "$WORK/metrics.jsonl")
  WHAT="$STRATEGY"
fi
sim_host_rate 0 "$RATE"
sim_host_rate 1 "$RATE"
export FSDP_TRACE="${TRACE_OUT:-$WORK/trace}"
mkdir -p "$FSDP_TRACE"
two_host_job trace "${CMD[@]}"
((${#BENCH[@]})) && sed -n 's/^\[rank0\]: \({.*}\)$/\1/p' "$WORK/trace.h0.out"
for r in 0 2; do
  echo "rank $r ($RATE, $WHAT):"
  "$PY" "$HERE/trace_timeline.py" "$FSDP_TRACE/trace_rank$r.json"
done
[[ -n "${LINK_UNIT:-}" ]] && { echo "all ranks, the link from unit $LINK_UNIT's replica all-reduce on:"; "$PY" "$HERE/trace_link.py" "$FSDP_TRACE" --unit "$LINK_UNIT"; }
echo "load average: $(cat /proc/loadavg)"
