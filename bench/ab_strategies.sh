#!/usr/bin/env bash
# A/B of two builds on one bench_strategies rank-mode configuration: alternates the two
# binaries (A, then B, then B, then A, ...: each pair swaps who goes first, so load that
# rises or falls during a pair hits both alike) and prints every pair's step_ms and the
# median of the B/A ratios. On a shared machine one run's time is noise; the median of
# alternating pairs is the figure to compare (docs/benchmarks.md).
#
#   A=/work/main/build/bin B=build/bin bash bench/ab_strategies.sh 8 -- --model transformer \
#       --strategy full_shard --optim cpuadam --prefetch default --shard-group 0 --bucket-mb 0 \
#       --steps 30 --warmup 5
#
# A and B are directories holding fsdp-run and bench_strategies. NPROC (default 2) ranks,
# OMP_NUM_THREADS=1. Ratio < 1: B is faster. A_ENV / B_ENV (space-separated NAME=VALUE) set
# variables for one side only, so one build can be compared with itself under a setting, e.g.
# the checked mode's cost: A=build/bin B=build/bin B_ENV=FSDP_CHECK_COLLECTIVES=1. B_FLAGS
# (space-separated) are added to B's bench_strategies arguments, e.g. --optimizer-in-backward;
# A_FLAGS to A's. Each pair also prints each side's vs_ceiling (the bench's concurrent compute
# ceiling / step), and the end each side's median and range of it.
set -euo pipefail

usage() {
  echo "usage: A=<bin dir> B=<bin dir> [A_ENV=..] [B_ENV=..] [NPROC=2] bash bench/ab_strategies.sh PAIRS -- <bench_strategies rank-mode args>" >&2
  exit 2
}
[[ $# -ge 2 && "$2" == "--" ]] || usage
pairs=$1
shift 2
[[ "$pairs" =~ ^[1-9][0-9]*$ ]] || usage
: "${A:?A=<bin dir> missing}" "${B:?B=<bin dir> missing}"
nproc=${NPROC:-2}
for d in "$A" "$B"; do
  [[ -x "$d/fsdp-run" && -x "$d/bench_strategies" ]] || { echo "ab_strategies: $d lacks fsdp-run or bench_strategies" >&2; exit 2; }
done

# "step_ms vs_ceiling" of one run of binary dir $1 with the variables $2 and the extra
# arguments $3 (rank 0's JSON line).
step_ms() {
  local dir=$1 vars flags out
  read -r -a vars <<<"$2"
  read -r -a flags <<<"$3"
  shift 3
  out=$(env "${vars[@]}" OMP_NUM_THREADS=1 "$dir/fsdp-run" --nproc "$nproc" -- "$dir/bench_strategies" "$@" "${flags[@]}" 2>&1) || {
    echo "ab_strategies: run of $dir failed:" >&2
    echo "$out" >&2
    exit 1
  }
  echo "$out" | sed -n 's/.*"step_ms": \([0-9.]*\).*"vs_ceiling": \([0-9.]*\).*/\1 \2/p' | head -n 1
}

# The median of its arguments (numbers), to 3 decimals.
median_of() {
  printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) printf "%.3f\n", v[(NR + 1) / 2]; else printf "%.3f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
# "median (min-max)" of its arguments.
summary_of() {
  echo "$(median_of "$@") ($(printf '%s\n' "$@" | sort -g | head -n 1)-$(printf '%s\n' "$@" | sort -g | tail -n 1))"
}

ratios=() ceil_a=() ceil_b=()
for ((i = 1; i <= pairs; ++i)); do
  if ((i % 2)); then
    ra=$(step_ms "$A" "${A_ENV:-}" "${A_FLAGS:-}" "$@"); rb=$(step_ms "$B" "${B_ENV:-}" "${B_FLAGS:-}" "$@")
  else
    rb=$(step_ms "$B" "${B_ENV:-}" "${B_FLAGS:-}" "$@"); ra=$(step_ms "$A" "${A_ENV:-}" "${A_FLAGS:-}" "$@")
  fi
  [[ -n "$ra" && -n "$rb" ]] || { echo "ab_strategies: no step_ms / vs_ceiling in a run's output" >&2; exit 1; }
  read -r a ca <<<"$ra"
  read -r b cb <<<"$rb"
  r=$(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.3f", b / a }')
  ratios+=("$r") ceil_a+=("$ca") ceil_b+=("$cb")
  echo "pair $i: A $a ms (vs ceiling $ca)  B $b ms (vs ceiling $cb)  B/A $r  (load $(cut -d' ' -f1 /proc/loadavg))"
done
echo "median B/A over $pairs pairs: $(median_of "${ratios[@]}")  (ratios: ${ratios[*]})"
echo "vs ceiling, median (range): A $(summary_of "${ceil_a[@]}")  B $(summary_of "${ceil_b[@]}")"
