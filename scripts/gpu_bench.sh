#!/usr/bin/env bash
# Benchmarks on a GPU machine (the same setup as scripts/gpu_check.sh: its preinstalled
# PyTorch, every other dependency from scripts/gather_gpu_deps.sh's folder; docs/gpu.md).
# Builds only the benchmarks and fsdp-run, then runs bench_strategies' rows one at a time in
# rank mode under fsdp-run (the configurations bench_strategies' launcher mode runs, in the same
# order), each under a time limit, until the budget is spent; then Python DDP (bench/
# ddp_baseline.py: DDP, DDP + ZeRO, FSDP2) under the machine's torch, as bench_strategies does
# under $FSDP_PYTHON.
#
#   bash scripts/gpu_bench.sh
#   GPU_BENCH_GPT=1 bash scripts/gpu_bench.sh     # only the one-GPU GPT benchmarks (below)
#
# GPU_BENCH_GPT=1 runs only the one-GPU GPT benchmarks instead of the rows above, building
# bench_gpu_gpt once (tests and fsdp-run left out), each program under BENCH_GPT_TIMEOUT_S (240 s):
#   speed    bench_gpu_gpt (a ~1.3 B GPT, plain libtorch against FSDP FULL_SHARD at one rank over
#            NCCL, alternating in one process), then bench/fsdp2_gpt.py (plain PyTorch against
#            FSDP2, the same model and data), with BENCH_GPT_ARGS (default "--steps 10 --warmup 2
#            --rounds 3"; "--tiny" for a smoke run);
#   offload  bench_gpu_gpt --modes offload,offload_auto against fsdp2_gpt.py --modes fsdp2_offload
#            (CPU offload), with BENCH_GPT_OFFLOAD_ARGS (default "--steps 3 --warmup 1 --rounds 1":
#            FSDP2's offloaded step takes seconds).
# BENCH_GPT_PARTS (default "speed offload") picks the parts. The ratios (FSDP/plain, FSDP/FSDP2,
# the two plain baselines, offload against FSDP2's) go into summary.txt and bench.jsonl.
#
# Environment (optional), besides gpu_check.sh's OUT, FSDP_GPU_DEPS, FSDP_PYTHON, BUILD_DIR,
# JOBS and GPU_CUDA_ARCH: BENCH_MODELS (default "mlp transformer"), BENCH_STEPS (30),
# BENCH_WARMUP (5), BENCH_CPU_ADAM (1: the CPUAdam rows too), BENCH_PYTHON (1: the Python DDP
# rows), BENCH_ROW_TIMEOUT_S (90), GPU_BENCH_BUDGET_S (the whole run, default 480 s),
# GPU_BENCH_GPT=1 (BENCH_GPT_PARTS, BENCH_GPT_ARGS, BENCH_GPT_OFFLOAD_ARGS, BENCH_GPT_TIMEOUT_S),
# GPU_BENCH_SKIP_BUILD=1 (run what BUILD_DIR/bin already holds, e.g. after gpu_check.sh with
# BUILD_DIR=build-gpu: no configure, no build).
#
# Results in the results folder: summary.txt (machine, versions, stage times, one line per row
# with its step time), configure.log, build.log, bench.log (every row's command and output),
# bench.jsonl (the JSON line of each row that finished: bench_strategies' keys, docs/benchmarks.md).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
BUDGET=${GPU_BENCH_BUDGET_S:-480}
MODELS=${BENCH_MODELS:-mlp transformer}
STEPS=${BENCH_STEPS:-30}
WARMUP=${BENCH_WARMUP:-5}
ROW_TIMEOUT=${BENCH_ROW_TIMEOUT_S:-90}
GPT_ONLY=${GPU_BENCH_GPT:-0}
GPT_PARTS=${BENCH_GPT_PARTS:-speed offload}
: >"$SUMMARY"
rm -f "$RESULTS"/{configure.log,build.log,bench.log,bench.jsonl}
touch "$RESULTS/bench.jsonl" "$RESULTS/bench.log"

finish() {
  rm -f "$RESULTS/.nvidia-smi.txt"
  cap_log "$RESULTS/build.log"
  cap_log "$RESULTS/bench.log"
  note "time total        $((SECONDS - T0)) s (budget $BUDGET s)"
  exit "$1"
}

