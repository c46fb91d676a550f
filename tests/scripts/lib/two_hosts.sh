# The common start of the scripts that run jobs on 2 simulated hosts x 2 ranks
# (test_multihost.sh, test_multihost_elastic.sh, test_multihost_traffic.sh, test_multihost_faults.sh,
# and the measurements bench/*_multihost.sh).
# Source it right after `set -euo pipefail`. It needs root (sim_hosts_require: SKIP otherwise,
# FAIL under CI=true), then gives lib/script_test.sh's BIN, WORK, fail, pass, now, ..., the two
# hosts (lib/sim_hosts.sh: SIM_ADDR, sim_host_run, counters, ...), and
#   PORT                          the master port: each host has its own network stack, so a
#                                 fixed port collides with nothing
#   two_host_job NAME CMD...      CMD under one `fsdp-run --nnodes 2 --nproc 2` per host, waited for
#   idle_window LEAD WINDOW CMD   the traffic of a job that does nothing, as a JSON record
#   seconds_since T0 [T1]         T1 (default: now) - T0, for `now`'s values
#   tcp_header_bytes              bytes of one packet's headers on the link (Ethernet + IPv4 + TCP
#                                 + timestamps when on)
#   tcp_mss                       the most TCP payload one segment on host 1's link carries
# No GLOO_SOCKET_IFNAME: every rank must find the address that reaches MASTER_ADDR itself.

_two_hosts_lib="$(dirname "${BASH_SOURCE[0]}")"
# shellcheck source=sim_hosts.sh
source "$_two_hosts_lib/sim_hosts.sh"
sim_hosts_require
# shellcheck source=script_test.sh
source "$_two_hosts_lib/script_test.sh"
sim_hosts_create 2
unset GLOO_SOCKET_IFNAME
PORT=29500

# two_host_job NAME CMD...: one `fsdp-run --nnodes 2 --nproc 2 -- CMD` per host, output in
# $WORK/NAME.h<i>.out, waited for; fails naming the host whose launcher failed. Host 0 starts
# 0.3 s ahead, so host 1's launcher and ranks find their listeners up, with no refused
# connection attempts to vary between runs (their bytes would count on the link).
two_host_job() {
  local name="$1" i pids=()
  shift
  for i in 0 1; do
    sim_host_run "$i" "$BIN/fsdp-run" --nnodes 2 --node-rank "$i" --master-addr "${SIM_ADDR[0]}" \
      --master-port "$PORT" --nproc 2 -- "$@" >"$WORK/$name.h$i.out" 2>&1 &
    pids+=($!)
    ((i == 0)) && sleep 0.3
  done
  for i in 0 1; do wait "${pids[i]}" || fail "$name: the launcher on host $i failed"; done
}

# idle_window LEAD WINDOW COUNTERS_CMD: a job whose launchers connect and whose ranks sleep;
# prints {"kind": "idle", "before": [C0], "after": [C1], "seconds": S}, C0 and C1 being
# COUNTERS_CMD's output (comma-separated numbers) LEAD s after the start and S (~WINDOW) s later.
# What runs for as long as any job does (the launchers' keepalives, neighbour discovery) is
# then subtracted pro rata from the jobs' counts.
idle_window() {
  local lead="$1" window="$2" counters="$3" i pids=() c0 c1 t0 t1
  for i in 0 1; do
    sim_host_run "$i" "$BIN/fsdp-run" --nnodes 2 --node-rank "$i" --master-addr "${SIM_ADDR[0]}" \
      --master-port "$PORT" --nproc 2 -- sleep "$(awk -v a="$lead" -v b="$window" 'BEGIN { print a + b + 0.5 }')" \
      >"$WORK/idle.h$i.out" 2>&1 &
    pids+=($!)
  done
  sleep "$lead"
  c0="$($counters)" t0="$(now)"
  sleep "$window"
  c1="$($counters)" t1="$(now)"
  for i in 0 1; do wait "${pids[i]}" || fail "idle: the launcher on host $i failed"; done
  echo "{\"kind\": \"idle\", \"before\": [$c0], \"after\": [$c1], \"seconds\": $(seconds_since "$t0" "$t1")}"
}

seconds_since() { awk -v a="$1" -v b="${2:-$(now)}" 'BEGIN { print b - a }'; }

tcp_header_bytes() {
  [[ "$(ip netns exec "$(sim_ns 1)" cat /proc/sys/net/ipv4/tcp_timestamps)" == 1 ]] && echo 66 || echo 54
}

# MTU less the IPv4 and TCP headers (tcp_header_bytes without Ethernet's 14).
tcp_mss() { echo $(($(ip netns exec "$(sim_ns 1)" cat /sys/class/net/eth0/mtu) - $(tcp_header_bytes) + 14)); }
