"""The simulator: the runtime's workload, placement, pipeline, switch plan and policies, priced by the
cost model, written as a timeline that the analysis reads unchanged."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
import yaml

from dynaresize.config import ConfigError
from dynaresize.plan.costmodel import CostModel
from dynaresize.sim import Simulator, compose, prepare, setup_from_overrides, simulate
from dynaresize.timeline import schema

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def baseline(overrides) -> list[str]:
    """The tests' reference config: a static split and 8 iterations unless the overrides say
    otherwise (the defaults are the README's demo: dynamic, 12 iterations)."""
    out = list(overrides)
    if not any(o.startswith(("policy=", "policy.name=")) for o in out):
        out.insert(0, "policy=static")
    if not any(o.startswith("run.iterations=") for o in out):
        out.insert(0, "run.iterations=8")
    return out


def run(tmp_path, name="run", *overrides, **kw):
    return simulate(setup_from_overrides(baseline(overrides)), tmp_path / name, **kw)


def read(path):
    with h5py.File(path, "r") as f:
        return dict(f.attrs), {n: f[n][...] for n in schema.DATASETS}


def events(data, name=None, it=None):
    ev = data["events"]
    if name is not None:
        ev = ev[ev["name"] == name.encode()]
    if it is not None:
        ev = ev[ev["iteration"] == it]
    return ev


# --- the runtime's workload and placement ------------------------------------------------------

def test_simulated_samples_are_the_runtimes_batches(tmp_path):
    """The samples a simulation records are make_batch's prompts and hidden response lengths, on the
    ranks placement.place_prompts gives them (one implementation for both)."""
    from dynaresize.plan.placement import place_prompts
    from dynaresize.data.workload import make_batch
    over = ["run.iterations=3", "rollout.prompts_per_batch=10", "workload.sample_sigma=0.4",
            "workload.prompt_median=20", "workload.prompt_sigma=0.5", "workload.prompt_max=40",
            "model.max_position=300"]
    setup = setup_from_overrides(baseline(over))
    s = read(simulate(setup, tmp_path / "w"))[1]["samples"]
    cfg = setup.cfg
    for b in range(3):
        mine = s[s["batch"] == b]
        prompts = make_batch(cfg.workload, cfg.run.seed, b, 10, cfg.rollout.samples_per_prompt)
        assert mine["prompt_len"].tolist() == [len(p.tokens) for p in prompts for _ in p.response_lens]
        assert mine["response_len"].tolist() == [n for p in prompts for n in p.response_lens]
        ranks = place_prompts([len(p.tokens) for p in prompts], 2) + 2           # 2 train, 2 rollout ranks
        assert mine["rank"].tolist() == [int(r) for r in ranks for _ in range(cfg.rollout.samples_per_prompt)]


# --- the timeline -------------------------------------------------------------------------------

def test_default_config_simulates_and_passes_through_analysis(tmp_path):
    from dynaresize import analysis
    path = run(tmp_path)
    tl = analysis.load_timeline(path)
    m = analysis.run_metrics(tl)
    files = analysis.write_report(tl, png=True, trace=True)
    assert {"summary.csv", "summary.json", "gantt.png", "trace.json"} <= set(files)
    attrs, data = read(path)
    assert attrs["mode"] == "simulate" and attrs["complete"] and attrs["world_size"] == 4
    assert attrs["mpi_world_size"] == 0 and attrs["policy"] == "static" and attrs["max_lag"] == 1
    config = yaml.safe_load(attrs["config"])
    assert config["policy"]["name"] == "static" and config["cluster"]["ranks"] == 4
    assert config["hardware"]["name"] == "cpu_tiny" and "sim" in config
    # every rank has events in every iteration; the pipeline of loop.py with max_lag 1
    its = data["iterations"]
    assert its["iteration"].tolist() == list(range(9)) and m["iterations"] == 9
    for it in range(9):
        assert set(events(data, it=it)["rank"]) == {0, 1, 2, 3}
    assert its["trained_batch"].tolist() == [-1] + list(range(8))
    assert its["generated_batch"].tolist() == list(range(8)) + [-1]
    assert len(events(data, "train", 0)) == 0 and len(events(data, "rollout", 8)) == 0
    assert len(data["decisions"]) == 9 and m["tokens"] > 0
    s = data["samples"]
    assert (s["response_len"] == s["length_cap"]).all() and (s["reward"] == 0).all() and (s["digest"] == 0).all()
    assert attrs["samples_recorded"]
    assert len(s) == 8 * 8 * 4
    # starts and ends are ordered, every event lies inside its iteration
    ev = events(data)
    ev = ev[ev["iteration"] >= 0]
    assert (ev["end"] >= ev["start"]).all()
    spans = {int(r["iteration"]): (r["start"], r["end"]) for r in its}
    assert all(spans[int(e["iteration"])][0] - 1e-9 <= e["start"] and e["end"] <= spans[int(e["iteration"])][1] + 1e-9
               for e in ev)


def test_deterministic(tmp_path):
    attrs, a = read(run(tmp_path, "a", "policy=dynamic", "run.iterations=20", "sim.noise=0.05"))
    b = read(run(tmp_path, "b", "policy=dynamic", "run.iterations=20", "sim.noise=0.05"))[1]
    for name in schema.DATASETS:
        assert a[name].tobytes() == b[name].tobytes(), name
    # the policy's own wall time is kept beside the datasets (it is this machine's, not simulated)
    assert 0 < attrs["decide_s_median"] <= attrs["decide_s_max"] <= attrs["decide_s_total"]
    c = read(run(tmp_path, "c", "policy=dynamic", "run.iterations=20", "sim.noise=0.05", "run.seed=7"))[1]
    assert not np.array_equal(a["events"]["end"], c["events"]["end"])


def test_charged_decisions_delay_each_next_iteration_by_their_wall_time(tmp_path):
    # sim.charge_decisions (the suite's default): every rank waits for rank 0's decision, so the
    # next iteration starts that much later; without it the simulated time leaves decisions out.
    free = read(run(tmp_path, "free", "policy=dynamic", "run.iterations=10"))[1]["iterations"]
    attrs, data = read(run(tmp_path, "charged", "policy=dynamic", "run.iterations=10", "sim.charge_decisions=true"))
    charged = data["iterations"]
    gaps = charged["start"][1:] - charged["end"][:-1]
    spans = charged["end"] - charged["start"]
    # the same iterations (decisions follow stage times, not the clock), each gap one decision's time
    np.testing.assert_allclose(spans, free["end"] - free["start"], rtol=1e-9)
    assert (gaps > 0).all() and gaps.max() <= attrs["decide_s_max"] + 1e-9
    total = charged["end"][-1] - charged["start"][0]
    assert total == pytest.approx(free["end"][-1] - free["start"][0] + gaps.sum(), rel=1e-9)
    assert gaps.sum() <= attrs["decide_s_total"] + 1e-9 and gaps.sum() >= 0.5 * attrs["decide_s_total"]


def test_synchronous_pipeline(tmp_path):
    attrs, data = read(run(tmp_path, "lag0", "run.max_lag=0", "run.iterations=5"))
    its = data["iterations"]
    assert (its["trained_batch"] == its["generated_batch"]).all() and len(its) == 5
    for it in range(5):       # training starts after the exchange, which follows the last rollout
        rollout_end = events(data, "rollout", it)["end"].max()
        assert events(data, "train", it)["start"].min() >= rollout_end


def test_stage_times_are_the_cost_models(tmp_path):
    """The simulator prices a rank's rollout with CostModel.rollout_time, the API the emulation uses."""
    setup = setup_from_overrides(baseline(["run.iterations=4", "rollout.prompts_per_batch=12"]))
    attrs, data = read(simulate(setup, tmp_path / "run"))
    cm = CostModel.for_job(setup.cfg, setup.profile)
    s = data["samples"]
    for e in events(data, "rollout"):
        mine = s[(s["iteration"] == e["iteration"]) & (s["rank"] == e["rank"])]
        groups = [mine[mine["prompt"] == p]["response_len"].tolist() for p in np.unique(mine["prompt"])]
        plens = [int(mine[mine["prompt"] == p]["prompt_len"][0]) for p in np.unique(mine["prompt"])]
        assert e["end"] - e["start"] == pytest.approx(cm.rollout_time(groups, plens), rel=1e-9)
        assert e["tokens"] == mine["response_len"].sum()
    for e in events(data, "train"):       # 12 micro-batches on 2 train ranks; all end with the slowest
        assert e["end"] - e["start"] >= cm.train_time(int(e["tokens"]), 2, micro_batches=6) - 1e-9


def test_switch_plan_critical_and_background(tmp_path):
    """A scripted 2 -> 1 -> 3 run: the operations of resize.switch on the ranks it names."""
    attrs, data = read(run(tmp_path, "s", "policy=scripted", "policy.schedule=[2,1,3,3]", "run.iterations=4"))
    crit = lambda e: set(e["rank"][e["critical"] == schema.CRITICAL].tolist())         # noqa: E731
    bg = lambda e: set(e["rank"][e["critical"] == schema.BACKGROUND].tolist())         # noqa: E731
    # iteration 1: 2 -> 1 train ranks; rank 1 leaves training
    assert crit(events(data, "commit", 1)) == {0, 1, 2, 3}
    assert crit(events(data, "stage_out", 1)) == {1} and 0 in bg(events(data, "stage_out", 1))
    assert crit(events(data, "engine_start", 1)) == {1} and crit(events(data, "weight_load", 1)) == {1}
    assert 0 in bg(events(data, "stage_in", 1)) and len(events(data, "release", 1)) == 0
    assert set(events(data, "rollout", 1)["rank"]) == {1, 2, 3}
    # iteration 2: 1 -> 3; ranks 1 and 2 join training
    assert crit(events(data, "release", 2)) == {1, 2}
    assert crit(events(data, "weight_load", 2)) == {0, 1, 2}
    assert bg(events(data, "stage_in", 2)) == {0, 1, 2} and bg(events(data, "stage_out", 2)) == {0}
    assert set(events(data, "train", 2)["rank"]) == {0, 1, 2}
    roles = {int(e["rank"]): e["role"].decode() for e in events(data, "commit", 2)}
    assert roles == {0: "train", 1: "train", 2: "train", 3: "rollout"}     # the new table's roles
    d = data["decisions"]
    assert d["action"].tolist()[:3] == [b"move", b"move", b"keep"] and d["table_version"].tolist()[:2] == [1, 2]
    assert schema.decode_attrs(events(data, "engine_start", 1)["attrs"][0]) == {"restored": False}
    assert schema.decode_attrs(events(data, "release", 2)["attrs"][0]) == {"mode": "sleep"}
    # a rank back in rollout wakes the engine it parked when it joined training (resize.switch)
    attrs, back = read(run(tmp_path, "p", "policy=scripted", "policy.schedule=[3,1,3,1]", "run.iterations=4",
                           "+hardware=h100", "rollout.prompts_per_batch=8", "trainer.sharding=full",
                           "hardware.gpu_memory_bytes=2e11"))   # one train rank holds the 7B model's shards
    cold, warm = events(back, "engine_start", 1), events(back, "engine_start", 3)
    assert [schema.decode_attrs(a)["restored"] for a in cold["attrs"]] == [False, False]
    assert [schema.decode_attrs(a)["restored"] for a in warm["attrs"]] == [True, True]
    assert (cold["end"] - cold["start"]).min() == pytest.approx(60.0)            # h100: engine_start_s
    assert (warm["end"] - warm["start"]).max() == pytest.approx(1.0)             # h100: engine_wake_s
    # across nodes the state moves over the network: a critical reshard instead of staging
    attrs, net = read(run(tmp_path, "n", "policy=scripted", "policy.schedule=[2,1,3,3]", "run.iterations=4",
                          "staging.transport=network"))
    assert crit(events(net, "reshard", 1)) == {0, 1} and crit(events(net, "reshard", 2)) == {0, 1, 2}
    assert len(events(net, "stage_out")) == 0
    # point to point: 2 -> 1 moves rank 1's range to rank 0; 1 -> 3 rank 0's two thirds to ranks 1, 2
    third = 12 * -(-int(attrs["parameters"]) // 3)
    for it, moved in ((1, [12 * (int(attrs["parameters"]) // 2)] * 2), (2, [2 * third, third, third])):
        e = events(net, "reshard", it)
        assert e["bytes"][np.argsort(e["rank"])].tolist() == pytest.approx(moved, abs=24), it


def test_colocated_switches_engine_memory_every_iteration(tmp_path):
    from dynaresize import analysis
    path = run(tmp_path, "c", "policy=colocated", "run.max_lag=0", "run.iterations=3")
    attrs, data = read(path)
    for it in range(3):
        for op in ("release", "engine_start", "weight_load"):
            e = events(data, op, it)
            assert set(e["rank"]) == {0, 1, 2, 3} and (e["critical"] == schema.CRITICAL).all()
    assert len(events(data, "weight_sync")) == 0
    assert set(events(data)["role"][events(data)["iteration"] >= 0]) == {b"both"}
    assert analysis.run_metrics(analysis.load_timeline(path))["kind"] == "colocated"


def test_dynamic_policy_decides_on_simulated_stage_times(tmp_path):
    # Rollout-heavy: long responses, started train-heavy: the policy moves toward rollout.
    attrs, data = read(run(tmp_path, "d", "policy=dynamic", "run.iterations=30", "cluster.ranks=8",
                           "policy.train_ranks=6", "workload.length_median=60", "rollout.prompts_per_batch=16"))
    d = data["decisions"]
    moves = d[d["action"] == b"move"]
    assert len(moves) >= 1 and moves["to_train"][0] < moves["from_train"][0]
    its = data["iterations"]
    assert its["train_ranks"][-2] < 6
    # every decision predicted the next iteration's time; the analysis compares it with the measured
    from dynaresize import analysis
    tl = analysis.load_timeline(tmp_path / "d")
    pred = analysis.predictions(tl)
    assert len(pred) == len(its) - 1 and np.isfinite(pred["error"]).all()
    assert pred["error"].abs().median() < 0.10
    assert analysis.run_metrics(tl)["prediction_error_median"] == pytest.approx(pred["error"].abs().median())
    files = analysis.write_report(tl, tmp_path / "report", trace=False)
    assert (tmp_path / "report" / "prediction.png").stat().st_size > 0 and "prediction.png" in files


def test_oracle_bounds_every_static_split(tmp_path):
    from dynaresize import analysis
    common = ["cluster.ranks=6", "run.iterations=12", "rollout.prompts_per_batch=12", "workload.length_growth=0.2"]
    times = {}
    for k in range(1, 6):
        path = run(tmp_path, f"static{k}", *common, f"policy.train_ranks={k}")
        times[k] = analysis.run_metrics(analysis.load_timeline(path))["total_time_s"]
    path = run(tmp_path, "oracle", *common, "policy.name=oracle")
    m = analysis.run_metrics(analysis.load_timeline(path))
    assert m["kind"] == "oracle" and m["resizes"] >= 1
    assert m["total_time_s"] <= min(times.values()) + 1e-9
    attrs, data = read(path)
    assert len(events(data, "commit")) == 0                 # free switching: no switch op
    assert yaml.safe_load(attrs["config"])["policy"]["train_ranks"] == data["iterations"]["train_ranks"][0]
    # without foresight of the lengths it generates, an oracle is slower, never faster
    blind = analysis.run_metrics(analysis.load_timeline(run(tmp_path, "expected", *common,
                                                            "policy.name=oracle_expected")))
    assert blind["kind"] == "oracle" and blind["resizes"] >= 1
    assert m["total_time_s"] <= blind["total_time_s"] + 1e-9


def test_the_expected_oracle_never_reads_the_lengths_it_is_about_to_generate(tmp_path):
    """oracle_expected prices batch b from samples of the workload at b, not from batch b's hidden
    lengths: changing them changes the oracle's prediction, not its own. The batch it trains (b - 1,
    max_lag 1) was generated already, and it does use that one."""
    from dynaresize.data.shapes import BatchShape
    setup = setup_from_overrides(baseline(["cluster.ranks=6", "rollout.prompts_per_batch=12", "policy.name=oracle"]))
    sim = Simulator(setup, tmp_path / "sim")
    expected = setup_from_overrides(baseline(["cluster.ranks=6", "rollout.prompts_per_batch=12",
                                              "policy.name=oracle_expected"]))
    blind = Simulator(expected, tmp_path / "blind").policy
    blind.sim = sim                                     # both read the same batches

    def predictions():
        sim._predictions.clear()
        blind._iteration = None
        return ([sim.predict(3, k).total for k in range(1, 6)], [blind.predict(3, k).total for k in range(1, 6)])

    def longer(b):
        s = sim.batch(b)
        sim._batches[b] = BatchShape(s.digits, s.context_lens, s.prompt_lens, s.response_lens * 3, s.trained)

    true0, blind0 = predictions()
    longer(3)                                           # the batch iteration 3 generates
    true1, blind1 = predictions()
    assert all(b > a for a, b in zip(true0, true1)) and blind1 == blind0
    longer(2)                                           # the batch iteration 3 trains
    blind2 = predictions()[1]                           # (the stages overlap: it shows where training is longer)
    assert all(b >= a for a, b in zip(blind1, blind2)) and any(b > a for a, b in zip(blind1, blind2))


def test_jobconfig_api_and_config_errors(tmp_path):
    from dynaresize.launch.validate import load_config
    cfg = load_config({"cluster": {"ranks": 16}, "policy": {"train_ranks": 8}, "trainer": {"sharding": "full"},
                       "rollout": {"prompts_per_batch": 64}, "run": {"iterations": 3, "mode": "simulate"}})
    path = simulate(cfg, tmp_path / "api", hardware="h100")
    attrs, data = read(path)
    assert attrs["hardware"] == "h100" and attrs["parameters"] == 7_615_616_512
    assert data["iterations"]["end"][-1] > 3 * 1.0                      # a 7B model on H100s: seconds
    from dynaresize.timeline.writer import TimelineWriter
    (tmp_path / "real").mkdir()
    TimelineWriter(tmp_path / "real" / "timeline.h5", {"mode": "real"}).close(complete=True)
    with pytest.raises(FileExistsError, match="real run"):
        simulate(cfg, tmp_path / "real")
    with pytest.raises(ConfigError, match="sim.units"):
        prepare(compose(["cluster.ranks=16", "sim.units=5"]))
    with pytest.raises(ConfigError, match="hardware"):
        setup_from_overrides(["+hardware=h100", "hardware.peak_flops=0"])
    with pytest.raises(ConfigError, match="policy.name"):
        setup_from_overrides(["policy.name=psychic"])
    s = setup_from_overrides(["cluster.ranks=64", "sim.units=8", "sim.train_units=3", "sim.prompts_per_rank=2"])
    assert (s.cfg.policy.resize_unit, s.cfg.policy.train_ranks, s.cfg.rollout.prompts_per_batch) == (8, 24, 128)


def test_command_line_typos_and_types_exit_2(tmp_path):
    """`dynaresize-sim` checks the command line as `dynaresize` does (dynaresize.launch.cli.check_command_line,
    with the simulator's schema): a typo or a wrong type exits 2 naming the key, no traceback."""
    for override, key in (("trainer.lrr=1", "trainer.lrr"), ("sim.units=many", "sim.units")):
        bad = subprocess.run([sys.executable, "-m", "dynaresize.sim.cli", f"hydra.run.dir={tmp_path / 'x'}", override],
                             capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert bad.returncode == 2 and key in bad.stderr and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert not (tmp_path / "x").exists()


def test_1024_ranks_50_iterations(tmp_path):
    """Scale: 1,024 ranks, 2,048 prompts x 4 samples a batch, 50 iterations (docs/concepts/cost-model.md gives the
    1,000-iteration time)."""
    setup = setup_from_overrides(["cluster.ranks=1024", "run.iterations=50", "rollout.prompts_per_batch=2048",
                                  "policy=dynamic", "policy.train_ranks=512"])
    t0 = time.perf_counter()
    sim = Simulator(setup, tmp_path / "big")
    path = sim.run()
    wall = time.perf_counter() - t0
    attrs, data = read(path)
    assert len(data["iterations"]) == 51 and len(data["samples"]) == 50 * 2048 * 4
    assert set(np.unique(events(data, it=10)["rank"])) == set(range(1024))
    print(f"1024 ranks x 50 iterations: {wall:.2f} s, {len(data['events'])} events")


def test_suite_runs_report_progress_while_none_ends_and_keep_their_order():
    """A suite cell's runs come back in the order asked whatever order they finish in, and a
    progress line comes every every_s seconds even while no run ends: on one worker, "slow" ends
    only once a line has said that none is done and that it is running; then "fast" runs."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from dynaresize.sim.suite import run_all
    lines, heard = [], threading.Event()

    def log(line):
        lines.append(line)
        heard.set()

    def run(name):
        if name == "slow":
            assert heard.wait(30)
        return name.upper()
    with ThreadPoolExecutor(1) as pool:
        results = run_all(pool, run, {"slow": "slow", "fast": "fast"}, "h100 16 ranks dapo", log, every_s=0.05)
    assert list(results) == ["slow", "fast"] and results == {"slow": "SLOW", "fast": "FAST"}
    assert lines[0].startswith("[suite] h100 16 ranks dapo: 0/2 runs done, running slow, ")
    assert all("/2 runs done" in line for line in lines)


def test_a_stopped_suite_keeps_the_summary_of_its_finished_cells(tmp_path):
    """summary.csv is written after every cell: a suite stopped in its second cell (here by its log
    raising at that cell's line, which comes before the cell's summary row) keeps the first."""
    import pandas as pd

    from dynaresize.sim.suite import run_suite

    def log(line):
        if "dapo" in line:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        run_suite(str(tmp_path), [16], ["h100"], ["stationary", "dapo"],
                  ["run.iterations=4", "sim.units=4", "sim.prompts_per_rank=2"], jobs=1, keep="none", log=log)
    summary = pd.read_csv(tmp_path / "summary.csv")
    assert list(summary["workload"]) == ["stationary"] and summary["dynamic"].iloc[0] > 0
    assert "stationary" in (tmp_path / "summary.md").read_text()


def test_suite_writes_the_table_for_each_workload(tmp_path):
    """`dynaresize-sim suite --tail` at a small size: every row for every workload, the hindsight-best
    static split as the reference, the oracle at least as fast as every static split (free
    switching, exact prediction) and the bound above the oracle; the tail mechanisms' rows, a
    mechanism the workload refuses (dapo's dynamic sampling and migration) left out by name;
    CSV, Markdown and PNG per workload, and the results page."""
    import pandas as pd

    from dynaresize import analysis
    out = tmp_path / "suite"
    cmd = [sys.executable, "-m", "dynaresize.sim.cli", "suite", "--ranks", "16", "--workloads", "stationary,dapo",
           "--out", str(out), "--jobs", "2", "--keep", "all", "--tail", "--page", str(tmp_path / "page.md"),
           "run.iterations=8", "sim.units=4", "sim.prompts_per_rank=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[suite] h100    16 ranks  stationary" in proc.stdout
    for w in ("stationary", "dapo"):
        folder = out / "h100-16" / w
        assert {"table.csv", "table.md", "table.png"} <= {p.name for p in folder.iterdir()}
        df = pd.read_csv(folder / "table.csv").set_index("row")
        assert list(df.index) == ["static, hindsight-best", "static, pilot", "colocated", "dynamic",
                                  "dynamic + stealing", "dynamic + speculation", "dynamic + migration",
                                  "dynamic + tail", "static + tail", "oracle, expected lengths", "oracle", "bound",
                                  "bound + speculation"]
        x = df["throughput_x"]
        assert x["static, hindsight-best"] == 1.0 and x["static, pilot"] <= 1.0
        assert x["oracle"] >= 1.0 - 1e-9 and x["bound"] > x["oracle"]
        assert x["oracle"] >= x["oracle, expected lengths"] - 1e-9
        assert df.loc["colocated", "critical_switch_s"] > 0 and 0 < df.loc["dynamic", "busy_share"] <= 1
        runs = sorted(p.name for p in (folder / "runs").iterdir())
        migration = ["dynamic_migration"] if w == "stationary" else []
        assert runs == sorted(["static_01", "static_02", "static_03", "dynamic", "dynamic_stealing", "colocated",
                               "oracle", "oracle_expected", "tail_static_01", "tail_static_02", "tail_static_03",
                               "dynamic_speculation", "dynamic_tail", *migration])
        # the tail rows: static + tail is the best of its sweep; speculation shortens the longest sample
        tail_static = [analysis.run_metrics(analysis.load_timeline(folder / "runs" / f"tail_static_0{u}"))["tokens_per_s"]
                       for u in (1, 2, 3)]
        assert df.loc["static + tail", "tokens_per_s"] == pytest.approx(max(tail_static), rel=1e-9)
        assert x["dynamic + speculation"] > x["dynamic"] and x["bound + speculation"] > x["bound"]
        assert (df.loc["dynamic + migration", "split"] == "not allowed") == (w == "dapo")
        assert np.isnan(x["dynamic + migration"]) == (w == "dapo")
    summary = pd.read_csv(out / "summary.csv").set_index("workload")
    assert np.isnan(summary.loc["dapo", "dynamic + migration"]) and np.isnan(summary.loc["dapo", "gap_closed_migration"])
    s = summary.loc["stationary"]
    assert s["tail_vs_static_tail"] == pytest.approx(s["dynamic + tail"] / s["static + tail"], rel=1e-12)
    assert s["gap_closed_tail"] == pytest.approx((s["dynamic + tail"] - s["dynamic"])
                                                 / (s["bound + speculation"] - s["dynamic"]), rel=1e-12)
    page = (tmp_path / "page.md").read_text()
    assert "With the tail mechanisms" in page and "| `dapo` |" in page
    summary = summary.reset_index()
    assert len(summary) == 2 and (summary["static, hindsight-best"] == 1.0).all()
    assert (summary["dynamic_vs_oracle"] == summary["dynamic"] / summary["oracle"]).all()
    assert (summary["dynamic_vs_expected"] == summary["dynamic"] / summary["oracle, expected lengths"]).all()
    assert (summary["turns"] >= 0).all() and (summary["resizes"] >= summary["turns"]).all()
    assert (summary["decide_s"] > 0).all() and ((summary["decide_share"] > 0) & (summary["decide_share"] < 1)).all()
    assert ((summary["prediction_error"] > 0) & (summary["prediction_error"] < 1)).all()
    # the dynamic run's own error, as `dynaresize-analyze` gives it
    for w, error in zip(summary["workload"], summary["prediction_error"]):
        tl = analysis.load_timeline(out / "h100-16" / w / "runs" / "dynamic")
        assert error == pytest.approx(analysis.predictions(tl)["error"].abs().median(), rel=1e-12)
    # by default only the timelines of the table's runs stay (here without the tail rows)
    kept = tmp_path / "kept"
    proc = subprocess.run(cmd[:cmd.index("--out")] + ["--out", str(kept)] + cmd[cmd.index("--jobs"):cmd.index("--keep")]
                          + cmd[cmd.index("run.iterations=8"):], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = pd.read_csv(kept / "h100-16" / "stationary" / "table.csv")
    assert {p.name for p in (kept / "h100-16" / "stationary" / "runs").iterdir()} == set(table["run"]) - {"-"}
    bad = subprocess.run([sys.executable, "-m", "dynaresize.sim.cli", "suite", "--workloads", "nope"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert bad.returncode == 2 and "unknown ['nope']" in bad.stderr
