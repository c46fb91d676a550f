#!/usr/bin/env bash
# scripts/check_readme.py, the check .ci/run runs before building: the real README passes it, and
# planted faults in copies of the README fail it, each named on a line of its own:
#   - a cell of 130 characters (the limit is 120),
#   - an unescaped | inside a cell (the row then has 5 cells where the header has 4),
#   - a link to a local file that does not exist,
#   - 23 rows (the limit is 22);
# while an escaped \| inside a cell is allowed.
set -euo pipefail
SRC="${FSDP_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}"
PY="${FSDP_PYTHON:-python3}"
CHECK="$SRC/scripts/check_readme.py"
work="$(mktemp -d /tmp/fsdp-readme-check-XXXXXX)"
trap 'rm -rf "$work"' EXIT
status=0
ok() { echo "ok: $*"; }
bad() { echo "FAIL: $*"; status=1; }

# 1. The real README.
if out="$("$PY" "$CHECK" "$SRC/README.md" 2>&1)"; then
  ok "the README passes: $out"
else
  bad "the README fails the check:"
  echo "$out"
fi

# plant FILE ROWS...: FILE is the README with ROWS inserted right after the feature table's
# separator line (the line after its header).
plant() {
  local file=$1
  shift
  "$PY" - "$SRC/README.md" "$file" "$@" <<'PY'
import sys
src, dst, rows = sys.argv[1], sys.argv[2], sys.argv[3:]
lines = open(src, encoding="utf-8").read().split("\n")
header = next(i for i, l in enumerate(lines)
              if [c.strip().lower() for c in l.strip().strip("|").split("|")] == ["feature", "state", "tested by", "doc"])
lines[header + 2:header + 2] = rows
open(dst, "w", encoding="utf-8").write("\n".join(lines))
PY
}

# 2. Three faults and one escaped pipe in one copy; the copy's links resolve against the tree.
long_cell="$(printf 'x%.0s' $(seq 130))"
plant "$work/bad.md" \
  "| planted long cell | $long_cell | none | none |" \
  "| planted pipe | works | a|b | none |" \
  "| planted escaped pipe | works | a \\| b | none |"
printf '\nSee [the planted link](docs/no-such-file.md).\n' >>"$work/bad.md"
rc=0
out="$("$PY" "$CHECK" "$work/bad.md" --root "$SRC" 2>&1)" || rc=$?
echo "$out" | sed 's/^/    /'
[[ $rc == 1 ]] && ok "the planted copy fails (exit 1)" || bad "the planted copy: exit $rc, expected 1"
expect_line() {  # WHAT PATTERN...: one output line matches all the patterns
  local what=$1 line
  shift
  line="$(echo "$out" | grep -F -- "$1" || true)"
  for p in "${@:2}"; do line="$(echo "$line" | grep -F -- "$p" || true)"; done
  [[ -n $line ]] && ok "$what is named" || bad "$what is not named in the output"
}
expect_line "the 130-character cell" "'planted long cell'" "130 characters"
expect_line "the unescaped pipe" "'planted pipe'" "5 cells"
expect_line "the missing link" "docs/no-such-file.md"
if echo "$out" | grep -qF "'planted escaped pipe'"; then
  bad "an escaped \\| is reported as a problem"
else
  ok "an escaped \\| is allowed"
fi

# 3. Too many rows: the README's table filled up to 23 rows with well-formed ones.
rows="$("$PY" - "$SRC/README.md" <<'PY'
import sys
lines = open(sys.argv[1], encoding="utf-8").read().split("\n")
h = next(i for i, l in enumerate(lines)
         if [c.strip().lower() for c in l.strip().strip("|").split("|")] == ["feature", "state", "tested by", "doc"])
n = 0
for l in lines[h + 2:]:
    if not l.lstrip().startswith("|"):
        break
    n += 1
print(n)
PY
)"
extra=()
for ((i = rows; i < 23; ++i)); do extra+=("| planted row $i | works | none | none |"); done
plant "$work/long.md" "${extra[@]}"
rc=0
out="$("$PY" "$CHECK" "$work/long.md" --root "$SRC" 2>&1)" || rc=$?
echo "$out" | sed 's/^/    /'
[[ $rc == 1 ]] && ok "a 23-row table fails (exit 1)" || bad "a 23-row table: exit $rc, expected 1"
expect_line "the row count" "23 rows, at most 22"

((status == 0)) && echo "PASS: test_readme_check"
exit "$status"
