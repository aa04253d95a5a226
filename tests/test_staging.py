"""Bounded HDF5 staging: round trip by range, and refusal of corrupt, truncated, stale, altered or
foreign files and directories."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import time

import h5py
import numpy as np
import pytest
import torch

from dynaresize.runtime.staging import (StagingError, make_private_dir, read_range, read_shard, shard_path,
                                wait_for, write_shard)
from dynaresize.plan.switchplan import shard_range
from dynaresize.runtime.types import ShardState

RUN = "0123456789abcdef"


def shard(lo, hi, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ShardState(lo, hi, torch.randn(hi - lo, generator=g), torch.randn(hi - lo, generator=g),
                      torch.rand(hi - lo, generator=g), step=7)


def test_private_dir_mode_0700(tmp_path):
    d = tmp_path / "job"
    old = os.umask(0o000)
    try:
        make_private_dir(str(d))
    finally:
        os.umask(old)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_reshard_by_ranges_from_staged_files(tmp_path):
    numel, old_k, new_k = 1_000_003, 3, 2
    flat = {n: torch.randn(numel) for n in ("params", "exp_avg", "exp_avg_sq")}
    for q in range(old_k):
        lo, hi = shard_range(numel, old_k, q)
        s = ShardState(lo, hi, flat["params"][lo:hi], flat["exp_avg"][lo:hi], flat["exp_avg_sq"][lo:hi], 5)
        nbytes = write_shard(shard_path(str(tmp_path), 4, q), s, version=4, buffer_mb=1, run_id=RUN)
        assert nbytes == 3 * (hi - lo) * 4
    for r in range(new_k):
        lo, hi = shard_range(numel, new_k, r)
        got = read_shard(str(tmp_path), 4, old_k, numel, lo, hi, shard_range, RUN)
        assert (got.lo, got.hi, got.step) == (lo, hi, 5)
        for name in ("params", "exp_avg", "exp_avg_sq"):
            assert torch.equal(getattr(got, name), flat[name][lo:hi])
    assert stat.S_IMODE(os.stat(os.path.dirname(shard_path(str(tmp_path), 4, 0))).st_mode) == 0o700


@pytest.mark.fault('a flipped byte in a staged file',
                   'refused, naming the dataset and the chunk')
def test_flipped_byte_is_refused(tmp_path):
    path = shard_path(str(tmp_path), 1, 0)
    write_shard(path, shard(0, 600_000), version=1, buffer_mb=1, run_id=RUN)
    with h5py.File(path, "r") as f:
        offset = f["exp_avg"].id.get_chunk_info(0).byte_offset + 1234
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))
    read_range(path, 1, 300_000, 400_000, RUN)                # chunks not touching the flip still load
    with pytest.raises(StagingError, match="checksum mismatch in dataset 'exp_avg', chunk 0"):
        read_range(path, 1, 0, 1000, RUN)


@pytest.mark.fault('a truncated staged file',
                   'refused')
def test_truncated_file_is_refused(tmp_path):
    path = shard_path(str(tmp_path), 1, 0)
    write_shard(path, shard(0, 600_000), version=1, buffer_mb=1, run_id=RUN)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(StagingError, match="truncated|unreadable|damaged"):
        read_range(path, 1, 0, 600_000, RUN)


@pytest.mark.fault('a staged file of another table version',
                   'refused')
def test_stale_version_is_refused(tmp_path):
    path = shard_path(str(tmp_path), 2, 0)
    write_shard(path, shard(0, 1000), version=2, buffer_mb=1, run_id=RUN)
    with pytest.raises(StagingError, match="table version 2, expected 3"):
        read_range(path, 3, 0, 1000, RUN)


def test_half_written_file_is_never_visible(tmp_path):
    path = shard_path(str(tmp_path), 1, 0)
    write_shard(path, shard(0, 1000), version=1, buffer_mb=1, run_id=RUN)
    assert os.path.exists(path) and not os.path.exists(path + ".tmp")
    data, step = read_range(path, 1, 10, 20, RUN)
    assert step == 7 and np.array_equal(data["params"], shard(0, 1000).params[10:20].numpy())


@pytest.mark.fault('a staged file left by another run, same version and range',
                   'refused: written by another run (run id)')
def test_file_of_another_run_is_refused(tmp_path):
    """A leftover of an earlier run with the same version and range is not this run's state."""
    path = shard_path(str(tmp_path), 1, 0)
    write_shard(path, shard(0, 1000), version=1, buffer_mb=1, run_id="feedfacefeedface")
    with pytest.raises(StagingError, match="written by another run"):
        read_range(path, 1, 0, 1000, RUN)


@pytest.mark.fault('an edited attribute of a staged file (step, lo, hi, run id, chunk)',
                   'refused: header digest mismatch')
