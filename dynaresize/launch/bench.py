"""Switch benchmark: what communicator reuse and off-critical-path staging save, side by side.

    dynaresize-bench [--ranks 4] [--repeats 3] [hydra overrides ...]
    dynaresize-bench memory ...     (what a train rank holds under FSDP2: bench_memory.py)

One MPI job (started with mpiexec like a run) builds the real runtime on a larger model, then
switches back and forth between two splits under each variant, interleaved so that machine noise
hits all variants alike. After every switch the new train ranks run a real training step: the
useful work that background operations overlap. Per switch it records the critical-path time
(slowest rank's critical operations), the total switch work (all ranks' operations), the hidden
share (1 - critical / total), and the staging bandwidth (all stage-out writes together); after
each switch rank 0 measures the raw disk bandwidth of the staging directory (O_DIRECT writes), so
both see the same machine noise. It prints medians per variant.
"""
from __future__ import annotations

import argparse
import dataclasses
import mmap
import os
import statistics
import sys
import time

VARIANTS = (
    ("reuse, staging in background", True, False),
    ("no reuse, staging in background", False, False),
    ("reuse, staging on critical path", True, True),
)
# A model large enough for staging to take measurable time (about 26M parameters).
BENCH_MODEL = ["model.hidden_size=512", "model.num_layers=8", "model.num_heads=8", "model.num_kv_heads=4",
               "model.intermediate_size=1408"]


