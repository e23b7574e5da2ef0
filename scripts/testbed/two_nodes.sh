#!/usr/bin/env bash
# Two emulated nodes on one machine (as root): two Linux network namespaces joined by one veth pair
# whose ends are shaped with tc tbf (a bandwidth and the queue's latency bound). Ranks of one node
# talk over that namespace's own addresses (unshaped, through its loopback); only traffic between
# the two nodes crosses the shaped link. Runs COMMAND once in each namespace, concurrently, with
#   NODE_RANK (0 or 1), NODE_ADDR (this node's address), MASTER_ADDR (node 0's), NODE_IFNAME,
#   GLOO_SOCKET_IFNAME (the veth end: gloo binds there, not to the host's address)
# exported, waits for both and exits with the first failure's status. Everything it creates (the
# namespaces, hence the veth pair and its qdiscs) is removed on exit, also after a failure. No
# interface of the host is touched; the addresses exist only inside the namespaces.
#
#   bash scripts/testbed/two_nodes.sh [--rate 400mbit] [--latency 50ms] -- COMMAND [ARGS...]
#
# Exit status 77 (and a message) where network namespaces cannot be created here.
set -uo pipefail
RATE=400mbit
LATENCY=50ms
BURST=${BURST:-256kb}
SUBNET=${TESTBED_SUBNET:-10.231.0}
while [ $# -gt 0 ]; do
  case "$1" in
    --rate) RATE=$2; shift 2 ;;
    --latency) LATENCY=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "two_nodes.sh: unknown option $1 (usage: [--rate R] [--latency L] -- COMMAND)" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "two_nodes.sh: no command given (usage: [--rate R] [--latency L] -- COMMAND)" >&2; exit 2; }
TAG=fsn$$
NS=("${TAG}a" "${TAG}b")
DEV=("${TAG}v0" "${TAG}v1")

cleanup() {
  for ns in "${NS[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
}
trap cleanup EXIT INT TERM

if ! ip netns add "${NS[0]}" 2>/dev/null; then
  echo "two_nodes.sh: SKIP: cannot create network namespaces here (needs root and ip netns)" >&2
  exit 77
fi
set -e
ip netns add "${NS[1]}"
ip link add "${DEV[0]}" netns "${NS[0]}" type veth peer name "${DEV[1]}" netns "${NS[1]}"
for n in 0 1; do
  ip -n "${NS[$n]}" addr add "$SUBNET.$((n + 1))/24" dev "${DEV[$n]}"
  ip -n "${NS[$n]}" link set lo up
  ip -n "${NS[$n]}" link set "${DEV[$n]}" up
  ip netns exec "${NS[$n]}" tc qdisc add dev "${DEV[$n]}" root tbf rate "$RATE" burst "$BURST" latency "$LATENCY"
done
for n in 0 1; do  # wait for the link's carrier (a few ms)
  for _ in $(seq 50); do
    ip -n "${NS[$n]}" link show "${DEV[$n]}" | grep -q LOWER_UP && break
    sleep 0.1
  done
done
set +e
echo "two_nodes.sh: nodes ${NS[0]} ($SUBNET.1) and ${NS[1]} ($SUBNET.2), link $RATE, queue latency $LATENCY" >&2
pids=()
for n in 0 1; do
  ip netns exec "${NS[$n]}" env NODE_RANK=$n NODE_ADDR="$SUBNET.$((n + 1))" MASTER_ADDR="$SUBNET.1" \
    NODE_IFNAME="${DEV[$n]}" GLOO_SOCKET_IFNAME="${DEV[$n]}" "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || { s=$?; [ $status -ne 0 ] || status=$s; }
done
exit $status
