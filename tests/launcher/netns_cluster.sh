# Network namespaces as the nodes of a cluster, for tests and benchmarks: sourced, not run.
#
#   . netns_cluster.sh
#   netns_cluster_create WHO TAG NODES RATE DELAY_US || exit $?
#   ip netns exec ${TAG}n3 ...       # node 3: interface ${TAG}n3 at 10.79.3.2/24
#   netns_cluster_kill TAG NODES; netns_cluster_delete TAG NODES   # from the EXIT trap
#
# Each node namespace is joined by a veth pair to one router namespace (${TAG}r), like hosts on
# a switch. RATE ("10gbit", or "" for none) limits each node's sending with a tbf qdisc. DELAY_US
# (0 for none) is added to every packet between two nodes, by delay_relay.py holding it in the
# router, since this kernel has no netem: the router's policy routes send what arrives from a
# node through a TUN device, and the relay writes it back after the delay. A round trip so takes
# at least 2·DELAY_US more. Where namespaces, veth or TUN cannot be made here, it says
# "WHO: ...: skipped" and returns 77 (the tests' skip status); netns_cluster_delete removes what
# it made. Node i's address is 10.79.i.2; the router's on that link 10.79.i.1 (a packet to it is
# the router's own and skips the relay). The relay's pid is left in NETNS_CLUSTER_RELAY.

NETNS_CLUSTER_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

netns_cluster_create() {
  local who=$1 tag=$2 nodes=$3 rate=$4 delay_us=$5 i r="${2}r"
  ip netns add "$r" 2>/dev/null || { echo "$who: cannot create network namespaces here: skipped"; return 77; }
  ip -n "$r" link set lo up
  ip netns exec "$r" sysctl -qw net.ipv4.ip_forward=1 net.ipv4.conf.all.rp_filter=0 \
    net.ipv4.conf.default.rp_filter=0
  for i in $(seq 0 $((nodes - 1))); do
    ip netns add "${tag}n$i" || return 1
    ip link add "${tag}n$i" type veth peer name "${tag}r$i" || { echo "$who: no veth: skipped"; return 77; }
    ip link set "${tag}n$i" netns "${tag}n$i"
    ip link set "${tag}r$i" netns "$r"
    ip -n "${tag}n$i" addr add "10.79.$i.2/24" dev "${tag}n$i"
    ip -n "$r" addr add "10.79.$i.1/24" dev "${tag}r$i"
    ip -n "${tag}n$i" link set lo up
    ip -n "${tag}n$i" link set "${tag}n$i" up
    ip -n "$r" link set "${tag}r$i" up
    ip -n "${tag}n$i" route add default via "10.79.$i.1"
    if [ -n "$rate" ]; then
      ip netns exec "${tag}n$i" tc qdisc add dev "${tag}n$i" root tbf rate "$rate" burst 256kb \
        latency 50ms || return 1
    fi
  done
  [ "$delay_us" -gt 0 ] || return 0
  ip -n "$r" tuntap add dev "${tag}t" mode tun 2>/dev/null || { echo "$who: no TUN device: skipped"; return 77; }
  ip netns exec "$r" sysctl -qw "net.ipv4.conf.${tag}t.rp_filter=0"
  ip -n "$r" link set "${tag}t" up
  ip -n "$r" route add default dev "${tag}t" table 100
  for i in $(seq 0 $((nodes - 1))); do
    ip -n "$r" rule add iif "${tag}r$i" lookup 100
  done
  ip netns exec "$r" /usr/bin/python3 "$NETNS_CLUSTER_DIR/delay_relay.py" "${tag}t" "$delay_us" &
  NETNS_CLUSTER_RELAY=$!
}

# netns_cluster_kill TAG NODES: kills (SIGKILL) every process in the cluster's namespaces.
netns_cluster_kill() {
  local ns
  for ns in "${1}r" $(seq -f "${1}n%g" 0 $(($2 - 1))); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
  done
}

# netns_cluster_delete TAG NODES: deletes the namespaces (and with them the links and the TUN).
netns_cluster_delete() {
  local ns
  for ns in "${1}r" $(seq -f "${1}n%g" 0 $(($2 - 1))); do ip netns del "$ns" 2>/dev/null; done
}
