#!/usr/bin/env bash
# Three test hosts on one machine: network namespaces PREFIX-verifier, PREFIX-drafter and
# PREFIX-coordinator, each joined by a veth link to a bridge in PREFIX-hub, addresses
# 10.231.0.1, .2 and .3 (/24). Needs root. Traffic never leaves the namespaces.
#   deploy/netns.sh up [PREFIX]     create them (default prefix: specd)
#   deploy/netns.sh down [PREFIX]   remove them
#   deploy/netns.sh exec NAME CMD   run CMD on host NAME (verifier, drafter, coordinator)
set -euo pipefail
action=${1:-}
prefix=${2:-specd}
hosts=(verifier drafter coordinator)

case "$action" in
up)
    ip netns add "$prefix-hub"
    ip -n "$prefix-hub" link add br0 type bridge
    ip -n "$prefix-hub" link set br0 up
    for i in 0 1 2; do
        name=${hosts[$i]}
        ns="$prefix-$name"
        ip netns add "$ns"
        ip link add "sd${i}a-$$" type veth peer name "sd${i}b-$$"
        ip link set "sd${i}a-$$" netns "$ns"
        ip link set "sd${i}b-$$" netns "$prefix-hub"
        ip -n "$ns" link set "sd${i}a-$$" name eth0
        ip -n "$ns" addr add "10.231.0.$((i + 1))/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        ip -n "$prefix-hub" link set "sd${i}b-$$" master br0 up
        echo "$name: 10.231.0.$((i + 1)) in netns $ns"
    done
    ;;
down)
    for name in "${hosts[@]}" hub; do
        ip netns del "$prefix-$name" 2>/dev/null || true
    done
    ;;
exec)
    name=${2:?host name}
    shift 2
    exec ip netns exec "specd-$name" "$@"
    ;;
*)
    sed -n '2,8p' "$0"
    exit 2
    ;;
esac
