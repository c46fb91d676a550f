# Sourced by the tests that run a program a user would copy (test_snippets.sh, test_examples.sh)
# once in a wrong environment: RANK and WORLD_SIZE set as torchrun sets them, MASTER_ADDR not.
# The library then throws as soon as the program joins the launcher (init_process_group, or
# Trainer::fit), before it waits for any other rank, and the program is to report that error
# the way the README's program does: the library's message, no C++ backtrace, a non-zero exit.
#
#   reports_wrong_env OUT CMD...   runs CMD in the current directory with that environment, its
#                                  output in OUT; 0 when the report is as above, otherwise it
#                                  prints the output's tail and why, and returns 1

reports_wrong_env() {
  local out=$1 rc=0
  shift
  env -u MASTER_ADDR -u MASTER_PORT RANK=0 WORLD_SIZE=1 timeout 120 "$@" < /dev/null > "$out" 2>&1 || rc=$?
  # 134 is an abort (an exception nobody caught), 124 the timeout, above 128 another signal.
  local why=""
  if ((rc == 0 || rc >= 124)); then
    why="exited $rc, expected a non-zero status below 124"
  elif ! grep -q "MASTER_ADDR is not" "$out"; then
    why="printed no library message naming MASTER_ADDR"
  elif grep -qE "Exception raised from|frame #[0-9]" "$out"; then
    why="printed a C++ backtrace"
  fi
  [[ -z "$why" ]] && return 0
  tail -20 "$out"
  echo "FAIL: $*, started with RANK and WORLD_SIZE but no MASTER_ADDR, $why" >&2
  return 1
}
