"""Tests of the offline analysis package (analysis/): metrics against hand-computed values,
report files, run comparison, following a running job, no torch/MPI, and bad files.

Over 400 lines: one test per metric definition of dynaresize/analysis/metrics.py, checked against
hand-computed values on the same small timelines (analysis_fixtures), so they stay in one file."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections import defaultdict

import h5py
import numpy as np
import pytest

from analysis_fixtures import (HAND_EVENTS, ROOT, child_env, ev, it, sample, write_hand_timeline,
                               write_simple_run, write_timeline)

from dynaresize import analysis  # noqa: E402  (analysis_fixtures puts the repository root on sys.path)
from dynaresize.analysis.cli import main
from dynaresize.timeline import schema
from dynaresize.timeline.schema import TimelineError


@pytest.fixture
def hand(tmp_path):
    return write_hand_timeline(tmp_path / "run" / "timeline.h5")


# ---------------------------------------------------------------------------------------------
# 1. Metrics equal hand-computed values

def test_metrics_hand_computed(hand):
    tl = analysis.load_timeline(hand.parent)
    assert tl.policy == "dynamic" and tl.initial_train_ranks == 2 and tl.world_size == 4
    assert str(tl.events["name"].iloc[1]) == "rollout"
    assert tl.decisions["reason"].tolist() == ["rollout_bound", "balanced"]
    assert schema.decode_attrs(tl.events["attrs"].iloc[8].encode()) == {"to": "rollout"}

    # Busy = union of rollout/train/weight_sync and switch-op intervals clipped to the span;
    # exchange and bookkeeping (startup, decide) are not busy.
    # iteration 0, span [0, 10]
    busy0 = {0: 6 + 1,                      # rollout [0,6] + weight_sync [8,9]
             1: 8 + 1,                      # rollout [0,8] + weight_sync [8,9]
             2: 9.5 - 1,                    # train [1,7] u stage_out [6,9.5] u weight_sync [8,9]
             3: 6 + 1}                      # train [1,7] + weight_sync [8,9]; exchange not busy
    # iteration 1, span [10, 20]
    busy1 = {0: 6 + 1,                      # rollout [10,16] + weight_sync [18,19]
             1: 5 + 1,                      # rollout [10,15] + weight_sync; exchange not busy
             2: (17 - 10) + 1,              # stage_in [9,10.5] clipped to [10,10.5]
                                            # u engine_start [10,12] u weight_load [11.5,12.5]
                                            # u rollout [12,17], + weight_sync [18,19]
             3: 8 + 1 + 0.5}                # train [10,18] + weight_sync + commit [19.5,20] (clipped)
    role0 = {0: "rollout", 1: "rollout", 2: "train", 3: "train"}
    role1 = {0: "rollout", 1: "rollout", 2: "rollout", 3: "train"}
    switching0 = {0: 0, 1: 0, 2: 3.5, 3: 0}
    switching1 = {0: 0, 1: 0, 2: 12.5 - 10, 3: 0.5}
    ri = analysis.rank_iterations(tl).set_index(["iteration", "rank"])
    for i, busy, role, switching in ((0, busy0, role0, switching0), (1, busy1, role1, switching1)):
        for rank in range(4):
            row = ri.loc[(i, rank)]
            assert row["busy_s"] == pytest.approx(busy[rank]), (i, rank)
            assert row["idle_s"] == pytest.approx(10 - busy[rank]), (i, rank)
            assert row["role"] == role[rank], (i, rank)
            assert row["switching_s"] == pytest.approx(switching[rank]), (i, rank)

    its = analysis.iteration_metrics(tl).set_index("iteration")
    expected = {
        0: dict(train_ranks=2, rollout_ranks=2, span_s=10,
                rollout_time_s=max(6, 8), train_time_s=max(6, 6), weight_sync_time_s=1,
                switch_ops=1, switch_total_s=3.5, switch_critical_s=0, switch_hidden_s=3.5,
                hidden_share=1 - 0 / 3.5,
                bubble_rollout=((10 - 7) + (10 - 9)) / (10 * 2),      # 0.2
                bubble_train=((10 - 8.5) + (10 - 7)) / (10 * 2),      # 0.225
                samples=4, tokens=10 + 20 + 30 + 40, tokens_per_s=100 / 10, samples_per_s=4 / 10,
                mean_reward=(1 + 0 + 1 + 0) / 4, mean_response_len=25,
                # p99 with linear interpolation: position 0.99 * (4 - 1) = 2.97 -> 30 + 0.97 * 10
                p99_response_len=30 + 0.97 * 10),
        1: dict(train_ranks=1, rollout_ranks=3, span_s=10,
                rollout_time_s=max(6, 5, 5), train_time_s=8, weight_sync_time_s=1,
                # stage_in 1.5, engine_start 2 (critical), weight_load 1, commit 1 (unclipped)
                switch_ops=4, switch_total_s=1.5 + 2 + 1 + 1,
                switch_critical_s=2, switch_hidden_s=1.5 + 1 + 1, hidden_share=1 - 2 / 5.5,
                bubble_rollout=((10 - 7) + (10 - 6) + (10 - 8)) / (10 * 3),   # 0.3
                bubble_train=(10 - 9.5) / (10 * 1),                            # 0.05
                samples=3, tokens=5 + 15 + 25, tokens_per_s=45 / 10, samples_per_s=3 / 10,
                mean_reward=(1 + 1 + 0) / 3, mean_response_len=15,
                # position 0.99 * (3 - 1) = 1.98 -> 15 + 0.98 * 10
                p99_response_len=15 + 0.98 * 10),
    }
    for i, values in expected.items():
        for column, value in values.items():
            assert its.loc[i, column] == pytest.approx(value), (i, column)
        assert math.isnan(its.loc[i, "bubble_both"])
    assert its.loc[0, "decision"] == "move" and its.loc[0, "decision_reason"] == "rollout_bound"
    assert its.loc[0, "decision_to_train"] == 1 and its.loc[1, "decision"] == "keep"

    m = analysis.run_metrics(tl)
    lengths = [10, 20, 30, 40, 5, 15, 25]
    assert m["iterations"] == 2 and m["split"] == "2/2" and m["final_split"] == "1/3"
    assert m["total_time_s"] == pytest.approx(20 - 0)
    assert m["tokens"] == sum(lengths) == 145
    assert m["tokens_per_s"] == pytest.approx(145 / 20)
    assert m["samples_per_s"] == pytest.approx(7 / 20)
    assert m["mean_reward"] == pytest.approx(4 / 7)
    assert m["mean_response_len"] == pytest.approx(145 / 7)
    # sorted lengths 5 10 15 20 25 30 40; position 0.99 * 6 = 5.94 -> 30 + 0.94 * 10
    assert m["p99_response_len"] == pytest.approx(30 + 0.94 * 10)
    assert m["switch_ops"] == 5
    assert m["switch_total_s"] == pytest.approx(3.5 + 5.5)
    assert m["switch_critical_s"] == pytest.approx(2)
    assert m["hidden_share"] == pytest.approx(1 - 2 / 9)
    assert m["resizes"] == 1 and m["decisions"] == 2
    rollout_idle = (3 + 1) + (3 + 4 + 2)
    train_idle = (1.5 + 3) + 0.5
    assert m["bubble_rollout"] == pytest.approx(rollout_idle / (10 * 2 + 10 * 3))   # 0.26
    assert m["bubble_train"] == pytest.approx(train_idle / (10 * 2 + 10 * 1))       # 1/6
    assert m["bubble_all"] == pytest.approx((rollout_idle + train_idle) / 80)
    gt = m["gpu_time"]
    assert gt["rollout"]["total_s"] == pytest.approx(50)
    assert gt["rollout"]["busy_s"] == pytest.approx(7 + 9 + 7 + 6 + 8)
    assert gt["rollout"]["idle_s"] == pytest.approx(rollout_idle)
    assert gt["rollout"]["switching_s"] == pytest.approx(2.5)
    assert gt["train"]["total_s"] == pytest.approx(30)
    assert gt["train"]["busy_s"] == pytest.approx(8.5 + 7 + 9.5)
    assert gt["train"]["switching_s"] == pytest.approx(3.5 + 0.5)
    assert gt["all"]["busy_s"] + gt["all"]["idle_s"] == pytest.approx(4 * 20)
    assert m["outside_iterations_s"] == pytest.approx(0)


def test_union_against_brute_force():
    rng = np.random.default_rng(1)
    group = rng.integers(0, 5, 300)
    start = rng.uniform(0, 100, 300)
    end = start + rng.exponential(5, 300)
    lengths = analysis.metrics.union_length(group, start, end, 5)
    grid = np.linspace(0, 200, 400_001)           # step 0.0005
    for g in range(5):
        covered = np.zeros(len(grid), dtype=bool)
        for s, e in zip(start[group == g], end[group == g]):
            covered |= (grid >= s) & (grid < e)
        assert lengths[g] == pytest.approx(covered.sum() * (grid[1] - grid[0]), abs=0.05)


def test_partial_run_ignores_iteration_in_flight(tmp_path):
    """Events and samples of an iteration without its iterations row (killed job) are ignored."""
    path = write_timeline(
        tmp_path / "timeline.h5", world_size=2, complete=False,
        events=[ev(0, 0, "rollout", "rollout", 0, 4), ev(0, 1, "train", "train", 0, 2),
                ev(1, 0, "rollout", "rollout", 5, 9)],
        iterations=[it(0, 1, 1, 0, 5)],
        samples=[sample(0, 0, 0, 10, 1.0), sample(1, 0, 0, 99, 0.0)])
    tl = analysis.load_timeline(path)
    m = analysis.run_metrics(tl)
    assert not m["complete"] and m["iterations"] == 1
    assert m["tokens"] == 10 and m["tokens_per_s"] == pytest.approx(10 / 5)
    assert m["bubble_rollout"] == pytest.approx((5 - 4) / 5)
    assert m["bubble_train"] == pytest.approx((5 - 2) / 5)


def test_empty_timeline_report(tmp_path, capsys):
    path = write_timeline(tmp_path / "empty" / "timeline.h5", complete=False)
    assert main([str(path.parent)]) == 0
    m = analysis.run_metrics(analysis.load_timeline(path))
    assert m["iterations"] == 0 and math.isnan(m["tokens_per_s"])
    assert (path.parent / "report" / "gantt.png").is_file()


# ---------------------------------------------------------------------------------------------
# 2. Report files

def _image(path):
    from matplotlib.image import imread
    return imread(path)


def test_report_files(hand, capsys):
    assert main([str(hand.parent)]) == 0
    out = capsys.readouterr().out
    assert f"hidden share {100 * (1 - 2 / 9):.1f}%" in out and "report written to" in out
    report = hand.parent / "report"
    for name in ("summary.csv", "summary.json", "gantt.png", "trace.json"):
        assert (report / name).is_file(), name

    import pandas as pd
    csv = pd.read_csv(report / "summary.csv")
    assert csv["iteration"].tolist() == [0, 1]
    assert csv["tokens"].tolist() == [100, 45]
    summary = json.loads((report / "summary.json").read_text())
    assert summary["run"]["tokens"] == 145 and len(summary["iterations"]) == 2
    assert summary["run"]["bubble_both"] is None
    assert [d["action"] for d in summary["decisions"]] == ["move", "keep"]

    image = _image(report / "gantt.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image[..., :3].var() > 0

    # Explicit size, per-event drawing and aggregated rows.
    tl = analysis.load_timeline(hand)
    for kwargs in ({}, {"max_rows": 2}):
        png = report / f"gantt_{len(kwargs)}.png"
        analysis.gantt(tl, png, width=8, height=5, dpi=80, **kwargs)
        image = _image(png)
        assert image.shape[:2] == (5 * 80, 8 * 80)
        assert image[..., :3].var() > 0

    trace = json.loads((report / "trace.json").read_text())
    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e["ph"] == "M" and e["name"] == "process_name"}
    assert processes == {r: f"rank {r}" for r in range(4)}
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e["ph"] == "M" and e["name"] == "thread_name"}
    busy = defaultdict(float)
    count = defaultdict(int)
    recorded = defaultdict(float)
    for e in events:
        if e["ph"] != "X":
            continue
        assert e["dur"] >= 0 and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert (e["pid"], e["tid"]) in tracks
        if e["cat"] == "busy":
            busy[e["pid"]] += e["dur"]
            count[e["pid"]] += 1
        else:
            recorded[(e["pid"], e["name"])] += e["dur"]
            assert tracks[(e["pid"], e["tid"])].split(" #")[0] in (
                e["name"], "switch (critical)", "switch (background)", "other")
    # Busy time per rank over both iterations (hand-computed in test 1), in microseconds.
    hand_busy = {0: 7 + 7, 1: 9 + 6, 2: 8.5 + 8, 3: 7 + 9.5}
    for rank, seconds in hand_busy.items():
        assert abs(busy[rank] - seconds * 1e6) <= count[rank] * 1.0, rank
    # Every recorded event is in the trace with its duration.
    expected = defaultdict(float)
    for e in HAND_EVENTS:
        expected[(e["rank"], e["name"])] += (e["end"] - e["start"]) * 1e6
    assert recorded.keys() == expected.keys()
    for key, value in expected.items():
        assert recorded[key] == pytest.approx(value, abs=1.0), key
    assert sum(1 for e in events if e["ph"] == "i") == 2
    _assert_tracks_do_not_overlap(events)


def _assert_tracks_do_not_overlap(events):
    """Perfetto needs the slices of one track (pid, tid) to nest; ours must not even overlap."""
    by_track = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            by_track[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_track.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    return by_track


def test_trace_overlapping_ops_get_separate_lanes(tmp_path):
    path = write_timeline(tmp_path / "timeline.h5", world_size=1, events=[
        ev(0, 0, "rollout", "rollout", 0, 5),
        ev(0, 0, "rollout", "stage_out", 1, 4, critical=schema.BACKGROUND),
        ev(0, 0, "rollout", "reshard", 2, 6, critical=schema.BACKGROUND),
        ev(0, 0, "rollout", "release", 4.5, 5, critical=schema.BACKGROUND)],
        iterations=[it(0, 0, 1, 0, 6)])
    events = analysis.perfetto_trace(analysis.load_timeline(path))["traceEvents"]
    by_track = _assert_tracks_do_not_overlap(events)
    assert len([k for k in by_track if k[1] % 100 == 6]) == 2     # two background lanes


def test_gantt_many_ranks(tmp_path):
    """256 ranks: rows aggregate blocks of ranks; the image has the requested size."""
    ranks, events = 256, []
    for i in range(3):
        for r in range(ranks):
            role = "train" if r < 100 else "rollout"
            events.append(ev(i, r, role, role, 10 * i, 10 * i + 4 + (r % 5)))
        events.append(ev(i, 99, "train", "engine_start", 10 * i + 8, 10 * i + 9, critical=1))
    path = write_timeline(tmp_path / "timeline.h5", world_size=ranks, events=events,
                          iterations=[it(i, 100, 156, 10 * i, 10 * i + 10) for i in range(3)])
    fig = analysis.gantt(analysis.load_timeline(path), tmp_path / "g.png", width=10, height=6,
                         dpi=50)
    assert "blocks of 4 ranks" in fig.texts[0].get_text()
    image = _image(tmp_path / "g.png")
    assert image.shape[:2] == (300, 500) and image[..., :3].var() > 0


# ---------------------------------------------------------------------------------------------
# 3. Comparing runs

def _three_runs(root):
    # static 1 train rank: one iteration [0, 10], 100 tokens  -> 10 tokens/s
    write_simple_run(root / "0", "static", 1, [(0, 10)], 100, overrides=["policy=static", "policy.train_ranks=1"])
    # static 2 train ranks: one iteration [0, 8], 100 tokens   -> 12.5 tokens/s
    write_simple_run(root / "1", "static", 2, [(0, 8)], 100, overrides=["policy=static", "policy.train_ranks=2"])
    # dynamic: iterations [0, 4] and [4, 7], 50 tokens each    -> 100/7 tokens/s
    write_simple_run(root / "2", "threshold", 2, [(0, 4), (4, 7)], 50, overrides=["policy=threshold"])


def test_compare_multirun(tmp_path, capsys):
    root = tmp_path / "multirun"
    _three_runs(root)
    assert main(["compare", str(root)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()]
    runs = [r for r in rows if r and r[0] in ("0", "1", "2")]
    assert [r[0] for r in runs] == ["0", "1", "2"]
    assert [r[1:3] for r in runs] == [["static", "1"], ["static", "2"], ["threshold", "-"]]   # the swept overrides
    assert [r[3] for r in runs] == ["static", "static", "threshold"]
    assert [r[4] for r in runs] == ["1/3", "2/2", "2/2"]
    best_dynamic, best_static = 100 / 7, 100 / 8
    assert f"dynamic/best static throughput: {best_dynamic / best_static:.3f}" in out
    assert "oracle" not in out

    df = analysis.compare(root)
    assert df["tokens_per_s"].tolist() == pytest.approx([100 / 10, 100 / 8, 100 / 7])
    assert df["overrides"].tolist()[0] == "policy=static policy.train_ranks=1"
    assert df["policy.train_ranks="].tolist() == ["1", "2", "-"] and df["policy="].tolist()[2] == "threshold"
    assert df[["final_reward", "eval_reward"]].columns.tolist() == ["final_reward", "eval_reward"]
    r = analysis.ratios(df)
    assert r["dynamic_vs_best_static"] == pytest.approx(best_dynamic / best_static)   # 8/7
    assert r["best_static"] == "1" and r["best_dynamic"] == "2"
    assert math.isnan(r["dynamic_vs_oracle"])
    csv = (root / "compare.csv").read_text().splitlines()
    assert len(csv) == 1 + 3 and csv[0].startswith("run,policy,")


def test_compare_oracle_and_bad_run(tmp_path, capsys):
    root = tmp_path / "sweep"
    _three_runs(root / "a")
    write_simple_run(root / "b" / "oracle", "oracle", 2, [(0, 6)], 100)    # 100/6 tokens/s
    (root / "c").mkdir()
    (root / "c" / "timeline.h5").write_text("not a timeline")
    assert main(["compare", str(root)]) == 0
    captured = capsys.readouterr()
    assert f"dynamic/oracle throughput: {(100 / 7) / (100 / 6):.3f}" in captured.out
    assert "skipped" in captured.err and "not an HDF5 file" in captured.err


# ---------------------------------------------------------------------------------------------
# 4. Following a running job

WRITER = textwrap.dedent("""
    import sys, time
    from dynaresize.timeline.writer import TimelineWriter
    path, n = sys.argv[1], int(sys.argv[2])
    time.sleep(0.3)
    w = TimelineWriter(path, {"world_size": 2,
                              "config": "policy:\\n  name: static\\n  train_ranks: 1\\n"})
    for i in range(n):
        t = float(i)
        w.append("events", [dict(iteration=i, rank=0, role="train", name="train", start=t,
                                 end=t + 0.5, critical=-1),
                            dict(iteration=i, rank=1, role="rollout", name="rollout", start=t,
                                 end=t + 0.8, critical=-1)])
        w.append("samples", [dict(iteration=i, rank=1, response_len=10 * (i + 1), reward=0.5)])
        w.append("iterations", [dict(iteration=i, table_version=0, train_ranks=1,
                                     rollout_ranks=1, start=t, end=t + 1.0)])
        w.flush()
        print("wrote", i, flush=True)
        time.sleep(0.3)
    w.close(complete=True)
    print("closed", flush=True)
