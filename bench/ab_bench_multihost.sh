#!/usr/bin/env bash
# Measurement, not a test (not run by ctest): A/B of bench_strategies across 2 simulated hosts x 2
# ranks with a tbf-capped link, one build, with and without extra flags, alternating (AB, BA, ...).
# A runs bench_strategies ARGS...; B runs it with ARGS... plus $B_FLAGS.
#
#   FSDP_BIN_DIR=build/bin B_FLAGS=--optimizer-in-backward \
#       bash bench/ab_bench_multihost.sh [PAIRS] [RATE] -- ARGS...
#   (defaults: 6 1gbit; root)
#
# Per run: bench_strategies' JSON line of rank 0 (its step, ceiling and optimizer times measured
# in the same rank processes). Prints one JSON line per run and the median of the per-pair ratios
# B/A of step_ms, with the medians of each side's step and optimizer times, and of (A - B) /
# A's optimizer time per pair: the share of the optimizer that B hides when B_FLAGS puts it
# inside backward.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
# The multi-host tests' two simulated hosts (tests/scripts/lib).
TESTS_LIB="$HERE/../tests/scripts/lib"
# shellcheck source=../tests/scripts/lib/two_hosts.sh
source "$TESTS_LIB/two_hosts.sh"
: "${B_FLAGS:?set B_FLAGS to what B adds to the arguments of bench_strategies}"
PAIRS="${1:-6}"
RATE="${2:-1gbit}"
shift 2 || true
[[ "${1:-}" == "--" ]] && shift
ARGS=("$@")
((${#ARGS[@]})) || fail "give bench_strategies' arguments after --"
read -r -a EXTRA <<<"$B_FLAGS"
require_tools fsdp-run bench_strategies
sim_host_rate 0 "$RATE"
sim_host_rate 1 "$RATE"
RES="$WORK/ab.jsonl"
for ((i = 1; i <= PAIRS; i++)); do
  order=(A B)
  ((i % 2)) || order=(B A)
  for w in "${order[@]}"; do
    flags=()
    [[ $w == B ]] && flags=("${EXTRA[@]}")
    name="ab.$i.$w"
    two_host_job "$name" "$BIN/bench_strategies" "${ARGS[@]}" "${flags[@]}"
    line="$(sed -n 's/^\[rank0\]: \({.*}\)$/\1/p' "$WORK/$name.h0.out" | tail -n 1)"
    [[ -n "$line" ]] || fail "bench_strategies printed no JSON line in run $name: $(tail -n 5 "$WORK/$name.h0.out")"
    echo "{\"pair\": $i, \"side\": \"$w\", \"rate\": \"$RATE\", \"load\": $(cut -d' ' -f1 /proc/loadavg), \"result\": $line}" |
      tee -a "$RES"
  done
done
"$PY" - "$RES" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
side = lambda w, k: {r["pair"]: r["result"][k] for r in rows if r["side"] == w}
a, b = side("A", "step_ms"), side("B", "step_ms")
opt_a = side("A", "optimizer_ms")
pairs = [p for p in sorted(a) if p in b]
ratios = [b[p] / a[p] for p in pairs]
med = lambda d: round(statistics.median(d.values()), 3)
print(json.dumps({"pairs": len(ratios), "median_ratio_B_over_A": round(statistics.median(ratios), 3),
                  "ratios": [round(x, 3) for x in ratios], "median_step_ms_A": med(a), "median_step_ms_B": med(b),
                  "median_optimizer_ms_A": med(opt_a),
                  "median_optimizer_ms_B": med(side("B", "optimizer_ms")),
                  "median_ceiling_ms": med(side("A", "ceiling_ms")),
                  # What B saves of A's optimizer time, per pair (B: --optimizer-in-backward).
                  "median_hidden_of_A_optimizer": round(statistics.median((a[p] - b[p]) / opt_a[p] for p in pairs), 3)}))
PY
echo "load average: $(cat /proc/loadavg)"
