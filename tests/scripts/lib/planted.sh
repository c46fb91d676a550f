# shellcheck shell=bash
# For the tests of a check (scripts/check_*.py): the check must fail on a planted fault, naming it.
# Source it after setting status=0, which expect_fails sets to 1 on a failure.
#
#   expect_fails WHAT EXPECTED CMD...   runs CMD (the check on a planted copy); prints "ok: WHAT:"
#                                       and the output line containing EXPECTED when CMD fails with
#                                       such a line; otherwise a FAIL line (and CMD's output) and
#                                       sets status=1

# shellcheck disable=SC2034  # status belongs to the sourcing test
expect_fails() {
  local what=$1 expected=$2 out
  shift 2
  if out=$("$@" 2>&1); then
    echo "FAIL: the check passes $what"
    status=1
  elif grep -qF "$expected" <<<"$out"; then
    echo "ok: $what: $(grep -F "$expected" <<<"$out" | head -1)"
  else
    echo "FAIL: $what: the check fails without saying '$expected':"
    echo "$out"
    status=1
  fi
}
