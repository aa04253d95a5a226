"""The switch benchmark runs (tiny model, one repeat) and prints its side-by-side table."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT, _env

TINY = ["model.hidden_size=128", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "model.intermediate_size=256"]


def test_switch_benchmark_table(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dynaresize.launch.bench", "--repeats", "1", "--out", str(tmp_path), *TINY],
                          capture_output=True, text=True, timeout=400, cwd=ROOT, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    for variant in ("reuse, staging in background", "no reuse, staging in background",
                    "reuse, staging on critical path"):
        assert variant in proc.stdout
    rows = json.loads((tmp_path / "switch_bench.json").read_text())
    assert len(rows) == 6                                        # 3 variants x (grow, shrink)
    by = {v: [r for r in rows if r["variant"] == v] for v in {r["variant"] for r in rows}}
    assert all(r["groups_created"] == 0 for r in by["reuse, staging in background"])
    assert all(r["groups_created"] > 0 for r in by["no reuse, staging in background"])
    # On the critical path nothing is hidden; in the background something is.
    assert all(r["critical_sum_s"] == r["total_s"] for r in by["reuse, staging on critical path"])
    assert any(r["critical_sum_s"] < r["total_s"] for r in by["reuse, staging in background"])
    assert all(r["raw_disk_mb_s"] > 0 and r["staging_mb_s"] > 0 for r in rows)
