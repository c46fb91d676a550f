# shellcheck shell=bash
# Simulated hosts for script tests: K "hosts" on this machine, each with its own network
# namespace (one veth "eth0" joined to a bridge that lives in a namespace of its own), its
# own hostname (UTS namespace) and its own tmpfs on /dev/shm (mount namespace), so Gloo must
# use TCP between hosts and shared memory can only pair ranks of the same host.
#
#   source tests/scripts/lib/sim_hosts.sh
#   sim_hosts_require           # SKIP (exit 77, which ctest counts as skipped) as a non-root user, FAIL under
#                               # CI=true or FSDP_REQUIRE_GPU=1 (lib/skip.sh)
#   sim_hosts_create 2          # hosts 0..1, addresses in SIM_ADDR[i]; removed at exit
#   sim_host_run 0 cmd args...  # runs cmd "on" host 0 (foreground; add & to background)
#   sim_host_bytes 0            # bytes sent + received by host 0's link so far
#   sim_host_counters 0         # "tx_bytes rx_bytes tx_packets rx_packets" of host 0's link
#   sim_host_retransmits 0      # TCP segments host 0 has retransmitted so far
#   sim_host_link 1 down        # cut host 1 off (up: reconnect)
#   sim_host_rate 1 100mbit     # cap host 1's outgoing rate with tbf (none: remove the cap)
#
# Names carry this shell's pid and a random tag, so parallel runs never collide and a crashed
# run's namespaces are never reused: sim_hosts_create removes those whose creator is gone.
# Only the namespaces made here carry traffic; the root namespace gets no address or route.

SIM_PREFIX=fsdpmh
SIM_HOSTS=0
SIM_TAG=""
SIM_ADDR=()
SIM_SUBNET=10.77.0

# shellcheck source=skip.sh
source "$(dirname "${BASH_SOURCE[0]}")/skip.sh"

