"""torch.distributed.checkpoint (DCP) over HDF5: the storage layer of a resharded resize and of
sharded checkpoints.

DCP computes what each rank must write and, on load, which byte ranges of which saved shards fill
each rank's new shards, from the state dict's sharding (its metadata and planner); this module
only stores what DCP hands it, as the project's staging does:

- every rank that saves writes ONE HDF5 file (`shard-RANK.h5`, mode 0600) under a temporary name,
  renamed when complete, so nothing half-written is ever read;
- each item (one rank's shard of one tensor, or a pickled non-tensor value) is a 1-D byte dataset
  written in chunks of `chunk_mb`, so the extra memory of a write is one chunk; its shape and
  dtype are attributes (bfloat16 included, which HDF5 has no type for), and a CRC32 of each chunk;
- the coordinator writes DCP's metadata last (`.metadata`, pickled, also renamed into place), with
  the run id when one is given: a folder of another run, or one whose saving did not finish, is
  refused, never loaded;
- a load reads only the items DCP's plan names, and of an item cut along its first dimension (an
  FSDP shard) only the chunks that hold the rows asked for; it checks the CRC of every chunk it
  reads (a flipped byte or a truncated file is an error, never a silent load) and copies the
  requested hyperslab into the tensor DCP resolves.

    dcp.save(state, storage_writer=H5Writer(folder, run_id), process_group=old_group)
    dcp.load(state, storage_reader=H5Reader(folder, run_id), process_group=new_group)

The fully sharded trainer (fsdp.py) resizes and checkpoints through it; tests/test_dcp_h5.py
reshards FSDP2 state from 2 ranks to 3 and to 1 through it.
"""
from __future__ import annotations

import io
import os
import pickle
import zlib
from dataclasses import dataclass, replace

import h5py
import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan,
                                                  SavePlanner, WriteItemType)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

METADATA = ".metadata"
FORMAT = "dynaresize-dcp-h5/1"


class CheckpointStorageError(RuntimeError):
    """A shard file or metadata that is missing, corrupt, truncated or of another run."""


@dataclass(frozen=True)
class ItemLocation:
    """Where a saved item lives: its file (relative to the folder) and dataset."""
    file: str
    dataset: str


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _write_bytes(f: h5py.File, name: str, data: np.ndarray, chunk_bytes: int, **attrs) -> None:
    """`data` (uint8, 1-D) as a chunked dataset with one CRC32 per chunk."""
    n = data.size
    chunk = max(min(chunk_bytes, n), 1)
    ds = f.create_dataset(name, shape=(n,), dtype=np.uint8, chunks=(chunk,) if n else None)
    crcs = []
    for lo in range(0, n, chunk):
        piece = data[lo:lo + chunk]
        ds[lo:lo + piece.size] = piece
        crcs.append(zlib.crc32(piece))
    ds.attrs["crc32"] = np.asarray(crcs, dtype=np.uint32)
    ds.attrs["chunk"] = chunk
    for key, value in attrs.items():
        ds.attrs[key] = value


