#!/usr/bin/env bash
# Lose a node of a test cluster started by start.sh, or start its slurmd (again).
#
#   node.sh STATE_DIR NODE lose     SIGKILL every process on NODE (its slurmd, job step daemons and
#                                   ranks), as a node that loses power; it stays down until started
#   node.sh STATE_DIR NODE start    start NODE's slurmd (start.sh starts every node this way)
#
# A node is a slurmd in its own network, UTS and mount namespace: the processes in its network
# namespace are exactly the node's. Its /var/tmp is STATE_DIR/nodes/NODE/var-tmp, which outlives it.
set -euo pipefail

die() {
    echo "testcluster: $*" >&2
    exit 1
}
[[ $# -eq 3 && $2 =~ ^node[1-9]$ ]] || die "usage: $0 STATE_DIR node<N> lose|start"
STATE_DIR=$(realpath "$1")
NODE=$2
CONF=$STATE_DIR/slurm.conf
NETNS=drtc-${NODE}
[[ -f "$CONF" && -e "/run/netns/$NETNS" ]] || die "$NODE is not a node of a test cluster in $STATE_DIR"

case $3 in
lose)
    pids=$(ip netns pids "$NETNS")
    # shellcheck disable=SC2086 # one pid per word
    [[ -z "$pids" ]] || kill -KILL $pids
    for _ in $(seq 100); do
        [[ -z "$(ip netns pids "$NETNS")" ]] && break
        sleep 0.1
    done
    [[ -z "$(ip netns pids "$NETNS")" ]] || die "processes on $NETNS outlived SIGKILL: $(ip netns pids "$NETNS" | xargs)"
    echo "testcluster: $NODE lost (every process on it killed)" >&2
    ;;
start)
    [[ -z "$(ip netns pids "$NETNS")" ]] || die "$NODE is running; lose it first"
    pidfile=$STATE_DIR/run/slurmd-$NODE.pid
    rm -f "$pidfile"                  # a lost node's, naming a dead process
    # What Slurm's PMIx plugin (22.05) made for steps killed with the node: slurmd does not remove
    # it, and the requeued job's step of the same id then fails to launch on this node ("Cannot
    # bind() UNIX socket ... Address already in use", "Cannot create directory
    # /var/tmp/spmix_appdir_...: File exists"). Removed, as from a node that boots with a clean
    # spool and scratch.
    rm -rf "$STATE_DIR/spool/$NODE"/pmix.* "$STATE_DIR/spool/$NODE"/stepd.slurm.pmix.* \
        "$STATE_DIR/nodes/$NODE/var-tmp"/spmix_appdir_*
    # nsenter rather than `ip netns exec`, which remounts /sys and so hides the cgroup filesystem
    # slurmd initialises at start.
    nsenter --net="/run/netns/$NETNS" unshare --uts --mount --propagation private bash -c "
        hostname $NODE
        mount --bind '$STATE_DIR/hosts' /etc/hosts
        mount --bind '$STATE_DIR/nodes/$NODE/var-tmp' /var/tmp
        exec slurmd -f '$CONF'" || die "slurmd of $NODE failed to start (see $STATE_DIR/log/slurmd-$NODE.log)"
    for _ in $(seq 1500); do          # slurmd forks: its PID comes from its file
        [[ -s "$pidfile" ]] && break
        sleep 0.1
    done
    [[ -s "$pidfile" ]] || die "slurmd of $NODE did not start (see $STATE_DIR/log/slurmd-$NODE.log)"
    echo "slurmd-$NODE $(cat "$pidfile")" >>"$STATE_DIR/pids"     # what stop.sh stops
    ;;
*) die "usage: $0 STATE_DIR node<N> lose|start" ;;
esac
