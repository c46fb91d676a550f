#!/usr/bin/env bash
# Measurement, not a test (not run by ctest): A/B of two builds' fsdp-train step time across
# 2 simulated hosts x 2 ranks with a tbf-capped link (the setting of measure_multihost.sh,
# without its calibration and compute-only runs), alternating A and B (ABBA...) on the same hosts.
#
#   A=<bin dir> B=<bin dir> bash bench/ab_multihost.sh [PAIRS] [RATE] [STRATEGY...]
#   (defaults: 6 1gbit hybrid_shard; env STEPS=33; B_FLAGS: what B's runs add to fsdp-train's
#   arguments, B defaulting to A, for an A/B of one build with and without a flag)
#
# Per run: rank 0's median step time over steps 3..STEPS (--metrics). Prints one JSON line
# per run and, per strategy, the median of the per-pair ratios B/A.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
: "${A:?set A to the bin directory of the baseline}"
B_FLAGS="${B_FLAGS:-}"
[[ -n "$B_FLAGS" ]] && B="${B:-$A}"
: "${B:?set B to the bin directory of the candidate (or B_FLAGS)}"
read -r -a EXTRA <<<"$B_FLAGS"
FSDP_BIN_DIR="$A"
export FSDP_BIN_DIR
# The multi-host tests' two simulated hosts (tests/scripts/lib).
TESTS_LIB="$HERE/../tests/scripts/lib"
# shellcheck source=../tests/scripts/lib/two_hosts.sh
source "$TESTS_LIB/two_hosts.sh"
PAIRS="${1:-6}"
RATE="${2:-1gbit}"
shift 2 || true
STRATS=("$@")
((${#STRATS[@]})) || STRATS=(hybrid_shard)
STEPS="${STEPS:-33}"
sim_host_rate 0 "$RATE"
sim_host_rate 1 "$RATE"
RES="$WORK/ab.jsonl"
for ((i = 1; i <= PAIRS; i++)); do
  order=(A B)
  ((i % 2)) || order=(B A)
  for s in "${STRATS[@]}"; do
    for w in "${order[@]}"; do
      flags=()
      if [[ $w == A ]]; then BIN="$A"; else BIN="$B"; flags=("${EXTRA[@]}"); fi
      m="$WORK/m.$i.$w.$s.jsonl"
      two_host_job "ab.$i.$w.$s" "$BIN/fsdp-train" --strategy "$s" --hidden 512 --steps "$STEPS" --no-shuffle \
        --timeout 120 --metrics "$m" "${flags[@]}"
      step="$("$PY" -c "import sys; sys.path.insert(0, '$TESTS_LIB'); import link_traffic as t; print(round(t.step_seconds('$m', 64), 5))")"
      line="{\"pair\": $i, \"build\": \"$w\", \"strategy\": \"$s\", \"rate\": \"$RATE\", \"step_s\": $step, \"load\": $(cut -d' ' -f1 /proc/loadavg)}"
      echo "$line" | tee -a "$RES"
    done
  done
done
"$PY" - "$RES" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for s in sorted({r["strategy"] for r in rows}):
    a = {r["pair"]: r["step_s"] for r in rows if r["strategy"] == s and r["build"] == "A"}
    b = {r["pair"]: r["step_s"] for r in rows if r["strategy"] == s and r["build"] == "B"}
    ratios = [b[p] / a[p] for p in sorted(a) if p in b]
    print(json.dumps({"strategy": s, "pairs": len(ratios), "median_ratio_B_over_A": round(statistics.median(ratios), 3),
                      "ratios": [round(x, 3) for x in ratios], "median_step_s_A": statistics.median(a.values()),
                      "median_step_s_B": statistics.median(b.values())}))
PY
echo "load average: $(cat /proc/loadavg)"
