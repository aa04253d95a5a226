"""Bounded state staging: training state spilled to node-local scratch as HDF5, read back by range.

A rank that gives up a range of the flat vector writes its optimizer shard (float32 master
parameters and both AdamW moments) to one HDF5 file (mode 0600) in a job-private directory (mode
0700, created fresh: its name carries the job's random run id, and a directory of that name that
is not ours is refused). Each dataset is chunked in `buffer_mb` pieces (1-8 MiB chunks write at
1.6-2.6 GB/s here, 64 MiB ones 2-5x slower) and written one chunk at a time, so the extra memory
is one chunk. Every chunk has a CRC32. The file is bound to what it holds: the run id, the table
version, its range [lo, hi), the AdamW step and the chunk size are attributes, and a SHA-256 over
them and the chunk CRCs (the header digest) is checked before anything is read, so a file of
another run, another version or an edited attribute is refused, never loaded as this run's. The
file is written under a temporary name and renamed when complete, so nothing half-written is ever
loaded. New owners read just the chunks covering the ranges they need and verify each chunk's
CRC: a flipped byte or a truncated file is an error, never a silent load.
"""
from __future__ import annotations

import getpass
import hashlib
import os
import secrets
import shutil
import stat
import tempfile
import time
import zlib
from typing import Callable

import h5py
import numpy as np

from .status import STATUS_DIR
from .types import ShardState

STATE_FIELDS = ("params", "exp_avg", "exp_avg_sq")


class StagingError(RuntimeError):
    """A staged file that is missing, corrupt, truncated or of the wrong version."""


def scratch_root(configured: str | None) -> str:
    """Node-local scratch: the configured dir, else Slurm's per-job dir, $TMPDIR, the system temp dir."""
    if configured:
        return os.path.expandvars(configured)
    return os.environ.get("SLURM_TMPDIR") or os.environ.get("TMPDIR") or tempfile.gettempdir()


RUN_ID_ENV = "DYNARESIZE_RUN_ID"    # set by the launcher, which removes the run's staging when it ends


def new_run_id() -> str:
    """A job's random identity: names its staging directory and is written into every staged file."""
    return secrets.token_hex(8)


def job_staging_dir(configured: str | None, run_id: str) -> str:
    """The job-private staging directory of run `run_id` on this node's scratch."""
    return os.path.join(scratch_root(configured), f"dynaresize-{getpass.getuser()}-{run_id}")


def make_private_dir(path: str) -> None:
    """Create directory `path` (mode 0700) or accept it if this user made it private before (other
    ranks of the job share it). Anything else there (another user's, a link, open to others) is
    refused: a pre-created directory could feed or read our state."""
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)       # mkdir's mode is filtered by the umask; this is not
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise StagingError(f"{path} exists but is not a private directory of this user (owner uid {st.st_uid}, "
                           f"mode {oct(stat.S_IMODE(st.st_mode))}{', a link' if stat.S_ISLNK(st.st_mode) else ''}): "
                           f"refusing to stage there. Fix: remove it, or set cluster.local_scratch to a directory "
                           f"only you can write")


def remove_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


# RUN_DIR/.ranks/staged-RUN_ID: an attempt of the run that may have staged on the nodes' scratch.
# A rank that Slurm kills (a cancel, a lost node, the end of a requeued attempt) cannot remove its
# staging; the run's next attempt does, on every node it runs on.
STAGED_MARK = "staged-"


def staged_mark(run_dir: str, run_id: str) -> str:
    return os.path.join(run_dir, STATUS_DIR, STAGED_MARK + run_id)


def remove_mark(run_dir: str, run_id: str) -> None:
    try:
        os.remove(staged_mark(run_dir, run_id))
    except FileNotFoundError:
        pass


def earlier_attempts(run_dir: str, run_id: str) -> list[str]:
    """The run ids of the run's earlier attempts that may have left staging behind."""
    try:
        names = os.listdir(os.path.join(run_dir, STATUS_DIR))
    except OSError:
        return []
    return [n[len(STAGED_MARK):] for n in names if n.startswith(STAGED_MARK) and n[len(STAGED_MARK):] != run_id]


def remove_earlier_staging(run_dir: str, configured: str | None, run_id: str) -> list[str]:
    """Remove, on this node, the staging directories of the run's earlier attempts; the removed."""
    removed = []
    for old in earlier_attempts(run_dir, run_id):
        path = job_staging_dir(configured, old)
        if os.path.isdir(path):
            remove_dir(path)
            removed.append(path)
    return removed


