"""Fault campaign, round 3, items 1 and 2: a job never outlives its launcher, one launcher owns a run
directory, and a stalled rank is named. Real launchers, mpiexec, ranks and signals."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, _env
from processes import alive, descendants, rank_pid

COMMON = ["policy=static", "run.report=false", "run.save_model=false", "cluster.ranks=3", "policy.train_ranks=2",
          "run.iterations=200"]
GONE_WITHIN_S = 10         # the bound: no process of the job alive this long after the launcher's kill


def start_job(run_dir, *overrides) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dynaresize.launch.cli", f"hydra.run.dir={run_dir}", *COMMON,
                             *overrides], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            cwd=ROOT, start_new_session=True)


def wait_for_iteration(proc: subprocess.Popen) -> None:
    for line in proc.stdout:
        if line.startswith("[dynaresize] iter "):
            return
    raise AssertionError(f"the job ended before its first iteration: {proc.stderr.read()[-3000:]}")


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.fault("the launcher killed (SIGKILL) while its job runs; a second launch into the run "
                   "directory meanwhile",
                   "the second launch is refused naming the first's pid (exit 2); every rank and mpiexec end "
                   "within seconds and the ranks remove their staging; a later launch takes the lock over and "
                   "removes the staging that killed attempts of the run left")
def test_killed_launcher_takes_its_job_and_staging_with_it(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    run_dir = tmp_path / "run"
    proc = start_job(run_dir, f"cluster.local_scratch={scratch}", "run.checkpoint_every=1")
    job = []
    try:
        wait_for_iteration(proc)
        for _ in range(600):               # a checkpoint to resume from
            if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
                break
            time.sleep(0.1)
        job = descendants(proc.pid)
        assert rank_pid(proc.pid, 0) and rank_pid(proc.pid, 2), "ranks not found"
        assert any(p.name.startswith("dynaresize-") for p in scratch.iterdir()), "no staging directory"

        second = subprocess.run([sys.executable, "-m", "dynaresize.launch.cli", f"hydra.run.dir={run_dir}", *COMMON,
                                 f"cluster.local_scratch={scratch}"], capture_output=True, text=True, env=_env(),
                                cwd=ROOT, timeout=120)
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"is in use by another launcher (pid {proc.pid} on" in second.stderr, second.stderr[-3000:]
        assert alive(job) == alive(descendants(proc.pid)), "the refused launch touched the running job"

        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(timeout=10)
        while alive(job) and time.monotonic() - killed < GONE_WITHIN_S:
            time.sleep(0.1)
        gone_after = time.monotonic() - killed
        left = alive(job)
    finally:
        kill_all([proc.pid] + job)
    assert not left, f"processes of the job outlived its launcher by {GONE_WITHIN_S} s: {left}"
    assert not list(scratch.iterdir()), f"staging left behind: {list(scratch.iterdir())}"
    print(f"every process of the job ended {gone_after:.1f} s after the launcher's SIGKILL")

    lock = json.loads((run_dir / ".lock").read_text())        # the dead launcher's
    assert lock["launcher"].split(":")[1] == str(proc.pid)

    # A rank Slurm kills cannot remove its staging: the run's next attempt removes it, on each of
    # its nodes, from the marks attempts leave in RUN_DIR/.ranks (here, one that a killed attempt
    # left, made by hand; and another run's staging, which is not this run's to remove).
    from dynaresize.runtime.staging import job_staging_dir, staged_mark
    left = job_staging_dir(str(scratch), "0123456789abcdef")
    os.makedirs(os.path.join(left, "v00001"))
    open(staged_mark(str(run_dir), "0123456789abcdef"), "w").close()
    unrelated = job_staging_dir(str(scratch), "fedcba9876543210")
    os.makedirs(unrelated)

    # the newest complete checkpoint (a kill mid-write leaves .tmp-iter-*, which resume ignores)
    resumed_from = max(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("iter-*"))
    again = subprocess.run([sys.executable, "-m", "dynaresize.launch.cli", f"hydra.run.dir={run_dir}", *COMMON[:-1],
                            f"run.iterations={resumed_from + 2}", f"cluster.local_scratch={scratch}"],
                           capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"the launcher that held {run_dir / '.lock'} (pid {proc.pid} on" in again.stderr, again.stderr[-3000:]
    assert not (run_dir / ".lock").exists(), "the lock outlived the launcher that released it"
    assert f"removed {left}, left on" in again.stdout, again.stdout
    assert sorted(os.listdir(scratch)) == [os.path.basename(unrelated)]
    assert not [n for n in os.listdir(run_dir / ".ranks") if n.startswith("staged-")]


@pytest.mark.fault("a rank stopped (SIGSTOP) during training",
                   "the stall watchdog ends the job within run.stall_timeout_s (+ a few s), naming the rank, its "
                   "operation and how long it has been silent; exit 1")
def test_stopped_rank_is_named_by_the_stall_watchdog(tmp_path):
    timeout_s = 6
    proc = start_job(tmp_path / "run", f"run.stall_timeout_s={timeout_s}")
    job = []
    try:
        wait_for_iteration(proc)
        job = descendants(proc.pid)
        victim = rank_pid(proc.pid, 1)
        assert victim, "rank 1 not found"
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        code = proc.wait(timeout=timeout_s + 60)
        ended_after = time.monotonic() - stopped
        err = proc.stderr.read()
    finally:
        kill_all([proc.pid] + job)
    assert code == 1, err[-3000:]
    assert "dynaresize: rank 1 stopped responding: no heartbeat for" in err, err[-3000:]
    assert f"run.stall_timeout_s={timeout_s}" in err
    line = next(text for text in err.splitlines() if "stopped responding" in text)
    assert " during " in line and "start-up" not in line, line       # what rank 1 was doing
    assert ended_after < timeout_s + 15, f"the job ended {ended_after:.1f} s after the stop"
    print(f"ended {ended_after:.1f} s after the SIGSTOP: {line}")
    assert not alive(job), "the stalled job left processes behind"


@pytest.mark.fault("every rank alive but none starting a new operation (a deadlock)",
                   "the watchdog names the rank that has been in its operation longest")
def test_watchdog_names_the_oldest_operation_when_no_rank_progresses(tmp_path):
    """Three ranks' files, written as ranks write them: all beat, none changes its status."""
    import threading

    from dynaresize.launch.watchdog import StallWatch
    from dynaresize.runtime.liveness import beat_path
    from dynaresize.runtime.status import status_path, write_status

    run_dir = str(tmp_path)
    for rank, text in enumerate(["train (iteration 3)", "exchange (iteration 3)", "train (iteration 3)"]):
        write_status(status_path(run_dir, rank), text)
        time.sleep(0.01 if rank else 0.5)         # rank 0 entered its operation first
    stop = threading.Event()

    def beat():
        while not stop.wait(0.2):
            for rank in range(3):
                open(beat_path(run_dir, rank), "a").close()
                os.utime(beat_path(run_dir, rank))

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    stalls: list[str] = []
    watch = StallWatch(run_dir, 3, 2.0, stalls.append, interval_s=0.2).start()
    try:
        deadline = time.monotonic() + 15
        while not stalls and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        watch.stop()
    assert stalls, "no stall reported"
    assert stalls[0].startswith("no rank has started a new operation for"), stalls[0]
    assert "rank 0 has been in train (iteration 3) longest" in stalls[0]


