#!/usr/bin/env bash
# Planted faults across two simulated hosts x 2 ranks (tests/scripts/lib/two_hosts.sh), one
# `fsdp-run --nnodes 2` per host running dist_smoke (all_reduce #1, all_gather #2,
# reduce_scatter #3 on the world group, which spans the hosts: Gloo over TCP; at N=4 its small
# all-gathers and reduce-scatters go through Gloo's alltoall). The records cross the hosts
# through the store:
#   1. rank 1 (host 0) runs the all-reduce twice (an extra micro-batch), unchecked, timeout
#      3 s: both launchers fail and each host prints the divergence once (fsdp-run's filter),
#      naming rank 1 at all_reduce #2 against ranks 0, 2, 3 at all_gather #2.
#   2. rank 3 (host 1) skips the all-gather, unchecked: its reduce-scatter meets the others'
#      all-gather in Gloo's alltoall with the same bytes; the rows' headers stop it (a rank
#      names the sender of a reduce_scatter row where it is at all_gather) and each host prints
#      the divergence once. (On one host, shared memory's slot headers do the same:
#      test_fsdp_run.sh.)
#   3. the same, checked (FSDP_CHECK_COLLECTIVES=1, timeout 30 s): every rank on both hosts
#      fails at once naming rank 3 at reduce_scatter #2 against the others' all_gather #2.
#   4. rank 3 gathers twice as many elements (a wider model), checked: named with both sizes.
#      (Unchecked, Gloo aborts the receiving ranks inside its own thread: "Received data size
#      doesn't match expected size".)
# Each job's wall time includes starting 4 ranks and their rendezvous, so the bounds are the
# issue's (timeout + 5 s; checked: 5 s) plus 5 s for that.
# Needs root (namespaces): as another user it prints SKIP; under CI=true it fails instead.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=lib/two_hosts.sh
source "$HERE/lib/two_hosts.sh"
require_tools fsdp-run dist_smoke
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

# fault NAME ENV ARGS...: `dist_smoke ARGS` under one fsdp-run per host with the variable ENV
# (NAME=VALUE) on both; output in $WORK/NAME.h<i>.out. Sets RCS ("rc0 rc1") and ELAPSED (s).
fault() {
  local name="$1" env="$2" i pids=() rc t0
  shift 2
  t0="$(now)"
  for i in 0 1; do
    sim_host_run "$i" env "$env" "$BIN/fsdp-run" --nnodes 2 --node-rank "$i" --master-addr "${SIM_ADDR[0]}" \
      --master-port "$PORT" --nproc 2 -- "$BIN/dist_smoke" "$@" >"$WORK/$name.h$i.out" 2>&1 &
    pids+=($!)
    ((i == 0)) && sleep 0.3
  done
  RCS=""
  for i in 0 1; do
    rc=0
    wait "${pids[i]}" || rc=$?
    RCS="${RCS:+$RCS }$rc"
  done
  ELAPSED="$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')"
  [[ "${RCS%% *}" != 0 && "${RCS##* }" != 0 ]] || fail "$name: launcher exit codes $RCS, expected both non-zero"
}
# within NAME LIMIT: the job ended within LIMIT s.
within() { awk -v e="$ELAPSED" -v l="$2" 'BEGIN { exit !(e < l) }' || fail "$1: took $ELAPSED s (limit $2 s)"; }
# on_each_host NAME PATTERN [COUNT]: each host's output has COUNT (default: at least 1) lines
# matching the extended regular expression PATTERN.
on_each_host() {
  local i n
  for i in 0 1; do
    n="$(grep -cE "$2" "$WORK/$1.h$i.out" || true)"
    if [[ -n "${3:-}" ]]; then
      [[ "$n" == "$3" ]] || fail "$1: host $i has $n lines matching '$2', expected $3"
    else
      ((n >= 1)) || fail "$1: host $i has no line matching '$2'"
    fi
  done
}

CHECK="fsdp: collective check \(FSDP_CHECK_COLLECTIVES\) on group 'world', rank"

fault extra FSDP_CHECK_COLLECTIVES=0 --extra-rank 1 --timeout-ms 3000
within extra $((3 + 5 + 5))
on_each_host extra "collective record \(rank [0-3]\): " 1
on_each_host extra "collective record \(rank [0-3]\): on group 'world': rank 1 is at all_reduce #2 \(unlabelled\) while ranks 0, 2, 3 are at all_gather #2 \(unlabelled\)$"
pass "rank 1 on host 0 runs an extra all-reduce: both hosts stopped in $ELAPSED s, each printing the divergence once"

fault skip FSDP_CHECK_COLLECTIVES=0 --skip-rank 3 --timeout-ms 3000
within skip $((3 + 5 + 5))
! grep -qE "element [0-9]+ is [0-9.]+, expected" "$WORK"/skip.h*.out || fail "skip: a rank read wrong values"
grep -qE "rank 3 \[pid [0-9]+ on [^]]+\] sent a row of its reduce_scatter of 64 bytes where this rank is at all_gather of 64 bytes" \
  "$WORK"/skip.h*.out || fail "skip: no rank named rank 3's reduce_scatter row"
on_each_host skip "collective record \(rank [0-3]\): " 1
on_each_host skip "collective record \(rank [0-3]\): on group 'world': rank 3 is at reduce_scatter #2 \(unlabelled\) while ranks 0, 1, 2 are at all_gather #2 \(unlabelled\)$"
pass "rank 3 on host 1 skips the all-gather, unchecked: the alltoall rows' headers named its reduce-scatter, each host printing the divergence once ($ELAPSED s)"

fault skipchecked FSDP_CHECK_COLLECTIVES=1 --skip-rank 3 --timeout-ms 30000
within skipchecked $((5 + 5))
on_each_host skipchecked "$CHECK [0-3]: rank 3 is at reduce_scatter #2 \(unlabelled\) while ranks 0, 1, 2 are at all_gather #2 \(unlabelled\)$"
pass "the same, checked: both hosts stopped in $ELAPSED s naming rank 3 at reduce_scatter #2"

fault wide FSDP_CHECK_COLLECTIVES=1 --wide-rank 3 --timeout-ms 30000
within wide $((5 + 5))
on_each_host wide "$CHECK [0-3]: ranks disagree at all_gather #2 \(unlabelled\): rank 3 has 32 elements, the others 16"
pass "rank 3 on host 1 gathers twice as many elements, checked: both hosts stopped in $ELAPSED s naming both sizes"
echo "all multihost fault checks passed"
