#!/usr/bin/env bash
# Measurement, not a test (not run by ctest): FSDP across 2 simulated hosts x 2 ranks
# (tests/scripts/lib/sim_hosts.sh) with each host's outgoing link capped by tbf, against the
# link's calibrated rate and the compute-only step. Prints a table and one JSON line per row.
#
#   FSDP_BIN_DIR=build/bin bash bench/measure_multihost.sh [RATE...]   (default: 100mbit 1gbit)
#   env: SHORT=3 LONG=13 (fsdp-train steps of the two runs), STRATEGIES="hybrid_shard full_shard
#        no_shard", BENCH=1 (0: skip bench_strategies and bench_collectives across the hosts),
#        BENCH_MODELS="mlp transformer" (bench_strategies' models)
#
# Per RATE ("none": uncapped):
#   link     a plain TCP stream each way at once for 4 s (bench/tcp_stream.py): payload
#            bytes per second each direction delivers (the receiver's count, first 0.5 s left out)
#   fsdp-train's mlp (hidden 512, global batch 64, Adam), per strategy a run of SHORT and of LONG
#            steps: bytes per step on the link = the difference of host 1's veth counters / (LONG -
#            SHORT), less an idle job's rate (launchers connected, ranks asleep) over the time
#            difference; payload = bytes - packets x header (tests/scripts/lib/link_traffic.py);
#            step = rank 0's median step time over steps 3..LONG of the long run (--metrics)
#   link bound  max over the two directions of payload per step / that direction's calibrated rate
#   compute-only step  four independent 1-rank fsdp-train processes (--batch-size 16: each rank's
#            slice; --nproc 1, so no communication at all) at the same time on the same cores: the
#            largest of their median step times. Every rank's forward, backward and optimizer
#            (over the whole model: a sharded rank's optimizer does 1/4 of that). 150 steps each, so
#            that the four overlap for most of their steps even when their start-ups differ by seconds.
#   target   step <= 1.25 x max(compute-only step, link bound) (issue 13)
#   BENCH=1  bench_strategies' rank mode across the hosts per model (its mlp 784-1024-1024-10, batch
#            128, one unit per Linear, the first Linear 43% of the bytes and reduced last; its
#            transformer, one unit per block and projection) and strategy: compute-only = its ceiling (forward + backward of
#            the plain model, every rank at once) + its optimizer over the owned parameters, both
#            measured in the same rank processes, every rank at once; bytes per step ~= the run's
#            counters / the FSDP steps it ran (start-up included); and bench_collectives at 1 MiB.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
# The multi-host tests' two simulated hosts (tests/scripts/lib).
TESTS_LIB="$HERE/../tests/scripts/lib"
# shellcheck source=../tests/scripts/lib/two_hosts.sh
source "$TESTS_LIB/two_hosts.sh"
RATES=("$@")
((${#RATES[@]})) || RATES=(100mbit 1gbit)
SHORT="${SHORT:-3}"
LONG="${LONG:-13}"
read -r -a STRATS <<<"${STRATEGIES:-hybrid_shard full_shard no_shard}"
BENCH="${BENCH:-1}"
read -r -a BENCH_MODELS <<<"${BENCH_MODELS:-mlp transformer}"
require_tools fsdp-run fsdp-train
[[ "$BENCH" == 1 ]] && require_tools bench_strategies bench_collectives
HIDDEN=512
HEADER="$(tcp_header_bytes)"
RECS="$WORK/records.jsonl"
: >"$RECS"

counters() { sim_host_counters 1 | tr ' ' ','; }

# measured NAME KIND EXTRA_JSON CMD...: two_host_job NAME with host 1's counters and the wall time around it.
measured() {
  local name="$1" kind="$2" extra="$3" c0 t0
  shift 3
  c0="$(counters)" t0="$(now)"
  two_host_job "$name" "$@"
  echo "{\"kind\": \"$kind\", \"name\": \"$name\", $extra \"before\": [$c0], \"after\": [$(counters)], \"seconds\": $(seconds_since "$t0")}" >>"$RECS"
}

idle_window 1.5 6 counters >>"$RECS"

# Compute-only: 4 independent 1-rank processes at once, no communication.
pids=()
for i in 0 1 2 3; do
  "$BIN/fsdp-train" --nproc 1 --strategy no_shard --hidden $HIDDEN --batch-size 16 --steps 150 --no-shuffle \
    --metrics "$WORK/compute.$i.jsonl" >"$WORK/compute.$i.out" 2>&1 &
  pids+=($!)
done
wait "${pids[@]}" || fail "a compute-only process failed: $(tail -n 5 "$WORK"/compute.*.out)"
echo "{\"kind\": \"compute\", \"metrics\": [\"$WORK/compute.0.jsonl\", \"$WORK/compute.1.jsonl\", \"$WORK/compute.2.jsonl\", \"$WORK/compute.3.jsonl\"]}" >>"$RECS"

for rate in "${RATES[@]}"; do
  sim_host_rate 0 "$rate"
  sim_host_rate 1 "$rate"
  # Calibration: a stream each way at once, as the collectives use the link.
  for i in 0 1; do
    sim_host_run "$i" "$PY" "$HERE/tcp_stream.py" serve 29600 >"$WORK/cal.$rate.h$i.json" &
    pids[i]=$!
  done
  sleep 0.5
  sim_host_run 0 "$PY" "$HERE/tcp_stream.py" send "${SIM_ADDR[1]}" 29600 4 &
  s0=$!
  sim_host_run 1 "$PY" "$HERE/tcp_stream.py" send "${SIM_ADDR[0]}" 29600 4
  wait "$s0" "${pids[0]}" "${pids[1]}" || fail "the calibration stream at $rate failed"
  # Host 1 receives what host 0 sends (host 1's rx direction) and the other way round.
  echo "{\"kind\": \"link\", \"rate\": \"$rate\", \"rx\": $(cat "$WORK/cal.$rate.h1.json"), \"tx\": $(cat "$WORK/cal.$rate.h0.json")}" >>"$RECS"

  for strategy in "${STRATS[@]}"; do
    for steps in "$SHORT" "$LONG"; do
      measured "train.$rate.$strategy.$steps" run "\"rate\": \"$rate\", \"strategy\": \"$strategy\", \"steps\": $steps, \"metrics\": \"$WORK/train.$rate.$strategy.$steps.jsonl\"," \
        "$BIN/fsdp-train" --strategy "$strategy" --hidden $HIDDEN --steps "$steps" --no-shuffle --timeout 120 \
        --metrics "$WORK/train.$rate.$strategy.$steps.jsonl"
    done
  done
  if [[ "$BENCH" == 1 ]]; then
    for model in "${BENCH_MODELS[@]}"; do
      for strategy in "${STRATS[@]}"; do
        group=()
        [[ $strategy == hybrid_shard ]] && group=(--shard-group 2)
        # 1 warm-up step + steps x rounds timed (fewer on the slow link, where a step takes seconds).
        bsteps=10 brounds=2
        [[ $rate == 100mbit ]] && bsteps=4 brounds=1
        name="bench.$rate.$model.$strategy"
        measured "$name" bench "\"rate\": \"$rate\", \"model\": \"$model\", \"strategy\": \"$strategy\", \"fsdp_steps\": $((1 + bsteps * brounds))," \
          "$BIN/bench_strategies" --model "$model" --strategy "$strategy" "${group[@]}" --optim adam --steps $bsteps \
          --warmup 1 --rounds $brounds
        line="$(sed -n 's/^\[rank0\]: \({.*}\)$/\1/p' "$WORK/$name.h0.out" | tail -n 1)"
        [[ -n "$line" ]] || fail "bench_strategies $model $strategy printed no JSON line"
        echo "{\"kind\": \"bench_result\", \"name\": \"$name\", \"result\": $line}" >>"$RECS"
      done
    done
    measured "collectives.$rate" collectives "\"rate\": \"$rate\"," \
      "$BIN/bench_collectives" --sizes-mb 1 --reps-small 5 --warmup 1
    echo "bench_collectives across the hosts at $rate:"
    sed -n 's/^\[rank0\]: //p' "$WORK/collectives.$rate.h0.out" | grep -v '^{'
    sed -n 's/^\[rank0\]: \({.*}\)$/{"rate": "'"$rate"'", "bench_collectives": \1}/p' "$WORK/collectives.$rate.h0.out"
  fi
done

echo "load average: $(cat /proc/loadavg) (the machine is shared: times are upper bounds)"
"$PY" "$TESTS_LIB/link_traffic.py" report "$RECS" $HIDDEN "$HEADER"