if [[ "$GPT_ONLY" == 1 ]]; then
  note "fsdp-cpp gpu_bench: the one-GPU GPT benchmarks ($GPT_PARTS: bench_gpu_gpt, bench/fsdp2_gpt.py) against $PY's torch, budget ${BUDGET}s"
  for part in $GPT_PARTS; do
    [[ "$part" =~ ^(speed|offload)$ ]] || { note "BENCH_GPT_PARTS: unknown part '$part' (speed, offload)"; finish 1; }
  done
else
  note "fsdp-cpp gpu_bench: bench_strategies rows against $PY's torch, budget ${BUDGET}s"
fi
stage machine - gpu_collect_machine_info
stage deps - gpu_env_setup || finish 1
if [[ "${GPU_BENCH_SKIP_BUILD:-0}" == 1 ]]; then
  note "== build: skipped (GPU_BENCH_SKIP_BUILD=1), using $BUILD/bin as it is"
else
  note "== configure"
  # The tests stay out (no GoogleTest needed, a shorter configure); the tools stay in (fsdp-run).
  stage configure - gpu_configure -DFSDP_BUILD_TESTS=OFF || { tail -30 "$RESULTS/configure.log"; finish 1; }
  note "== build"
  targets=(fsdp-run)
  for src in "$FSDP_ROOT"/bench/bench_*.cpp; do targets+=("$(basename "$src" .cpp)"); done
  # The GPT benchmarks run one process each, without fsdp-run: one build serves every part.
  [[ "$GPT_ONLY" == 1 ]] && targets=(bench_gpu_gpt)
  stage build "$RESULTS/build.log" cmake --build "$BUILD" -j "$JOBS" --target "${targets[@]}" || {
    grep -m 15 -E 'error:|FAILED:|undefined reference' "$RESULTS/build.log" | cut -c1-300 | sed 's/^/  /' | tee -a "$SUMMARY"
    finish 1
  }
fi
BIN=$BUILD/bin

[[ "$GPT_ONLY" == 1 ]] || note "== bench_strategies rows (steps $STEPS, warmup $WARMUP, each row at most ${ROW_TIMEOUT}s)"
# nproc strategy optim prefetch shard_group bucket_mb transport: bench_strategies.cpp's
# launcher_main() list, in its order.
rows=(
  "2 no_shard adam default 0 0 shm"
  "2 no_shard adam default 0 25 shm"
  "2 shard_grad_op adam default 0 0 shm"
  "2 full_shard adam default 0 0 shm"
  "2 full_shard adam fwd 0 0 shm"
  "2 full_shard adam none 0 0 shm"
  "2 full_shard adam default 0 4 shm"
  "4 hybrid_shard adam default 2 0 shm"
  "4 hybrid_shard adam default 2 25 shm"
  "2 zero1 adam default 0 0 shm"
  "2 zero2 adam default 0 0 shm"
)
if [[ "${BENCH_CPU_ADAM:-1}" == 1 ]]; then
  rows+=("2 no_shard cpuadam default 0 0 shm" "2 full_shard cpuadam default 0 0 shm" "2 zero2 cpuadam default 0 0 shm")
fi
rows+=("2 no_shard adam default 0 0 tcp" "2 full_shard adam default 0 0 tcp")

out_of_time=0
# run_row LABEL CMD...: one row under the row limit, its JSON line into bench.jsonl.
run_row() {
  local label=$1 t=$SECONDS rc=0 left
  shift
  left=$((BUDGET - (SECONDS - T0) - 5))
  if ((left < 10)); then
    out_of_time=1
    note "$(printf '  %-44s not run: budget spent' "$label")"
    return
  fi
  ((left > ROW_TIMEOUT)) && left=$ROW_TIMEOUT
  echo "### $label: $*" >>"$RESULTS/bench.log"
  timeout --kill-after=5 "$left" "$@" >"$RESULTS/.row.out" 2>&1 || rc=$?
  cat "$RESULTS/.row.out" >>"$RESULTS/bench.log"
  local json
  json=$(sed -n 's/^\(\[rank0\]: \)\{0,1\}\({.*}\)$/\2/p' "$RESULTS/.row.out")
  [[ -n "$json" ]] && echo "$json" >>"$RESULTS/bench.jsonl"
  local ms
  ms=$(echo "$json" | sed -n 's/.*"step_ms": \([0-9.]*\).*/\1/p' | head -1)
  note "$(printf '  %-44s %s  (%d s, exit %d%s)' "$label" "${ms:+$ms ms/step}" $((SECONDS - t)) "$rc" \
    "$( ((rc == 124 || rc == 137)) && echo ', row time limit')")"
  rm -f "$RESULTS/.row.out"
}