def shard_path(directory: str, version: int, rank: int) -> str:
    return os.path.join(directory, f"v{version:05d}", f"rank{rank:05d}.h5")


FAILED = ".failed"     # suffix of the file a writer that failed leaves for the readers
BOUND = ("run_id", "table_version", "lo", "hi", "step", "chunk")   # attributes a staged file is bound to


def header_digest(attrs, crcs: dict[str, np.ndarray]) -> str:
    """SHA-256 over what binds a staged file to its run and range, and over its chunks' CRCs."""
    h = hashlib.sha256(repr(tuple(str(attrs[k]) for k in BOUND)).encode())
    for name in STATE_FIELDS:
        h.update(np.ascontiguousarray(crcs[name], "<u4").tobytes())
    return h.hexdigest()


def write_shard(path: str, shard: ShardState, version: int, buffer_mb: int, run_id: str, fsync: bool = False,
                hold: Callable[[], None] | None = None) -> int:
    """Write `shard` to `path` one `buffer_mb` chunk at a time; returns the bytes written.

    Chunks go to the file as they are (HDF5 direct chunk writes: no selection or conversion
    machinery), each with its CRC32; the last one is zero-padded to the chunk size. `hold` is
    called when the file is written, before it is published (renamed): run.mode=emulate holds it
    back until the emulated disk would have written it, so readers wait as long as they would.
    """
    tmp = f"{path}.tmp"
    try:
        make_private_dir(os.path.dirname(path))
        n = _write(tmp, shard, version, buffer_mb, run_id, fsync)
        if hold is not None:
            hold()
        os.replace(tmp, path)
    except OSError as e:      # a full or read-only disk: say so now, to this rank and to the readers
        _publish_failure(path, tmp, e)
        raise StagingError(f"could not write staged file {path}: {e}") from None
    return 3 * n * 4


