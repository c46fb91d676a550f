#!/usr/bin/env bash
# The C++ snippets of README.md and of the public headers' comments compile, and the programs
# among them run (scripts/extract_snippets.py says what a snippet is and how each compiles).
#  1. Builds the target `snippets`: it extracts every snippet from the documentation as it is
#     now and compiles it (programs one each, fragments in batches, each in a namespace of its
#     own). A snippet that does not compile fails the test, named by its file and line (the
#     compiler's errors carry the same lines). The target also compiles
#     tests/snippets/deprecated_names.cpp: every deprecated spelling of a renamed public name
#     (CHANGELOG.md) still compiles and equals its replacement.
#  2. Reports how many were compiled and every snippet marked not compiled, with its reason.
#  3. Runs every program in a fresh directory: it must exit 0, and a program that trains with
#     fsdp::trainer::Trainer must show a finite loss (its progress lines or a metrics file)
#     and none that is not finite.
#  4. Runs every Trainer program once more in a wrong launch environment, where fit() throws
#     at once: it must print the library's message without the C++ backtrace and exit non-zero,
#     not abort (lib/wrong_launch_env.sh).
set -euo pipefail
source "$(dirname "$0")/lib/script_test.sh"
source "$(dirname "$0")/lib/wrong_launch_env.sh"
BUILD=$(cd "$BIN/.." && pwd)
LISTING="$BUILD/snippets/snippets.txt"

# -k 0: compile every snippet, so that one failure does not hide another.
if ! cmake --build "$BUILD" --target snippets -- -k 0 > "$WORK/build.out" 2>&1; then
  grep -E "error|FAILED|^extract_snippets" "$WORK/build.out" | head -60 >&2 || true
  if [[ -f "$LISTING" ]]; then
    while IFS=$'\t' read -r kind name origin _; do
      # A program fails as its own object; a fragment in a batch is named by its generated
      # file or by its namespace in the compiler's messages.
      grep -qE "FAILED: .*[/ ]${name}(\.cpp\.o|)( |$)|snippets/${name}\.cpp:|snippet_${name}::" "$WORK/build.out" &&
        echo "FAIL: the snippet at $origin ($kind, $BUILD/snippets/$name.cpp) does not compile" >&2
    done < "$LISTING"
  fi
  echo "FAIL: building the snippets (cmake --build $BUILD --target snippets); the log: $WORK/build.out" >&2
  tail -5 "$WORK/build.out" >&2
  exit 1
fi
[[ -f "$LISTING" ]] || { echo "FAIL: no $LISTING after building the snippets"; exit 1; }

fragments=$(grep -c "^fragment" "$LISTING" || true)
programs=$(grep -c "^program" "$LISTING" || true)
skipped=$(grep -c "^skipped" "$LISTING" || true)
pass "compiled $fragments fragments and $programs programs; $skipped marked not compiled"
pass "compiled the deprecated spellings of renamed names (tests/snippets/deprecated_names.cpp)"
while IFS=$'\t' read -r kind name origin why; do
  [[ "$kind" == skipped ]] && echo "note: not compiled: $origin: $why"
done < "$LISTING"

status=0
while IFS=$'\t' read -r kind name origin _; do
  [[ "$kind" == program ]] || continue
  run="$WORK/run_$name"
  mkdir -p "$run"
  if ! (cd "$run" && timeout 300 "$BUILD/snippets/$name") > "$run/output.txt" 2>&1; then
    tail -20 "$run/output.txt"
    echo "FAIL: the program at $origin ($BUILD/snippets/$name) exited non-zero" >&2
    status=1
    continue
  fi
  if grep -q "Trainer<" "$BUILD/snippets/$name.cpp"; then
    # Progress lines say "loss L"; metrics files hold {"loss": L}.
    if ! "$PY" - "$run" <<'PY'
import glob, math, re, sys
run = sys.argv[1]
text = open(run + "/output.txt", errors="replace").read()
number = r"([-+]?(?:nan|inf|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?))"
losses = [float(v) for v in re.findall(r"\bloss\s+" + number, text, re.I)]
for path in glob.glob(run + "/**/*.jsonl", recursive=True):
    # nlohmann::json writes a NaN or an infinity as null.
    values = re.findall(r'"loss":\s*(null|' + number[1:], open(path).read(), re.I)
    losses += [float("nan") if v == "null" else float(v) for v in values]
bad = [l for l in losses if not math.isfinite(l)]
if not losses or bad:
    print(f"losses seen: {losses[:10]}{' ...' if len(losses) > 10 else ''}; not finite: {bad[:5]}")
    sys.exit(1)
print(f"{len(losses)} finite losses, last {losses[-1]:.6g}")
PY
    then
      tail -20 "$run/output.txt"
      echo "FAIL: the Trainer program at $origin ran but shows no finite loss" >&2
      status=1
      continue
    fi
  fi
  pass "the program at $origin ran (exit 0)"
  if grep -q "Trainer<" "$BUILD/snippets/$name.cpp"; then
    if (cd "$run" && reports_wrong_env "$run/error.txt" "$BUILD/snippets/$name"); then
      pass "the program at $origin reports a wrong launch environment in one message"
    else
      echo "FAIL: the program at $origin does not report the library's error as the README promises" >&2
      status=1
    fi
  fi
done < "$LISTING"

((status == 0)) || exit 1
echo "PASS: test_snippets"
