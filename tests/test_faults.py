"""Fault campaign, items 6 and 8: real ranks, real signals.

6 (blame): a rank killed with SIGKILL during training, weight sync or engine start makes the job
exit non-zero soon after, and the launcher names that rank and what it was doing, not a peer that
called MPI_Abort after it. The rank status file is replaced atomically, so a reader never finds it
empty. A rank is killed by the fault-injection hook of the status file
(dynaresize.runtime.status.KILL_AT_STATUS_ENV): it SIGKILLs itself right after it writes the status
the test names, so what it was doing is known.

8 (crashed timelines): a run killed with SIGKILL (every process of it, launcher included) leaves a
timeline that plain h5py.File(path, "r") opens, holding every iteration the run reported done, and
dynaresize-analyze reads it; a writer killed while it holds the file is repaired.

The four jobs start together (module fixture) so the file lasts about as long as the slowest one;
that shared fixture is why the campaign's cases stay in one file of about 500 lines.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import h5py
import pytest

from conftest import ROOT, _env
from processes import descendants, holds_open, rank_pid, state

from dynaresize.runtime.status import status_path, write_status

COMMON = ["policy=static", "run.report=false", "run.save_model=false"]
# name: (rank killed, the status it is killed at, overrides[, its environment]). Ranks
# [0, train_ranks) train, rank 0 sends the weights to the rollout ranks. By default a rank kills
# itself right after it writes that status; "first_line" kills it on the stage's first line
# (resize.inject_fault), which must already be reported as that stage.
KILLS = {
    "train": (1, "train (iteration 2", ["cluster.ranks=3", "policy.train_ranks=2", "run.iterations=4"]),
    "weight_sync": (0, "weight_sync (iteration 1", ["cluster.ranks=2", "policy.train_ranks=1", "run.iterations=3"]),
    "engine_start": (1, "engine_start", ["cluster.ranks=2", "policy.train_ranks=1", "run.iterations=2"]),
    "checkpoint": (0, "checkpoint (after iteration 1", ["cluster.ranks=2", "policy.train_ranks=1", "run.iterations=3",
                                                         "run.checkpoint_every=2"]),
    "weight_sync_first_line": (1, "weight_sync (iteration 1", ["cluster.ranks=2", "policy.train_ranks=1",
                                                               "run.iterations=3"],
                               {"DYNARESIZE_INJECT_FAULT": "1:weight_sync"}),
}
JOB_TIMEOUT_S = 200        # the four jobs share two cores; each alone takes about 20 s
EXIT_AFTER_KILL_S = 30     # a job must end this soon after one of its ranks was killed


def cli(run_dir, *overrides) -> list[str]:
    return [sys.executable, "-m", "dynaresize.launch.cli", f"hydra.run.dir={run_dir}", *COMMON, *overrides]


def run_killed_rank(base, name: str) -> dict:
    rank, status, overrides, *kill_env = KILLS[name]
    run_dir = base / name
    run_dir.mkdir()
    env = dict(_env(), **(kill_env[0] if kill_env else {"DYNARESIZE_KILL_AT_STATUS": f"{rank}:{status}"}))
    with open(run_dir.parent / f"{name}.out", "w") as out, open(run_dir.parent / f"{name}.err", "w") as err:
        proc = subprocess.Popen(cli(run_dir, *overrides), stdout=out, stderr=err, env=env, cwd=ROOT)
        try:
            code = proc.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    ended = time.time()
    status_file = status_path(str(run_dir), rank)
    return {"code": code, "ended": ended, "run_dir": run_dir,
            "killed_at": os.stat(status_file).st_mtime if os.path.exists(status_file) else None,
            "stderr": (run_dir.parent / f"{name}.err").read_text()}


def run_killed_job(base) -> dict:
    """Start a job, let it report three iterations, stop rank 0 (the timeline writer) at a moment it
    does not hold the file open, and SIGKILL every process of the job."""
    run_dir = base / "killed_job"
    timeline = run_dir / "timeline.h5"
    with open(base / "killed_job.err", "w") as err:
        proc = subprocess.Popen(cli(run_dir, "cluster.ranks=2", "policy.train_ranks=1", "run.iterations=200"),
                                stdout=subprocess.PIPE, stderr=err, text=True, env=_env(), cwd=ROOT,
                                start_new_session=True)
    lines, held = [], 0
    try:
        for line in proc.stdout:
            lines.append(line)
            if sum(text.startswith("[dynaresize] iter ") for text in lines) >= 3:
                break
        writer = rank_pid(proc.pid, 0)
        assert writer is not None, "rank 0 not found"
        deadline = time.monotonic() + 5
        while True:               # stop it where it does not hold the timeline open (a flush holds
            os.kill(writer, signal.SIGSTOP)          # it a few ms an iteration; see writer.py)
            while state(writer) not in ("T", "t") and time.monotonic() < deadline + 5:
                time.sleep(0.001)
            if not holds_open(writer, timeline) or time.monotonic() > deadline:
                break
            held += 1
            os.kill(writer, signal.SIGCONT)
            time.sleep(0.003)
    finally:
        for pid in [proc.pid] + descendants(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        lines += proc.stdout.readlines()
        proc.wait(timeout=30)
    return {"run_dir": run_dir, "timeline": timeline, "stdout": lines, "held": held}  # held: times retried


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """Start the jobs of the selected tests at once; `jobs(name)` waits for one, gives its results."""
    base = tmp_path_factory.mktemp("faults")
    results: dict[str, dict] = {}
    threads = {}

    def run(name, fn, *args):
        try:
            results[name] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - reported by the test that waits for it
            results[name] = {"error": e}

    selected = {item.callspec.params["name"] if hasattr(item, "callspec") else "killed_job"
                for item in request.session.items if "jobs" in getattr(item, "fixturenames", ())}
    for name in KILLS:
        if name in selected:
            threads[name] = threading.Thread(target=run, args=(name, run_killed_rank, base, name))
    if "killed_job" in selected:
        threads["killed_job"] = threading.Thread(target=run, args=("killed_job", run_killed_job, base))
    for t in threads.values():
        t.start()

    def wait(name):
        threads[name].join(JOB_TIMEOUT_S + 60)
        assert name in results, f"{name} did not finish"
        if "error" in results[name]:
            raise results[name]["error"]
        return results[name]

    yield wait
    for t in threads.values():
        t.join(JOB_TIMEOUT_S + 60)


@pytest.mark.fault('a rank killed (SIGKILL) during training, weight sync (also at its first line), engine start or a checkpoint write',
                   'the job ends within 30 s; the launcher names that rank and what it was doing, not a peer that aborted after it')
@pytest.mark.parametrize("name", list(KILLS))
def test_killed_rank_is_named_with_its_operation(jobs, name):
    rank, status, *_ = KILLS[name]
    r = jobs(name)
    err = r["stderr"]
    assert r["code"] != 0, err[-3000:]
    assert r["killed_at"] is not None, f"rank {rank} wrote no status\n{err[-3000:]}"
    assert r["ended"] - r["killed_at"] < EXIT_AFTER_KILL_S, f"the job took {r['ended'] - r['killed_at']:.0f} s to end"
    reports = [line for line in err.splitlines() if line.startswith("dynaresize: rank ")]
    assert len(reports) == 1, err[-3000:]
    report = reports[0]
    # the killed rank and what it was doing, not a peer that aborted after it
    assert report.startswith(f"dynaresize: rank {rank} died"), report
    assert f"during {status}" in report, report
    timeline = r["run_dir"] / "timeline.h5"
    if timeline.exists():                    # written by rank 0 until the job died: plain h5py opens it
        with h5py.File(timeline, "r") as f:
            assert not f.attrs["complete"]


@pytest.mark.fault("a rank's status file read while the rank rewrites it (thousands of times)",
                   'never empty: it is replaced atomically')
def test_status_file_is_never_read_empty(tmp_path):
    """The status writer (Job.set_status calls it: the kill tests above depend on that) rewrites
    the file thousands of times while another process reads it."""
    path = tmp_path / ".ranks" / "rank-00003"
    stop = tmp_path / "stop"
    texts = ["train (iteration 7, batch 6, 2T/2R)", "weight_sync (iteration 7, 2T/2R, receiving)"]
    write_status(str(path), texts[0], 3)
    reader = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, sys
        path, stop = sys.argv[1], sys.argv[2]
        reads = empty = missing = 0
        seen = set()
        print("ready", flush=True)
        while not os.path.exists(stop):
            try:
                with open(path) as f:
                    text = f.read()
            except FileNotFoundError:
                missing += 1
                continue
            reads += 1
            if not text:
                empty += 1
            seen.add(text)
        print(reads, empty, missing, len(seen - set(sys.argv[3:])), flush=True)
    """), str(path), str(stop), *texts], stdout=subprocess.PIPE, text=True)
    assert reader.stdout.readline().strip() == "ready"
    start = time.monotonic()
    writes = 0
    while writes < 2000 or time.monotonic() - start < 0.5:
        write_status(str(path), texts[writes % 2], 3)
        writes += 1
    stop.touch()
    out, _ = reader.communicate(timeout=30)
    reads, empty, missing, other = map(int, out.split())
    assert reads > 500, f"only {reads} reads"
    assert (empty, missing, other) == (0, 0, 0), \
        f"{reads} reads during {writes} writes: {empty} empty, {missing} missing, {other} other texts"
    assert [p.name for p in path.parent.iterdir()] == [path.name], "temporary files left behind"


