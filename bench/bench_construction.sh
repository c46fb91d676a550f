#!/usr/bin/env bash
# Sharded vs eager construction of a large gpt (issue 15): per-rank resident memory while
# building and wrapping the model ("build peak") and over one training step ("train peak"),
# both above the rank's resident set before the model was built, as fsdp-train's summary
# reports them (tools/fsdp_train/phase_memory.h), next to fsdp-train --estimate-memory's
# construction rows (fsdp::estimate_construction). Default: ~0.5 B parameters (18 blocks of
# width 1536, 510 M parameters, 1.9 GiB of fp32) on 4 ranks, one SGD step on a few hundred
# bytes of text (the evaluation then costs two windows). The eager run holds the whole model
# on every rank: ~4 x 2.2 GiB at once; the script refuses to start with less than
# 1.5 x that available (MemAvailable).
#
#   bench/bench_construction.sh [build/bin] [--layers 18 --dim 1536 --heads 12 --nproc 4]
#
# Prints one JSON line per run and a markdown table (docs/benchmarks.md).
set -euo pipefail
BIN="${1:-build/bin}"
shift || true
LAYERS=18 DIM=1536 HEADS=12 NPROC=4
while [[ $# -gt 0 ]]; do
  case "$1" in
    --layers) LAYERS="$2"; shift 2 ;;
    --dim) DIM="$2"; shift 2 ;;
    --heads) HEADS="$2"; shift 2 ;;
    --nproc) NPROC="$2"; shift 2 ;;
    -h|--help) sed -n 2,15p "$0"; exit 0 ;;
    *) echo "bench_construction.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
TRAIN="$BIN/fsdp-train"
[[ -x "$TRAIN" && -x "$BIN/fsdp-run" ]] || { echo "bench_construction.sh: build fsdp-train and fsdp-run into $BIN" >&2; exit 1; }
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# The arithmetic below: the build's Python (any python3 does).
PY="${FSDP_PYTHON:-python3}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
head -c 400 /usr/share/common-licenses/GPL-3 >"$WORK/text.txt"
MODEL=(--model gpt --layers "$LAYERS" --dim "$DIM" --heads "$HEADS" --context 16 --text "$WORK/text.txt")

"$TRAIN" --estimate-memory "${MODEL[@]}" --nproc "$NPROC" >"$WORK/estimate"
PSI=$(sed -n 's/.*P = \([0-9]*\) parameters.*/\1/p' "$WORK/estimate")
EST_SHARDED=$(awk '/^  sharded \(ShardedInitContext/ {print $4, $5}' "$WORK/estimate")
EST_EAGER=$(awk '/^  eager \(--eager-init\)/ {print $3, $4}' "$WORK/estimate")
need_kib=$(( PSI * 4 * NPROC * 3 / 2 / 1024 + NPROC * 400 * 1024 ))
avail_kib=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)
if (( avail_kib < need_kib )); then
  echo "bench_construction.sh: $((avail_kib / 1024)) MiB available, the eager run needs ~$((need_kib / 1024)) MiB; not started" >&2
  exit 1
fi
echo "gpt: $PSI parameters ($LAYERS blocks of width $DIM), $NPROC ranks; estimate per rank: sharded $EST_SHARDED, eager $EST_EAGER"

ROWS=()
for mode in sharded eager; do
  flag=(); [[ $mode == eager ]] && flag=(--eager-init)
  start=$(date +%s)
  "$TRAIN" "${MODEL[@]}" --batch-size "$NPROC" --steps 1 --optimizer sgd --nproc "$NPROC" "${flag[@]}" \
    >"$WORK/$mode" 2>&1 || { tail -n 20 "$WORK/$mode" >&2; echo "bench_construction.sh: the $mode run failed" >&2; exit 1; }
  secs=$(( $(date +%s) - start ))
  "$PY" - "$WORK/$mode" "$mode" "$secs" "$PSI" "$NPROC" <<'PY'
import json, re, sys
text, mode, secs, psi, n = open(sys.argv[1]).read(), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
mib = lambda s: float(s)
unit = {"B": 2**-20, "KiB": 2**-10, "MiB": 1, "GiB": 1024}
def to_mib(v, u): return float(v) * unit[u]
rows = re.findall(r"^\[rank0\]:\s+(\d+)\s+.*?([\d.]+) (B|KiB|MiB|GiB)\s+([\d.]+) (B|KiB|MiB|GiB)\s*$", text, re.M)
assert len(rows) == n, f"{len(rows)} summary rows"
build = [round(to_mib(r[1], r[2]), 1) for r in rows]
train = [round(to_mib(r[3], r[4]), 1) for r in rows]
m = re.search(r"construction peak ([\d.]+) MiB above the resident set before it, peak RSS so far ([\d.]+) MiB", text)
run = re.search(r"peak RSS over the run ([\d.]+) MiB", text)
print(json.dumps({"bench": "construction", "mode": mode, "params": psi, "ranks": n, "build_peak_mib": build,
                  "train_peak_mib": train, "rank0_rss_after_build_mib": float(m.group(2)),
                  "rank0_rss_run_peak_mib": float(run.group(1)), "seconds": secs}))
PY
done | tee "$WORK/json"
"$PY" - "$WORK/json" <<'PY'
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print("\n| construction | build peak per rank (MiB above start) | train peak per rank (MiB above start) | rank 0 peak RSS after build | rank 0 peak RSS over the run |")
print("| --- | --- | --- | --- | --- |")
for r in runs:
    print(f"| {r['mode']} | {', '.join(map(str, r['build_peak_mib']))} | {', '.join(map(str, r['train_peak_mib']))} | "
          f"{r['rank0_rss_after_build_mib']} MiB | {r['rank0_rss_run_peak_mib']} MiB |")
PY