def _write(tmp: str, shard: ShardState, version: int, buffer_mb: int, run_id: str, fsync: bool) -> int:
    """write_shard's file, under its temporary name; returns the floats per field."""
    n = shard.hi - shard.lo
    chunk = max(1, min(n, buffer_mb * 2**20 // 4))
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))     # HDF5 keeps the mode
    all_crcs = {}
    with h5py.File(tmp, "w") as f:
        f.attrs.update(lo=shard.lo, hi=shard.hi, step=shard.step, table_version=version, chunk=chunk, run_id=run_id)
        for name in STATE_FIELDS:
            src = getattr(shard, name).detach()
            ds = f.create_dataset(name, shape=(n,), dtype="<f4", chunks=(chunk,) if n else None)
            crcs = np.zeros(-(-n // chunk), dtype="<u4")
            for i, lo in enumerate(range(0, n, chunk)):
                block = src[lo:lo + chunk].cpu().float().numpy()
                if len(block) < chunk:
                    block = np.concatenate([block, np.zeros(chunk - len(block), np.float32)])
                crcs[i] = zlib.crc32(memoryview(block))
                ds.id.write_direct_chunk((lo,), memoryview(block))
            f.create_dataset(f"{name}_crc32", data=crcs)
            all_crcs[name] = crcs
        f.attrs["digest"] = header_digest(f.attrs, all_crcs)
        f.flush()
        if fsync:
            os.fsync(f.id.get_vfd_handle())
    return n


def _publish_failure(path: str, tmp: str, error: OSError) -> None:
    """Leave `path`.failed for the ranks waiting for `path` (wait_for), with the error if the disk
    takes it (an empty file still says it; a full disk has room for a name)."""
    try:
        os.remove(tmp)         # room for the marker, and no leftover
    except OSError:
        pass
    try:
        fd = os.open(path + FAILED, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    except OSError:
        return                 # a read-only disk: the readers time out naming the file
    try:
        os.write(fd, str(error).encode()[:2000])
    except OSError:
        pass
    finally:
        os.close(fd)


def wait_for(path: str, timeout_s: float = 120.0) -> None:
    """Staged files appear atomically (renamed when complete); wait for one written by another
    rank, or for its writer's word that it failed (`path`.failed)."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if os.path.exists(path + FAILED):
            try:
                with open(path + FAILED) as f:
                    why = f.read().strip()
            except OSError:
                why = ""
            raise StagingError(f"staged file {path} will not appear: its writer failed: "
                               f"{why or 'see the error of the rank that wrote it'}")
        if time.monotonic() > deadline:
            raise StagingError(f"staged file {path} did not appear within {timeout_s:.0f} s")
        time.sleep(0.002)


def read_range(path: str, version: int, lo: int, hi: int, run_id: str,
               out: dict[str, np.ndarray] | None = None,
               holds: tuple[int, int] | None = None) -> tuple[dict[str, np.ndarray], int]:
    """Read [lo, hi) of the flat vector from one staged shard file of run `run_id` and table
    `version`, verifying its header digest and every chunk it touches; `holds`: the range the
    file must hold (its writer's whole shard).

    Returns ({field: hi - lo floats}, AdamW step count); fills `out`'s arrays if given.
    """
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise StagingError(f"staged file {path} is unreadable (truncated or not HDF5): {e}") from None
    with f:
        try:
            attrs = {k: f.attrs[k] for k in BOUND}
            crcs = {name: f[f"{name}_crc32"][...] for name in STATE_FIELDS}
            digest = f.attrs["digest"]
        except (KeyError, OSError) as e:
            raise StagingError(f"staged file {path} is damaged or not a staged shard ({e}): refusing it") from None
        if str(attrs["run_id"]) != run_id:
            raise StagingError(f"staged file {path} was written by another run (run id {attrs['run_id']}, this "
                               f"run {run_id}): refusing a stale file")
        if int(attrs["table_version"]) != version:
            raise StagingError(f"staged file {path} is for table version {int(attrs['table_version'])}, "
                               f"expected {version}: refusing a stale file")
        if header_digest(attrs, crcs) != digest:
            raise StagingError(f"staged file {path}: its attributes or chunk checksums were altered (header "
                               f"digest mismatch): refusing to load it")
        f_lo, f_hi, chunk = int(attrs["lo"]), int(attrs["hi"]), int(attrs["chunk"])
        if holds is not None and (f_lo, f_hi) != tuple(holds):
            raise StagingError(f"staged file {path} holds [{f_lo}, {f_hi}), its writer's shard is {list(holds)}")
        if not (f_lo <= lo <= hi <= f_hi):
            raise StagingError(f"staged file {path} holds [{f_lo}, {f_hi}), not [{lo}, {hi})")
        out = out if out is not None else {name: np.empty(hi - lo, np.float32) for name in STATE_FIELDS}
        try:
            for name in STATE_FIELDS:
                ds = f[name]
                for c in range((lo - f_lo) // chunk, -(-(hi - f_lo) // chunk)):
                    _, raw = ds.id.read_direct_chunk((c * chunk,))
                    if zlib.crc32(raw) != int(crcs[name][c]):
                        raise StagingError(f"staged file {path}: checksum mismatch in dataset {name!r}, chunk {c} "
                                           f"(corrupt data): refusing to load it")
                    block = np.frombuffer(raw, np.float32)
                    a, b = max(lo, f_lo + c * chunk), min(hi, f_lo + (c + 1) * chunk)
                    out[name][a - lo:b - lo] = block[a - f_lo - c * chunk:b - f_lo - c * chunk]
        except (OSError, KeyError, ValueError) as e:
            raise StagingError(f"staged file {path} is damaged or truncated: {e}") from None
        return out, int(attrs["step"])


def read_shard(directory: str, version: int, old_owners: int, numel: int, lo: int, hi: int,
               shard_range, run_id: str, ready: Callable[[], None] | None = None) -> ShardState:
    """Assemble the state of [lo, hi) from the files of the `old_owners` ranks that staged it
    (run `run_id`). `ready` is called once every file needed has appeared, before reading
    (emulation prices the read from there)."""
    out = {name: np.empty(hi - lo, np.float32) for name in STATE_FIELDS}
    parts = []
    for q in range(old_owners):
        q_lo, q_hi = shard_range(numel, old_owners, q)
        a, b = max(lo, q_lo), min(hi, q_hi)
        if a < b:
            parts.append((shard_path(directory, version, q), a, b, (q_lo, q_hi)))
    for path, *_ in parts:
        wait_for(path)
    if ready is not None:
        ready()
    steps = set()
    for path, a, b, holds in parts:
        _, step = read_range(path, version, a, b, run_id, {name: out[name][a - lo:b - lo] for name in STATE_FIELDS},
                             holds)
        steps.add(step)
    if len(steps) > 1:
        raise StagingError(f"the staged files of table version {version} in {directory} disagree on the AdamW step "
                           f"({sorted(steps)}): refusing to load them")
    step = steps.pop() if steps else 0
    import torch        # here, not at the top: the launcher reads checkpoints through this module, without torch
    tensors = {name: torch.from_numpy(out[name]) for name in STATE_FIELDS}
    return ShardState(lo, hi, tensors["params"], tensors["exp_avg"], tensors["exp_avg_sq"], step)