# Exits the test (SKIP, or FAIL in a strict run) when simulated hosts cannot be made here.
sim_hosts_require() {
  local missing=()
  for tool in ip unshare nsenter; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  ((${#missing[@]} == 0)) || skip_test "simulated hosts need ${missing[*]} (apt-get install iproute2 util-linux)"
  [[ "$(id -u)" == 0 ]] ||
    skip_test "simulated hosts need root (network namespaces, veth, bridge, mounts); run the test as root or under .ci/run"
  local probe="${SIM_PREFIX}-$$-probe"
  ip netns add "$probe" 2>/dev/null || skip_test "cannot create a network namespace ('ip netns add' failed): the container lacks CAP_SYS_ADMIN/CAP_NET_ADMIN"
  ip netns del "$probe"
}

sim_ns() { echo "${SIM_PREFIX}-$$-${SIM_TAG}-h$1"; }
_sim_bridge_ns() { echo "${SIM_PREFIX}-$$-${SIM_TAG}-br"; }

# Removes namespaces left by runs whose shell is gone (killed before its trap ran).
_sim_remove_stale() {
  local ns pid
  while read -r ns _; do
    [[ "$ns" =~ ^${SIM_PREFIX}-([0-9]+)- ]] || continue
    pid="${BASH_REMATCH[1]}"
    kill -0 "$pid" 2>/dev/null && continue
    _sim_del_ns "$ns"
  done < <(ip netns list 2>/dev/null)
}

# Kills what still runs in namespace $1 (only processes started inside it) and deletes it.
_sim_del_ns() {
  local pids
  pids="$(ip netns pids "$1" 2>/dev/null || true)"
  # shellcheck disable=SC2086
  [[ -n "$pids" ]] && kill -KILL $pids 2>/dev/null
  ip netns del "$1" 2>/dev/null || true
}

sim_hosts_destroy() {
  [[ -n "$SIM_TAG" ]] || return 0
  local i
  for ((i = 0; i < SIM_HOSTS; i++)); do _sim_del_ns "$(sim_ns "$i")"; done
  _sim_del_ns "$(_sim_bridge_ns)"
  SIM_TAG=""
}

_sim_on_signal() { sim_hosts_destroy; trap - "$1"; kill -"$1" $$; }

# Creates hosts 0..K-1 at $SIM_SUBNET.(i+1)/24 and registers their removal on EXIT, INT and
# TERM (chaining a trap the test set before, e.g. its rm -rf of a work directory).
sim_hosts_create() {
  local k="$1" i ns br veth
  _sim_remove_stale
  SIM_TAG="$(printf "%06x" $(((RANDOM << 15 | RANDOM) & 0xffffff)))"
  SIM_HOSTS="$k"
  local prev_exit
  prev_exit="$(trap -p EXIT | sed -E "s/^trap -- '(.*)' EXIT$/\1/")"
  # shellcheck disable=SC2064
  trap "sim_hosts_destroy; $prev_exit" EXIT
  trap '_sim_on_signal INT' INT
  trap '_sim_on_signal TERM' TERM
  br="$(_sim_bridge_ns)"
  ip netns add "$br" || skip_test "cannot create network namespace $br"
  ip -n "$br" link add br0 type bridge
  ip -n "$br" link set br0 up
  ip -n "$br" link set lo up
  for ((i = 0; i < k; i++)); do
    ns="$(sim_ns "$i")"
    ip netns add "$ns" || skip_test "cannot create network namespace $ns"
    # Both ends are born in the root namespace under unique names (<= 15 characters) and
    # moved at once; inside the host the link is "eth0", at the bridge "p<i>".
    veth="v${SIM_TAG}h$i"
    ip link add "$veth" type veth peer name "v${SIM_TAG}b$i" || skip_test "cannot create veth pair $veth"
    ip link set "$veth" netns "$ns" name eth0
    ip link set "v${SIM_TAG}b$i" netns "$br" name "p$i"
    ip -n "$br" link set "p$i" master br0 up
    ip -n "$ns" link set lo up
    SIM_ADDR[i]="$SIM_SUBNET.$((i + 1))"
    ip -n "$ns" addr add "${SIM_ADDR[i]}/24" dev eth0
    ip -n "$ns" link set eth0 up
  done
}

# sim_host_run I CMD...: CMD in host I's network namespace, with hostname simhost<I> and a
# private /dev/shm. The environment is inherited; the working directory is kept.
sim_host_run() {
  local i="$1"
  shift
  ip netns exec "$(sim_ns "$i")" unshare --uts --mount --propagation private \
    sh -c 'hostname "$0" && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec "$@"' "simhost$i" "$@"
}

# Bytes host I's link has sent plus received (both directions, headers included).
sim_host_bytes() {
  local d=/sys/class/net/eth0/statistics
  ip netns exec "$(sim_ns "$1")" sh -c "echo \$((\$(cat $d/tx_bytes) + \$(cat $d/rx_bytes)))"
}

# Host I's link counters: "tx_bytes rx_bytes tx_packets rx_packets". Each packet counts its
# Ethernet, IP and TCP headers once: the kernel hands veth TSO/GRO segments of up to 64 KiB as
# one packet, so (bytes - packets * header size) is the payload that crossed.
sim_host_counters() {
  local d=/sys/class/net/eth0/statistics
  ip netns exec "$(sim_ns "$1")" sh -c "echo \$(cat $d/tx_bytes) \$(cat $d/rx_bytes) \$(cat $d/tx_packets) \$(cat $d/rx_packets)"
}

# TCP segments host I has retransmitted so far (RetransSegs of its namespace): a retransmitted
# segment crosses the link twice, which byte counts must allow for.
sim_host_retransmits() {
  ip netns exec "$(sim_ns "$1")" awk '/^Tcp:/ { if (!h) { for (i = 1; i <= NF; i++) if ($i == "RetransSegs") c = i; h = 1 } else print $c }' /proc/net/snmp
}

sim_host_link() { ip -n "$(sim_ns "$1")" link set eth0 "$2"; }

# sim_host_rate I RATE: caps host I's outgoing traffic (tc rate syntax, e.g. 100mbit, 1gbit);
# RATE none removes the cap.
sim_host_rate() {
  if [[ "$2" == none ]]; then
    tc -n "$(sim_ns "$1")" qdisc del dev eth0 root 2>/dev/null || true
    return 0
  fi
  ip -n "$(sim_ns "$1")" link set eth0 mtu 1500
  tc -n "$(sim_ns "$1")" qdisc replace dev eth0 root tbf rate "$2" burst 256kb latency 50ms
}