def _read_bytes(ds: h5py.Dataset, where: str, lo: int = 0, hi: int | None = None) -> np.ndarray:
    """Bytes [lo, hi) of a dataset written by _write_bytes (all of it by default): the chunks that
    cover them are read and each checked against its CRC32."""
    n, chunk, crcs = ds.shape[0], int(ds.attrs["chunk"]), ds.attrs["crc32"]
    if len(crcs) != -(-n // chunk):
        raise CheckpointStorageError(f"{where}: {n} bytes do not fill {len(crcs)} chunks (truncated)")
    hi = n if hi is None else hi
    first, last = lo // chunk, -(-hi // chunk)
    data = ds[first * chunk:min(last * chunk, n)]
    for i in range(first, last):
        piece = data[(i - first) * chunk:(i - first + 1) * chunk]
        if zlib.crc32(piece) != int(crcs[i]):
            raise CheckpointStorageError(f"{where}: chunk {i} fails its CRC32 (corrupt)")
    return data[lo - first * chunk:hi - first * chunk]


def _row_span(shape: tuple[int, ...], offsets, lengths) -> tuple[int, int] | None:
    """The element range [lo, hi) of a hyperslab that cuts the first dimension only (an FSDP shard
    of a row-major tensor is one), else None."""
    if any(o != 0 or n != d for o, n, d in zip(offsets[1:], lengths[1:], shape[1:])) or not shape:
        return None
    row = int(np.prod(shape[1:], dtype=np.int64))
    return offsets[0] * row, (offsets[0] + lengths[0]) * row


def _tensor_bytes(t: torch.Tensor) -> np.ndarray:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else np.zeros(0, np.uint8)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class H5Writer(StorageWriter):
    """DCP's storage writer: one HDF5 file per saving rank in `folder` (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike, run_id: str | None = None, chunk_mb: int = 4,
                 fsync: bool = False):
        super().__init__()
        self.folder, self.run_id, self.chunk_bytes = str(folder), run_id, chunk_mb << 20
        self.fsync = fsync                   # a checkpoint's files reach the disk before it counts
        self.bytes_written = 0               # of the items' contents, by this rank
        self.is_coordinator = False

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.folder = str(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # each saving rank's file, named by its place among the ranks of the save
        return [replace(p, storage_data=f"shard-{i:05d}.h5") for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = plan.storage_data
        path = os.path.join(self.folder, name)
        tmp = f"{path}.tmp-{os.getpid()}"
        results = []
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.close(fd)
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = FORMAT
            f.attrs["run_id"] = self.run_id or ""
            for i, item in enumerate(plan.items):
                data = planner.resolve_data(item)
                dataset = f"item-{i:06d}"
                if item.type == WriteItemType.BYTE_IO:
                    raw = np.frombuffer(data.getbuffer(), dtype=np.uint8)
                    _write_bytes(f, dataset, raw, self.chunk_bytes, kind="bytes")
                else:
                    _write_bytes(f, dataset, _tensor_bytes(data), self.chunk_bytes, kind="tensor",
                                 shape=np.asarray(data.shape, dtype=np.int64), dtype=_dtype_name(data.dtype))
                results.append(WriteResult(index=item.index, size_in_bytes=int(f[dataset].shape[0]),
                                           storage_data=ItemLocation(name, dataset)))
                self.bytes_written += int(f[dataset].shape[0])
        if self.fsync:
            _fsync(tmp)
        os.replace(tmp, path)
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        path = os.path.join(self.folder, METADATA)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            pickle.dump({"format": FORMAT, "run_id": self.run_id or "", "metadata": metadata}, f)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.folder)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


class H5Reader(StorageReader):
    """DCP's storage reader of a folder H5Writer wrote (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike, run_id: str | None = None):
        super().__init__()
        self.folder, self.run_id = str(folder), run_id
        self.storage_data: dict[MetadataIndex, ItemLocation] = {}
        self.bytes_read = 0                 # of the datasets' contents, by this rank
        self._metadata: Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.folder, self._metadata = str(checkpoint_id), None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is not None:     # read once (a trainer's load looks at it before DCP does)
            return self._metadata
        path = os.path.join(self.folder, METADATA)
        if not os.path.exists(path):
            raise CheckpointStorageError(f"{path}: no metadata (the save did not finish, or this is not a checkpoint)")
        with open(path, "rb") as f:
            saved = pickle.load(f)
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            raise CheckpointStorageError(f"{path}: not a {FORMAT} checkpoint")
        if self.run_id is not None and saved["run_id"] != self.run_id:
            raise CheckpointStorageError(f"{path}: written by run {saved['run_id'] or '(none)'}, not this run "
                                         f"({self.run_id}): refused")
        self._metadata = saved["metadata"]
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].file, []).append(item)
        for name, items in per_file.items():
            path = os.path.join(self.folder, name)
            try:
                f = h5py.File(path, "r")
            except OSError as e:
                raise CheckpointStorageError(f"{path}: cannot be read ({e})") from None
            with f:
                if self.run_id is not None and f.attrs.get("run_id") != self.run_id:
                    raise CheckpointStorageError(f"{path}: of another run, refused")
                for item in items:
                    self._read_item(f, path, item, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_item(self, f: h5py.File, path: str, item: ReadItem, planner: LoadPlanner) -> None:
        where = f"{path}:{self.storage_data[item.storage_index].dataset}"
        ds = f[self.storage_data[item.storage_index].dataset]
        if item.type == LoadItemType.BYTE_IO:
            raw = _read_bytes(ds, where)
            self.bytes_read += raw.size
            planner.load_bytes(item, io.BytesIO(raw.tobytes()))
            return
        dtype = getattr(torch, ds.attrs["dtype"])
        shape = tuple(int(x) for x in ds.attrs["shape"])
        span = _row_span(shape, list(item.storage_offsets), list(item.lengths))
        if span is not None:     # only the rows asked for: a rank reads what overlaps its new shard
            size = torch.empty((), dtype=dtype).element_size()
            raw = _read_bytes(ds, where, span[0] * size, span[1] * size)
            saved = (torch.from_numpy(raw).view(dtype) if raw.size else torch.empty(0, dtype=dtype))
            saved = saved.reshape((item.lengths[0], *shape[1:]))
        else:
            raw = _read_bytes(ds, where)
            # the bytes read, reinterpreted in place (no copy of a shard that may be gigabytes)
            saved = torch.from_numpy(raw).view(dtype) if raw.size else torch.empty(0, dtype=dtype)
            saved = saved.reshape(shape)
            for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                saved = saved.narrow(dim, offset, length)
        self.bytes_read += raw.size
        target = planner.resolve_tensor(item).detach()
        if target.size() != saved.size():
            raise CheckpointStorageError(f"{where}: holds {tuple(saved.shape)} where {tuple(target.shape)} is read")
        target.copy_(saved)
        planner.commit_tensor(item, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


__all__ = ["CheckpointStorageError", "H5Reader", "H5Writer", "ItemLocation"]
