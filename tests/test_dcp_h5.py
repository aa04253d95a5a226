"""torch.distributed.checkpoint over HDF5 (dynaresize/runtime/dcp_h5.py), the storage of a
resharded resize and of sharded checkpoints, on real MPI ranks and gloo groups."""
from __future__ import annotations

import json

from conftest import run_ranks


def test_fsdp2_state_saved_by_2_ranks_loads_exactly_on_3_and_on_1(tmp_path):
    proc = run_ranks(3, "dcp_reshard", tmp_path, timeout=300)
    result = json.loads(proc.stdout.split("OK ", 1)[1])
    # every parameter and AdamW value compared bit for bit on rank 0 (the scenario asserts it)
    assert result["loaded_by_3"] == result["loaded_by_1"]
    assert result["loaded_by_3"]["tensors"] == 2 * 12 + 3          # 2 decoder layers, embedding, norm, head
    assert result["loaded_by_3"]["optimizer_values"] == 3 * result["loaded_by_3"]["tensors"]   # step, m, v
    assert result["refused"] == ["unfinished save", "another run", "corrupt byte"]
    files = sorted(p.name for p in (tmp_path / "dcp").iterdir())
    assert files == [".metadata", "shard-00000.h5", "shard-00001.h5"]        # one file per saving rank
    assert all((p.stat().st_mode & 0o777) == 0o600 for p in (tmp_path / "dcp").iterdir())