@pytest.mark.parametrize("attr,value", [("step", 8), ("lo", 1), ("hi", 999), ("run_id", RUN), ("chunk", 500)])
def test_altered_attribute_is_refused(tmp_path, attr, value):
    path = shard_path(str(tmp_path), 1, 0)
    write_shard(path, shard(0, 1000), version=1, buffer_mb=1, run_id="feedfacefeedface" if attr == "run_id" else RUN)
    with h5py.File(path, "r+") as f:
        f.attrs[attr] = value
    with pytest.raises(StagingError, match="header digest mismatch"):
        read_range(path, 1, 0, 10, RUN)


@pytest.mark.fault("a staged file moved into another rank's place",
                   'refused: it holds another range')
def test_file_holding_another_range_is_refused(tmp_path):
    """A file renamed into another owner's place: its range is not that owner's shard."""
    numel = 2000
    for q in range(2):
        lo, hi = shard_range(numel, 2, q)
        write_shard(shard_path(str(tmp_path), 1, q), shard(lo, hi, seed=q), version=1, buffer_mb=1, run_id=RUN)
    os.replace(shard_path(str(tmp_path), 1, 0), shard_path(str(tmp_path), 1, 1))
    write_shard(shard_path(str(tmp_path), 1, 0), shard(0, 1000), version=1, buffer_mb=1, run_id=RUN)
    with pytest.raises(StagingError, match=r"its writer's shard is \[1000, 2000\]"):
        read_shard(str(tmp_path), 1, 2, numel, 0, numel, shard_range, RUN)


@pytest.mark.fault('another user reading staged files',
                   'files are 0600 in a 0700 directory')
def test_staged_files_are_private(tmp_path):
    path = shard_path(str(tmp_path), 1, 0)
    old = os.umask(0o000)
    try:
        write_shard(path, shard(0, 1000), version=1, buffer_mb=1, run_id=RUN)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


@pytest.mark.fault('the staging directory pre-created by someone else, a link, or open to others',
                   'refused before anything is staged there')
@pytest.mark.parametrize("make", ["open", "link", "file"])
def test_directory_that_is_not_private_is_refused(tmp_path, make):
    """Someone else's (or an open, or a linked) directory where the job stages is refused."""
    d = tmp_path / "job"
    if make == "open":
        d.mkdir(mode=0o755)
        d.chmod(0o755)
    elif make == "link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        d.symlink_to(tmp_path / "elsewhere")
    else:
        d.write_text("")
    with pytest.raises(StagingError, match="not a private directory of this user"):
        make_private_dir(str(d))


@pytest.mark.fault('a staged write that fails',
                   'the writer raises with the path and the error; readers fail at once (they waited 120 s)')
def test_a_writer_that_fails_tells_the_readers_at_once(tmp_path):
    """A write that fails (here: its temporary file is in the way; a full disk in test_faults)
    raises on the writer and leaves a note, so a reader fails at once instead of waiting 120 s."""
    path = shard_path(str(tmp_path), 1, 0)
    os.makedirs(os.path.dirname(path), mode=0o700)
    open(path + ".tmp", "w").close()
    with pytest.raises(StagingError, match="could not write staged file .*rank00000.h5"):
        write_shard(path, shard(0, 1000), version=1, buffer_mb=1, run_id=RUN)
    t0 = time.monotonic()
    with pytest.raises(StagingError, match="will not appear: its writer failed: .*File exists"):
        wait_for(path, timeout_s=60)
    assert time.monotonic() - t0 < 5


@pytest.fixture
def open_dir():
    """A directory in the system temp dir that every user can reach, as a scratch root is."""
    root = tempfile.mkdtemp(prefix="dynaresize-uid-test-")
    os.chmod(root, 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.fault("another user (uid 65534) reading, listing or replacing a job's staged files",
                   "refused by the file system: the directory is 0700, the files 0600 (needs root to switch users)")
def test_another_user_cannot_read_or_replace_staged_files(open_dir):
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or shutil.which("setpriv") is None or python is None:
        pytest.skip("running as another user needs root, setpriv and a system python3")
    job = os.path.join(open_dir, "dynaresize-job")
    make_private_dir(job)
    path = shard_path(job, 1, 0)
    write_shard(path, shard(0, 1000), version=1, buffer_mb=1, run_id=RUN)
    decoy = os.path.join(open_dir, "decoy")
    open(decoy, "w").close()
    os.chmod(decoy, 0o666)
    probe = ("import os, sys\n"
             "path, job, decoy = sys.argv[1:]\n"
             "for act in (lambda: open(path, 'rb'), lambda: os.listdir(job), lambda: open(path + '.x', 'w'),\n"
             "            lambda: os.replace(decoy, path)):\n"
             "    try:\n        act()\n        print('allowed')\n"
             "    except OSError as e:\n        print(type(e).__name__)\n")
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", probe,
                          path, job, decoy], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["PermissionError"] * 4, out.stdout