""")


def _lines_with_times(stream, sink):
    for line in stream:
        sink.append((time.monotonic(), line.rstrip("\n")))


def test_follow_sees_iterations_while_written(tmp_path):
    n = 6
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    timeline = tmp_path / "run" / "timeline.h5"
    timeline.parent.mkdir()
    follow_out, writer_out = [], []
    follower = subprocess.Popen(
        [sys.executable, "-m", "dynaresize.analysis.cli", str(timeline.parent), "--follow", "--interval",
         "0.1", "--timeout", "25"], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    reader = threading.Thread(target=_lines_with_times, args=(follower.stdout, follow_out))
    reader.start()
    deadline = time.monotonic() + 20
    while not follow_out and time.monotonic() < deadline:   # follower is up and waiting
        time.sleep(0.05)
    writer = subprocess.Popen([sys.executable, str(script), str(timeline), str(n)], cwd=ROOT,
                              env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    writer_reader = threading.Thread(target=_lines_with_times, args=(writer.stdout, writer_out))
    writer_reader.start()
    try:
        assert writer.wait(timeout=30) == 0, writer_out
        assert follower.wait(timeout=30) == 0, follow_out
    finally:
        for p in (writer, follower):
            if p.poll() is None:
                p.kill()
        reader.join(5)
        writer_reader.join(5)
    lines = [text for _, text in follow_out]
    iteration_lines = [text for text in lines if text.startswith("iteration")]
    assert [int(text.split()[1]) for text in iteration_lines] == list(range(n)), lines
    assert all("split 1/1" in text for text in iteration_lines)
    assert "20.0 tokens/s" in iteration_lines[1]          # 20 tokens in a 1 s span
    assert lines[-1].startswith(f"run complete: {n} iterations"), lines
    # Seen live: the first iteration was printed before the writer closed the file.
    closed_at = next(t for t, text in writer_out if text == "closed")
    first_at = next(t for t, text in follow_out if text.startswith("iteration"))
    assert first_at < closed_at


def test_follow_timeout_on_incomplete_file(tmp_path, capsys):
    path = write_timeline(tmp_path / "timeline.h5", iterations=[it(0, 2, 2, 0, 1)], complete=False)
    assert main([str(path), "--follow", "--interval", "0.05", "--timeout", "0.3"]) == 1
    out = capsys.readouterr().out
    assert "iteration    0" in out and "not complete" in out


# ---------------------------------------------------------------------------------------------
# 5. No torch, no MPI

NO_TORCH = textwrap.dedent("""
    import importlib.abc, sys
    BLOCKED = ("torch", "mpi4py")
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"importing {name} is blocked in this test")
            return None
    sys.meta_path.insert(0, Block())
    from dynaresize import analysis
    from dynaresize.analysis.cli import main
    tl = analysis.load_timeline(sys.argv[1])
    analysis.run_metrics(tl)
    assert main([sys.argv[1]]) == 0
    assert main(["compare", sys.argv[1]]) == 0
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    print("NO-TORCH-OK")
""")


def test_no_torch_no_mpi(hand, tmp_path):
    script = tmp_path / "no_torch.py"
    script.write_text(NO_TORCH)
    result = subprocess.run([sys.executable, str(script), str(hand.parent)], cwd=tmp_path,
                            env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "NO-TORCH-OK" in result.stdout
    for name in ("summary.csv", "summary.json", "gantt.png", "trace.json"):
        assert (hand.parent / "report" / name).is_file()


# ---------------------------------------------------------------------------------------------
# 6. Bad files

def _bad_files(tmp_path, hand):
    not_hdf5 = tmp_path / "notes.h5"
    not_hdf5.write_text("this is not HDF5\n")
    no_kind = tmp_path / "no_kind.h5"
    with h5py.File(no_kind, "w") as f:
        f.create_dataset("events", data=np.zeros(3))
    old = tmp_path / "old.h5"
    shutil.copy(hand, old)
    with h5py.File(old, "a") as f:
        f.attrs["schema_version"] = 0
    truncated = tmp_path / "truncated.h5"
    data = hand.read_bytes()
    truncated.write_bytes(data[:len(data) // 2])
    no_dataset = tmp_path / "no_dataset.h5"
    shutil.copy(hand, no_dataset)
    with h5py.File(no_dataset, "a") as f:
        del f["decisions"]
    empty_dir = tmp_path / "empty_dir"
    empty_dir.mkdir()
    return [(not_hdf5, "not an HDF5 file"),
            (no_kind, "is not a DynaResize timeline"),
            (old, "schema version 0"),
            (truncated, "truncated"),
            (no_dataset, r"lacks datasets \['decisions'\]"),
            (empty_dir, "without a timeline.h5"),
            (tmp_path / "missing", "no such file")]


def test_bad_files(tmp_path, hand, capsys):
    for path, problem in _bad_files(tmp_path, hand):
        with pytest.raises(TimelineError, match=problem) as info:
            analysis.load_timeline(path)
        assert str(path) in str(info.value)
        assert main([str(path)]) == 2, path
        err = capsys.readouterr().err
        assert err.startswith("dynaresize-analyze: error: ") and str(path) in err
    # follow: a file of another schema version is an error, not something to wait for
    old = tmp_path / "old.h5"
    assert main([str(old), "--follow", "--interval", "0.05", "--timeout", "5"]) == 2
    assert "schema version 0" in capsys.readouterr().err


def test_cli_exit_status_in_subprocess(tmp_path):
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"\x00" * 100)
    result = subprocess.run([sys.executable, "-m", "dynaresize.analysis", str(bad)], cwd=ROOT,
                            env=child_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "not an HDF5 file" in result.stderr and "Traceback" not in result.stderr
