#!/usr/bin/env bash
# Tear down a test cluster started by start.sh.
#
#   stop.sh STATE_DIR
#
# Cancels remaining jobs, stops exactly the daemons recorded in STATE_DIR/pids (munged only if
# start.sh started it), then removes the nodes' network namespaces and the bridge. Safe to run
# more than once. STATE_DIR itself (logs and database included) is left for inspection; delete
# it yourself if you want it gone.
set -euo pipefail

[[ $# -eq 1 ]] || {
    echo "usage: $0 STATE_DIR" >&2
    exit 2
}
[[ -d "$1" ]] || {
    echo "testcluster: $1 does not exist, nothing to stop"
    exit 0
}
# Same resolution as start.sh: daemons are recognised by their state directory.
STATE_DIR=$(realpath "$1")
CONF=$STATE_DIR/slurm.conf
PIDS=$STATE_DIR/pids

# A recorded PID may have been reused by an unrelated process since; only signal it if it still
# looks like the daemon we started: the right program, started for this state directory (on its
# command line, or in SLURM_CONF for slurmdbd, which takes no config path).
is_ours() { # name pid
    local comm=${1%%-*}
    [[ "$(cat "/proc/$2/comm" 2>/dev/null)" == "$comm" ]] || return 1
    [[ $comm == munged ]] && return 0
    tr '\0' '\n' <"/proc/$2/cmdline" 2>/dev/null | grep -qF "$STATE_DIR" && return 0
    tr '\0' '\n' <"/proc/$2/environ" 2>/dev/null | grep -qxF "SLURM_CONF=$CONF"
}

declare -A daemon_pid=()
links=()
namespaces=()
if [[ -f "$PIDS" ]]; then
    while read -r name pid; do
        [[ -n "${name:-}" && -n "${pid:-}" ]] || continue
        case $name in
        bridge | veth) links+=("$pid") ;;
        netns) namespaces+=("$pid") ;;
        *) is_ours "$name" "$pid" && daemon_pid[$name]=$pid ;;
        esac
    done <"$PIDS"
fi
slurmd_pids=()
for name in "${!daemon_pid[@]}"; do
    [[ $name == slurmd-* ]] && slurmd_pids+=("${daemon_pid[$name]}")
done

# Cancel jobs first so slurmd can still clean up their processes; killing slurmd under running
# jobs would leave orphaned slurmstepd/job processes.
if [[ -n "${daemon_pid[slurmctld]:-}" ]]; then
    export SLURM_CONF=$CONF
    jobs=$(squeue -h -o %A 2>/dev/null | sort -u || true)
    if [[ -n "$jobs" ]]; then
        # shellcheck disable=SC2086 # word splitting wanted: one id per word
        scancel $jobs 2>/dev/null || true
        # Without a live slurmd the jobs never finish; do not wait for them.
        if ((${#slurmd_pids[@]})); then
            for _ in $(seq 50); do
                [[ -z "$(squeue -h -o %A 2>/dev/null)" ]] && break
                sleep 0.2
            done
        fi
    fi
fi

# kill -0 also succeeds on zombies, and in containers PID 1 may be slow to reap the daemons it
# inherited, so look at the process state instead.
running() { # pid
    local state
    state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
    [[ -n "$state" && "$state" != Z && "$state" != X ]]
}

stop_pids() { # pids...: TERM, then KILL whatever is still alive after ~10 s
    (($# > 0)) || return 0
    kill -TERM "$@" 2>/dev/null || true
    for _ in $(seq 100); do
        local alive=0 p
        for p in "$@"; do running "$p" && alive=1; done
        ((alive)) || return 0
        sleep 0.1
    done
    echo "testcluster: still alive after TERM, sending KILL: $*" >&2
    kill -KILL "$@" 2>/dev/null || true
}

# slurmd before slurmctld (so nodes are not marked DOWN mid-way for nothing), then accounting,
# munged last since the daemons talk to it while shutting down.
stop_pids "${slurmd_pids[@]}"
for name in slurmctld slurmdbd mariadbd; do
    if [[ -n "${daemon_pid[$name]:-}" ]]; then
        stop_pids "${daemon_pid[$name]}"
    fi
done

descendants() { # pid: all processes below it
    local child
    for child in $(pgrep -P "$1" || true); do
        echo "$child"
        descendants "$child"
    done
}

# Job step daemons (and the job processes under them) outlive slurmd when it died before the
# jobs could be cancelled. Ours are the slurmstepds holding files open in this state directory.
stray=()
for pid in $(pgrep -x slurmstepd || true); do
    for fd in "/proc/$pid/fd/"*; do
        if [[ "$(readlink "$fd" 2>/dev/null)" == "$STATE_DIR/"* ]]; then
            mapfile -t -O "${#stray[@]}" stray < <(echo "$pid"; descendants "$pid")
            break
        fi
    done
done
if ((${#stray[@]})); then
    stop_pids "${stray[@]}"
fi

if [[ -n "${daemon_pid[munged]:-}" ]]; then
    stop_pids "${daemon_pid[munged]}"
fi

for ns in "${namespaces[@]}"; do
    ip netns del "$ns" 2>/dev/null || true
done
# The kernel removes a namespace's veth pair shortly after the namespace; wait for that (a start
# right after this stop reuses the names), deleting what is left.
for link in "${links[@]}"; do
    for _ in $(seq 50); do
        ip link show "$link" >/dev/null 2>&1 || break
        ip link del "$link" 2>/dev/null || sleep 0.1
    done
done

rm -f "$PIDS"
echo "testcluster: stopped ($STATE_DIR)"
