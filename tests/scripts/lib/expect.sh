# Assertions the launcher tests share. Source after defining fail (each test prints its own
# logs on failure).
#
#   now                        seconds since the epoch, with nanoseconds
#   elapsed_since T            seconds since T (from now), two decimals
#   less_than A B              status 0 when A < B (decimals)
#   expect_eq GOT WANT WHAT    fails "WHAT: expected 'WANT', got 'GOT'"
#   expect_contains FILE S WHAT  fails unless FILE contains the fixed string S

now() { date +%s.%N; }
elapsed_since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }
less_than() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a < b) }'; }
expect_eq() { [[ "$1" == "$2" ]] || fail "$3: expected '$2', got '$1'"; }
expect_contains() { grep -qF -- "$2" "$1" || fail "$3: '$2' not found in $(basename "$1")"; }