def test_run_lock_is_refused_while_its_holder_runs_and_taken_over_when_it_is_gone(tmp_path):
    from dynaresize.config import ConfigError
    from dynaresize.launch.runlock import RunLock

    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from dynaresize.launch.runlock import RunLock; RunLock(sys.argv[1]).acquire(); "
        "print('held', flush=True); time.sleep(300)"), str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"in use by another launcher \\(pid {holder.pid} on"):
            RunLock(str(tmp_path)).acquire()
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(str(tmp_path))
    lock.acquire()                                     # its holder is gone
    assert json.loads((tmp_path / ".lock").read_text()) == lock.mine
    lock.release()
    assert not (tmp_path / ".lock").exists()

    # Held on another host: refused (nothing here can tell whether it runs), unless it is an
    # earlier attempt of this very Slurm job.
    other = {"launcher": "another-node:4242:777", "slurm_job": "91", "since": "earlier"}
    (tmp_path / ".lock").write_text(json.dumps(other))
    with pytest.raises(ConfigError, match="if that launcher is gone \\(its node was lost\\), remove"):
        RunLock(str(tmp_path)).acquire()
    os.environ["SLURM_JOB_ID"] = "91"
    try:
        requeued = RunLock(str(tmp_path))
        requeued.acquire()
    finally:
        del os.environ["SLURM_JOB_ID"]
    assert json.loads((tmp_path / ".lock").read_text())["slurm_job"] == "91"
    requeued.release()


@pytest.mark.fault("the run directory's disk fills up mid-run",
                   "the job ends at once naming the rank, its operation, the file and the errno, and how much "
                   "room the run directory and scratch have; a console log that cannot be written is dropped, "
                   "saying so, and the console goes on")
def test_run_directory_filling_up_mid_run_ends_the_job_naming_it(tmpfs):
    disk = tmpfs("8m")
    run_dir = disk / "run"
    proc = start_job(run_dir, "cluster.ranks=2", "policy.train_ranks=1")
    job = []
    try:
        wait_for_iteration(proc)
        job = descendants(proc.pid)
        with open(disk / "filler", "wb") as f:         # fill the disk
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        filled = time.monotonic()
        code = proc.wait(timeout=120)
        ended_after = time.monotonic() - filled
        err = proc.stderr.read()
    finally:
        kill_all([proc.pid] + job)
    assert code == 1, err[-3000:]
    failed = next((line for line in err.splitlines() if line.startswith("dynaresize: rank ")), "")
    assert "No space left on device" in failed and str(run_dir) in failed, err[-3000:]
    assert f"dynaresize: a disk is full (run directory {run_dir}: 0.0 MiB free" in err, err[-3000:]
    assert "the job failed (exit code 1)" in err                   # the launcher itself did not crash
    assert ended_after < 60, f"the job ended {ended_after:.0f} s after the disk filled"
    print(f"ended {ended_after:.1f} s after the disk filled:", *[line for line in err.splitlines()
                                                                  if line.startswith(("dynaresize", "[dynaresize]"))],
          sep="\n  ")
    assert not alive(job)


def test_console_log_on_a_full_disk_is_dropped_and_the_console_goes_on(capfd):
    from dynaresize.launch.cli import console_log

    with console_log("/dev/full"):                 # every write fails with ENOSPC
        print("first line")
        print("second line")
    out, err = capfd.readouterr()
    assert out == "first line\nsecond line\n"
    assert err.count("cannot write /dev/full (No space left on device)") == 1, err