@pytest.mark.fault('every process of a run killed (SIGKILL)',
                   'its timeline opens with plain `h5py.File(path, "r")` with every completed iteration; `dynaresize-analyze` reads it')
def test_killed_job_timeline_opens_with_plain_h5py(jobs):
    r = jobs("killed_job")
    done = [int(line.split()[2]) for line in r["stdout"] if line.startswith("[dynaresize] iter ")]
    assert len(done) >= 3, r["stdout"]
    with h5py.File(r["timeline"], "r") as f:          # plain: no SWMR, no libver
        assert not f.attrs["complete"]
        iterations = set(f["iterations"]["iteration"].tolist())
        sampled = set(f["samples"]["iteration"].tolist())
        evented = set(f["events"]["iteration"].tolist())
    assert set(done) <= iterations, (done, sorted(iterations))
    assert iterations <= sampled and iterations <= evented       # a row only with its data
    proc = subprocess.run([sys.executable, "-m", "dynaresize.analysis.cli", str(r["run_dir"]), "--no-gantt", "--no-trace"],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (r["run_dir"] / "report" / "summary.json").exists()


KILLED_IN_FLUSH = textwrap.dedent("""
    import os, signal, sys
    import dynaresize.timeline.writer as w
    writer = w.TimelineWriter(sys.argv[1], {"world_size": 2, "config": ""})
    def rows(i):
        writer.append("events", [dict(iteration=i, rank=0, role="train", name="train", start=i, end=i + 0.5)])
        writer.append("samples", [dict(iteration=i, rank=1, response_len=10, reward=0.5)])
        writer.append("iterations", [dict(iteration=i, table_version=0, train_ranks=1, rollout_ranks=1,
                                           start=i, end=i + 1.0)])
    for i in range(3):
        rows(i)
        writer.flush()
    append = w._append_rows
    def append_then_die(dataset, name, data):      # killed while it holds the file open
        append(dataset, name, data)
        os.kill(os.getpid(), signal.SIGKILL)
    w._append_rows = append_then_die
    rows(3)
    writer.flush()
""")


@pytest.mark.fault('the timeline writer killed while it appends an iteration',
                   'the file is repaired (by the launcher, or `python -m dynaresize.timeline.writer repair`) and says so')
def test_writer_killed_inside_a_flush_is_repaired(tmp_path):
    """The few ms a flush holds the file: a SIGKILL there leaves the HDF5 'open for write' mark,
    which repair_timeline (run by the launcher after a failed job) clears."""
    from dynaresize.timeline.writer import needs_repair, repair_timeline
    path = tmp_path / "timeline.h5"
    proc = subprocess.run([sys.executable, "-c", KILLED_IN_FLUSH, str(path)], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert needs_repair(path)
    with pytest.raises(OSError, match="already open for write"):
        h5py.File(path, "r")
    assert "repaired" in repair_timeline(path)
    with h5py.File(path, "r") as f:
        assert sorted(f["iterations"]["iteration"].tolist()) == [0, 1, 2]
        assert f.attrs["repaired"] == 1
    assert repair_timeline(path) is None and not needs_repair(path)


SIGTERM_IN_FLUSH = textwrap.dedent("""
    import os, signal, sys
    import dynaresize.timeline.writer as w
    writer = w.TimelineWriter(sys.argv[1], {"world_size": 2, "config": ""})
    append = w._append_rows
    def append_told_to_stop(dataset, name, data):   # SIGTERM while the file is open
        os.kill(os.getpid(), signal.SIGTERM)
        append(dataset, name, data)
    w._append_rows = append_told_to_stop
    writer.append("iterations", [dict(iteration=0, table_version=0, train_ranks=1, rollout_ranks=1,
                                       start=0.0, end=1.0)])
    writer.flush()
    print("survived the signal")
""")


@pytest.mark.fault('SIGTERM while the timeline writer appends',
                   'the file is closed first, then the signal acts')
def test_sigterm_inside_a_flush_ends_the_writer_after_the_file_is_closed(tmp_path):
    path = tmp_path / "timeline.h5"
    proc = subprocess.run([sys.executable, "-c", SIGTERM_IN_FLUSH, str(path)], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM and "survived" not in proc.stdout, proc.stderr
    with h5py.File(path, "r") as f:
        assert f["iterations"]["iteration"].tolist() == [0]


@pytest.mark.fault("output where only a peer's MPI_Abort is reported",
                   'the first rank to end is blamed, the peer named as a consequence')
def test_blame_goes_to_the_first_rank_to_end_not_to_the_peer_that_aborted(tmp_path):
    """What mpiexec printed when a rank killed in training lost the race to a peer's MPI_Abort
    (no 'exited on signal' line), with the order in which the launcher saw the ranks end."""
    from dynaresize.launch.failure import explain_failure
    run_dir = str(tmp_path)
    doing = ["train (iteration 2, batch 1, 2T/2R)"] * 2 + ["rollout (iteration 2, batch 2, 2T/2R)"] * 2
    for rank, text in enumerate(doing):
        write_status(status_path(run_dir, rank), text)
    lines = ["[dynaresize] rank 0 failed: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:11136.\n",
             "--------------------------------------------------------------------------\n",
             "MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD\n",
             "  Proc: [[37464,1],0]\n", "  Errorcode: 1\n"]
    exits = [(10.0, 1), (10.3, 3), (10.35, 0), (10.4, 2)]
    why = explain_failure(lines, run_dir, exits)
    assert why.startswith("rank 1 died") and "during train (iteration 2" in why, why
    assert why.endswith("rank 0 failed after it (a consequence)"), why
    # ranks that had finished their work and ended normally are not causes
    for rank in (1, 2, 3):
        write_status(status_path(run_dir, rank), "finished")
    write_status(status_path(run_dir, 0), "finish (saving the model, closing the timeline)")
    lines = ["[dynaresize] rank 0 failed: OSError: [Errno 28] No space left on device\n",
             "MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD\n"]
    why = explain_failure(lines, run_dir, [(1.0, 1), (1.0, 2), (1.1, 3), (5.0, 0)])
    assert why == "rank 0 failed during finish (saving the model, closing the timeline): " \
                  "OSError: [Errno 28] No space left on device", why


def test_rank_watch_records_the_order_in_which_ranks_end():
    """RankWatch finds the ranks under the launcher process by their MPI rank variable and sees
    them end in the order they were killed."""
    from dynaresize.launch.failure import RankWatch
    spawn = textwrap.dedent("""
        import os, subprocess, sys
        ps = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                               env=dict(os.environ, OMPI_COMM_WORLD_RANK=str(r))) for r in range(3)]
        print(" ".join(str(p.pid) for p in ps), flush=True)
        for p in ps:
            p.wait()
    """)
    root = subprocess.Popen([sys.executable, "-c", spawn], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = [int(p) for p in root.stdout.readline().split()]
        watch = RankWatch(root.pid, 3).start()
        deadline = time.monotonic() + 10
        while len(watch.pids) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.pids == dict(enumerate(pids))
        for rank in (2, 0, 1):
            os.kill(pids[rank], signal.SIGKILL)
            time.sleep(0.05)
        assert root.wait(timeout=30) == 0
    finally:
        root.kill()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert [rank for _, rank in watch.stop()] == [2, 0, 1]


@pytest.mark.fault('SIGTERM or SIGINT to `dynaresize` alone',
                   'the ranks are stopped (none orphaned), staging removed; exit 128 + signal with one line')
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_to_the_launcher_stops_its_ranks_and_cleans_up(tmp_path, sig):
    """Item 4: SIGTERM or SIGINT to `dynaresize` alone (not its process group) stops the job: the
    ranks end with it (none orphaned), its staging directory is removed, and it exits 128 + signal
    with a one-line reason."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(cli(run_dir, "cluster.ranks=2", "policy.train_ranks=1", "run.iterations=200",
                                f"cluster.local_scratch={scratch}"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
                            start_new_session=True)
    job = []
    try:
        for line in proc.stdout:
            if line.startswith("[dynaresize] iter "):
                break
        job = descendants(proc.pid)
        assert rank_pid(proc.pid, 0) and rank_pid(proc.pid, 1), "ranks not found"
        assert any(p.name.startswith("dynaresize-") for p in scratch.iterdir()), "no staging directory"
        proc.send_signal(sig)
        code = proc.wait(timeout=40)
        err = proc.stderr.read()
    finally:
        for pid in [proc.pid] + job:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert code == 128 + sig, err[-3000:]
    assert f"dynaresize: stopped by {signal.Signals(sig).name}" in err, err[-3000:]
    alive = [pid for pid in job if os.path.exists(f"/proc/{pid}") and state(pid) not in ("Z", "X")]
    assert not alive, f"processes of the job outlived its launcher: {alive}"
    assert not list(scratch.iterdir()), list(scratch.iterdir())


@pytest.fixture
def small_disk(tmpfs):
    """A 256 KiB tmpfs: a disk that fills up (needs root; skipped elsewhere)."""
    return tmpfs("256k")


@pytest.mark.fault('the scratch disk fills up while a rank stages its state',
                   "the job ends at once naming the path and `No space left on device`; no `.tmp` left (needs root for the test's tmpfs)")
def test_full_scratch_disk_ends_the_job_at_once_naming_path_and_error(tmp_path, small_disk):
    """Item 5: a rank that leaves training stages its state on a scratch disk that fills up. The
    writer's error ends the job at once, with the path and the error; no rank waits for a file
    that will never appear (they waited 120 s, then blamed a missing file)."""
    run_dir = tmp_path / "run"
    started = time.monotonic()
    proc = subprocess.run(cli(run_dir, "cluster.ranks=3", "policy.name=scripted", "policy.schedule=[2,1]",
                              "run.iterations=3", f"cluster.local_scratch={small_disk}"),
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=200)
    took = time.monotonic() - started
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "No space left on device" in proc.stderr and str(small_disk) in proc.stderr, proc.stderr[-3000:]
    assert "did not appear" not in proc.stderr
    assert took < 100, f"{took:.0f} s"
    leftovers = [p for p in small_disk.rglob("*") if p.suffix == ".tmp"]
    assert not leftovers, leftovers


@pytest.mark.fault("a read-only scratch disk",
                   "the job ends at start-up naming the path and `Read-only file system` (needs root for the test's tmpfs)")
def test_read_only_scratch_disk_ends_the_job_at_once_naming_path_and_error(tmp_path, small_disk):
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    started = time.monotonic()
    proc = subprocess.run(cli(tmp_path / "run", "cluster.ranks=2", "policy.train_ranks=1", "run.iterations=2",
                              f"cluster.local_scratch={small_disk}"),
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=200)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Read-only file system" in proc.stderr and str(small_disk) in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - started < 60