def raw_disk_mb_s(directory: str, total_mb: int = 256, block_mb: int = 4) -> float:
    """Direct (page-cache bypassing) sequential write bandwidth of `directory`'s file system."""
    path = os.path.join(directory, "raw-disk-probe")
    buf = mmap.mmap(-1, block_mb * 2**20)           # page-aligned, as O_DIRECT requires
    buf.write(os.urandom(len(buf)))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    fd = os.open(path, flags, 0o600)
    try:
        start = time.perf_counter()
        for _ in range(total_mb // block_mb):
            os.write(fd, buf)
        os.fsync(fd)
        return total_mb / (time.perf_counter() - start)
    finally:
        os.close(fd)
        os.remove(path)


def switch_metrics(events: list[dict]) -> dict:
    from ..timeline.schema import CRITICAL, SWITCH_OPS

    ops = [e for e in events if e["name"] in SWITCH_OPS]
    per_rank: dict[int, float] = {}
    for e in ops:
        if e["critical"] == CRITICAL:
            per_rank[e["rank"]] = per_rank.get(e["rank"], 0.0) + e["end"] - e["start"]
    total = sum(e["end"] - e["start"] for e in ops)
    # Staging bandwidth: all ranks' stage-out writes together, over the time they took together.
    out = [e for e in ops if e["name"] == "stage_out" and e["bytes"] > 0]
    span = max((e["end"] for e in out), default=0.0) - min((e["start"] for e in out), default=0.0)
    return {"critical_s": max(per_rank.values(), default=0.0), "total_s": total,
            "critical_sum_s": sum(per_rank.values()),
            "staging_mb_s": sum(e["bytes"] for e in out) / 2**20 / span if span > 0 else float("nan")}


def run_benchmark(ctrl, overrides: list[str], repeats: int, splits: tuple[int, int]) -> list[dict] | None:
    from hydra import compose, initialize_config_dir

    from .. import CONF_DIR
    from . import cli  # noqa: F401 - cli registers the config schema
    from .validate import load_config
    from ..runtime.groups import GroupRegistry
    from ..runtime.job import Job
    from ..plan.policy import Decision

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        raw = compose("config", overrides=BENCH_MODEL + overrides)
    cfg = load_config(raw)
    job = Job(cfg, ctrl)
    batch = job.exchange(0, job.rollout(0, batch=0))
    registries = {True: job.registry, False: None}
    rows, it = [], 1
    for rep in range(repeats):
        for name, reuse, critical in VARIANTS:
            if registries[reuse] is None:
                registries[reuse] = GroupRegistry(job.world, cfg.policy.resize_unit, reuse=False)
            registry, staging = registries[reuse], dataclasses.replace(cfg.staging, critical=critical)
            for target in (splits[1], splits[0]):
                job.rec.take()
                job.switch(it, Decision(it, job.table.num_train, target, "benchmark"), registry=registry,
                           staging=staging)
                job.train(it, batch)                    # the useful work background ops overlap
                job.settle_background()
                events = ctrl.gather(job.rec.take())
                ctrl.barrier()
                job._remove_staged_files()
                if ctrl.rank == 0:
                    m = switch_metrics([e for part in events for e in part])
                    disk = raw_disk_mb_s(os.path.dirname(job.staging_dir) or ".")   # interleaved, same noise
                    rows.append({"variant": name, "repeat": rep, "to_train": target,
                                 "groups_created": registry.created_after_startup,
                                 "raw_disk_mb_s": disk, **m})
                ctrl.barrier()
                it += 1
    job.finish()
    return rows if ctrl.rank == 0 else None


def table(rows: list[dict]) -> str:
    lines = [f"{'variant':34} {'critical s':>10} {'total s':>9} {'hidden':>7} {'staging MB/s':>12} "
             f"{'raw disk MB/s':>13} {'staging/disk':>12}"]
    for name, _, _ in VARIANTS:
        mine = [r for r in rows if r["variant"] == name]
        crit = statistics.median(r["critical_s"] for r in mine)
        total = statistics.median(r["total_s"] for r in mine)
        hidden = statistics.median(1 - r["critical_sum_s"] / r["total_s"] for r in mine if r["total_s"] > 0)
        staging = statistics.median(r["staging_mb_s"] for r in mine)
        disk = statistics.median(r["raw_disk_mb_s"] for r in mine)
        ratio = statistics.median(r["staging_mb_s"] / r["raw_disk_mb_s"] for r in mine)
        lines.append(f"{name:34} {crit:10.3f} {total:9.3f} {hidden:7.0%} {staging:12.0f} {disk:13.0f} "
                     f"{ratio:12.2f}")
    return "\n".join(lines)


def rank_main(argv: list[str]) -> None:
    """One rank of the benchmark job (started by `main` through mpiexec)."""
    from ..runtime.comm import ControlPlane

    repeats, lo, hi, out_dir, *overrides = argv
    ctrl = ControlPlane()
    try:
        rows = run_benchmark(ctrl, [f"run.output_dir={out_dir}", *overrides], int(repeats), (int(lo), int(hi)))
    except BaseException:
        import traceback
        traceback.print_exc()
        ctrl.abort(1)
        return
    if rows is not None:
        import json
        with open(os.path.join(out_dir, "switch_bench.json"), "w") as f:
            json.dump(rows, f, indent=1)
        print(f"\nswitches {lo} <-> {hi} train ranks of {ctrl.size}, {repeats} repeat(s) per variant, "
              f"medians per switch:\n{table(rows)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["memory"]:         # `dynaresize-bench memory ...`: what a train rank holds (bench_memory.py)
        from .bench_memory import main as memory_main
        return memory_main(argv[1:])
    parser = argparse.ArgumentParser(prog="dynaresize-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--splits", default="1,3", help="the two train-rank counts to switch between")
    parser.add_argument("--out", default=None, help="output dir (default: outputs/bench-TIME)")
    parser.add_argument("--page", default=None, help="also write the table as a results page (Markdown)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the run config")
    args = parser.parse_args(argv)
    from .local import mpi_env, mpiexec_command

    out = os.path.abspath(args.out or time.strftime("outputs/bench-%Y-%m-%d_%H-%M-%S"))
    os.makedirs(out, exist_ok=True)
    lo, hi = args.splits.split(",")
    cmd = mpiexec_command(args.ranks) + [sys.executable, "-m", "dynaresize.launch.bench", "--rank", str(args.repeats), lo, hi, out,
            f"cluster.ranks={args.ranks}", f"policy.train_ranks={lo}", "run.save_model=false", *args.overrides]
    import subprocess
    code = subprocess.run(cmd, env=mpi_env()).returncode
    if code == 0 and args.page:
        import json
        from ..analysis.pages import write_page
        with open(os.path.join(out, "switch_bench.json")) as f:
            rows = json.load(f)
        body = (f"Switches {lo} <-> {hi} train ranks of {args.ranks} ranks, {args.repeats} repeat(s) per variant; "
                f"medians per switch, each variant interleaved with the others in one MPI job, the raw disk "
                f"bandwidth (O_DIRECT writes) measured after every switch:\n\n```\n{table(rows)}\n```\n\n"
                f"What the variants are: [the switch benchmark](../concepts/switch.md#the-switch-benchmark).")
        write_page(args.page, "Switch benchmark", ["dynaresize-bench", *argv], body)
        print(f"results page: {args.page}", flush=True)
    return code


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2:])
    else:
        sys.exit(main())
