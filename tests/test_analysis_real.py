"""Issue 5 on real runs: the report of a real 4-rank run, and compare over a real local multirun."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pandas as pd

from conftest import ROOT, _env


def analyze(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "dynaresize.analysis.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=_env())


def test_report_of_a_real_run(static_run, tmp_path):
    run_dir = tmp_path / "run"                 # a copy: other tests read the shared run meanwhile
    shutil.copytree(static_run[0], run_dir)
    proc = analyze(run_dir)
    assert proc.returncode == 0, proc.stderr
    report = run_dir / "report"
    assert (report / "gantt.png").stat().st_size > 10_000
    trace = json.loads((report / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pids = {e["pid"] for e in events if e.get("ph") == "X"}
    assert pids == {0, 1, 2, 3}
    summary = pd.read_csv(report / "summary.csv")
    assert len(summary) == 9
    run = json.loads((report / "summary.json").read_text())["run"]
    assert run["world_size"] == 4 and run["iterations"] == 9 and run["complete"]
    assert run["total_time_s"] > 0


def test_compare_over_a_real_multirun(tmp_path):
    sweep = tmp_path / "sweep"
    # 2 ranks a point: what is compared is the sweep's four runs, not their size
    cmd = [sys.executable, "-m", "dynaresize.launch.cli", "-m", "policy=static,dynamic", "run.seed=1,2", "cluster.ranks=2",
           "policy.train_ranks=1", "run.iterations=2", "run.report=false", "run.save_model=false",
           f"hydra.sweep.dir={sweep}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = analyze("compare", sweep)
    assert out.returncode == 0, out.stderr
    assert sum("static" in ln for ln in out.stdout.splitlines()) >= 2
    assert "dynamic" in out.stdout and "best static" in out.stdout.lower(), out.stdout
    table = pd.read_csv(sweep / "compare.csv")
    assert len(table) == 4