if [[ "$GPT_ONLY" == 1 ]]; then
  ROW_TIMEOUT=${BENCH_GPT_TIMEOUT_S:-240}
  for part in $GPT_PARTS; do
    t_part=$SECONDS
    case $part in
      speed)
        read -r -a gpt_args <<<"${BENCH_GPT_ARGS:---steps 10 --warmup 2 --rounds 3}"
        note "== the one-GPU GPT benchmark, speed (${gpt_args[*]}; each program at most ${ROW_TIMEOUT}s)"
        run_row "gpt PLAIN,FULL_SHARD (C++, NCCL N=1)" "$BIN/bench_gpu_gpt" "${gpt_args[@]}"
        run_row "gpt PYTHON_PLAIN,PYTHON_FSDP2" "$PY" "$FSDP_ROOT/bench/fsdp2_gpt.py" "${gpt_args[@]}"
        ;;
      offload)
        read -r -a gpt_args <<<"${BENCH_GPT_OFFLOAD_ARGS:---steps 3 --warmup 1 --rounds 1}"
        note "== the one-GPU GPT benchmark, CPU offload (${gpt_args[*]}; each program at most ${ROW_TIMEOUT}s)"
        run_row "gpt FULL_SHARD_OFFLOAD[_AUTO] (C++, CPUAdam)" "$BIN/bench_gpu_gpt" "${gpt_args[@]}" --modes offload,offload_auto
        run_row "gpt PYTHON_FSDP2_OFFLOAD" "$PY" "$FSDP_ROOT/bench/fsdp2_gpt.py" "${gpt_args[@]}" --modes fsdp2_offload
        ;;
    esac
    note "$(printf 'time %-12s %4d s  (at %d s)' "gpt-$part" $((SECONDS - t_part)) $((SECONDS - T0)))"
  done
  # Per mode: step time, tokens/s, peak; then the targets (ratios of tokens/s, medians).
  "$PY" "$FSDP_ROOT/scripts/gpu_bench_gpt_summary.py" "$RESULTS/bench.jsonl" | tee -a "$SUMMARY"
  finish 0
fi

t_rows=$SECONDS
for m in $MODELS; do
  for r in "${rows[@]}"; do
    read -r n strategy optim prefetch g bucket transport <<<"$r"
    label="$m $strategy $optim prefetch=$prefetch g=$g bucket=$bucket $transport N=$n"
    env_prefix=()
    [[ $transport == tcp ]] && env_prefix=(env FSDP_SHARED_MEMORY=0)
    run_row "$label" "${env_prefix[@]}" "$BIN/fsdp-run" --nproc "$n" -- "$BIN/bench_strategies" \
      --model "$m" --strategy "$strategy" --optim "$optim" --prefetch "$prefetch" --shard-group "$g" \
      --bucket-mb "$bucket" --steps "$STEPS" --warmup "$WARMUP"
  done
  if [[ "${BENCH_PYTHON:-1}" == 1 ]]; then
    for extra in "" --zero --fsdp2; do
      case "$extra" in --zero) label=python_ddp+zero ;; --fsdp2) label=python_fsdp2 ;; *) label=python_ddp ;; esac
      run_row "$m $label N=2" env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "$PY" "$FSDP_ROOT/bench/ddp_baseline.py" \
        --model "$m" --world 2 --steps "$STEPS" --warmup "$WARMUP" $extra
    done
  fi
done
note "$(printf 'time %-12s %4d s  (at %d s)' rows $((SECONDS - t_rows)) $((SECONDS - T0)))"
note "rows finished: $(wc -l <"$RESULTS/bench.jsonl")$( ((out_of_time)) && echo ' (the budget ran out: raise GPU_BENCH_BUDGET_S or lower BENCH_STEPS)')"
finish 0
