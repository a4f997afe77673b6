# Two network namespaces joined by a veth pair, for tests: sourced, not run.
#
#   . netns_pair.sh
#   netns_pair_create WHO TAG SUBNET || exit $?   # namespaces ${TAG}a and ${TAG}b
#   ip netns exec ${TAG}a ...                     # ${TAG}0 at SUBNET.1/24 there, ${TAG}1 at SUBNET.2/24 in b
#   netns_pair_kill TAG; netns_pair_delete TAG    # from the EXIT trap
#
# netns_pair_create brings lo and both ends of the pair up. Where namespaces or veth cannot be made
# here (not root, no CAP_SYS_ADMIN), it says "WHO: ...: skipped" and returns 77, the tests' skip
# status; it may leave a namespace made, which netns_pair_delete removes.

netns_pair_create() {
  local who=$1 tag=$2 subnet=$3 ns
  if ! ip netns add "${tag}a" 2>/dev/null || ! ip netns add "${tag}b" 2>/dev/null; then
    echo "$who: cannot create network namespaces here: skipped"; return 77
  fi
  ip link add "${tag}0" type veth peer name "${tag}1" || { echo "$who: no veth: skipped"; return 77; }
  ip link set "${tag}0" netns "${tag}a"
  ip link set "${tag}1" netns "${tag}b"
  ip -n "${tag}a" addr add "$subnet.1/24" dev "${tag}0"
  ip -n "${tag}b" addr add "$subnet.2/24" dev "${tag}1"
  for ns in "${tag}a" "${tag}b"; do ip -n "$ns" link set lo up; done
  ip -n "${tag}a" link set "${tag}0" up
  ip -n "${tag}b" link set "${tag}1" up
}

# netns_pair_kill TAG: kills (SIGKILL) every process in the pair's namespaces.
netns_pair_kill() {
  local ns
  for ns in "${1}a" "${1}b"; do ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null; done
}

# netns_pair_delete TAG: deletes the pair's namespaces (and with them the veth pair).
netns_pair_delete() {
  ip netns del "${1}a" 2>/dev/null
  ip netns del "${1}b" 2>/dev/null
}
