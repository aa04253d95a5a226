"""Bounded HDF5 staging: round trip by range, and refusal of corrupt, truncated, stale, altered or
foreign files and directories."""
from __future__ import annotations

import os
import stat

import h5py
import numpy as np
import pytest
import torch

from dynaresize.flat import shard_range
from dynaresize.staging import (StagingError, make_private_dir, read_range, read_shard, shard_path,
                                write_shard)
from dynaresize.trainer import ShardState

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


def test_truncated_file_is_refused(tmp_path):
    path = shard_path(str(tmp_path), 1, 0)
    write_shard(path, shard(0, 600_000), version=1, buffer_mb=1, run_id=RUN)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(StagingError, match="truncated|unreadable|damaged"):
        read_range(path, 1, 0, 600_000, RUN)


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


def test_file_of_another_run_is_refused(tmp_path):
    """A leftover of an earlier run with the same version and range is not this run's state."""
    path = shard_path(str(tmp_path), 1, 0)
    write_shard(path, shard(0, 1000), version=1, buffer_mb=1, run_id="feedfacefeedface")
    with pytest.raises(StagingError, match="written by another run"):
        read_range(path, 1, 0, 1000, RUN)


@pytest.mark.parametrize("attr,value", [("step", 8), ("lo", 1), ("hi", 999), ("run_id", RUN), ("chunk", 500)])
def test_altered_attribute_is_refused(tmp_path, attr, value):
    path = shard_path(str(tmp_path), 1, 0)
    write_shard(path, shard(0, 1000), version=1, buffer_mb=1, run_id="feedfacefeedface" if attr == "run_id" else RUN)
    with h5py.File(path, "r+") as f:
        f.attrs[attr] = value
    with pytest.raises(StagingError, match="header digest mismatch"):
        read_range(path, 1, 0, 10, RUN)


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


def test_staged_files_are_private(tmp_path):
    path = shard_path(str(tmp_path), 1, 0)
    old = os.umask(0o000)
    try:
        write_shard(path, shard(0, 1000), version=1, buffer_mb=1, run_id=RUN)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


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
